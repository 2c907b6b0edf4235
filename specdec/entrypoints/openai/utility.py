"""The small endpoints clients call besides completions, in vLLM's shapes: ``POST /tokenize``,
``POST /detokenize`` (llama.cpp's ``content`` field too), ``GET /v1/models/{id}``, ``/version``,
``/ping``. Tokenization goes through the same code as a completion's prompt (the chat template
included), so the ids are the ones a request would feed the model."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ModelCard,
    ModelList,
    RequestError,
)

MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(BaseModel):
    """Either ``prompt`` (llama.cpp: ``content``) or ``messages`` (a chat, through the template)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = Field(None, max_length=1 << 22)
    content: str | None = Field(None, max_length=1 << 22)
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False
    special_tokens_in_content: Literal["allow", "text", "reject"] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [n for n in ("prompt", "content", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt (content) or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)


def _check_model(serving: Any, model: str | None) -> None:
    if model is not None and model not in serving.served_model_names:
        raise RequestError(
            "no such model; GET /v1/models lists the served ones",
            param="model",
            status=404,
            code="model_not_found",
        )


async def tokenize(serving: Any, req: TokenizeRequest) -> dict[str, Any]:
    """vLLM's response: ``tokens``, ``count``, ``max_model_len`` (and ``token_strs`` on request)."""
    _check_model(serving, req.model)
    if req.messages is not None:
        chat = ChatCompletionRequest.model_validate(
            {
                "messages": req.messages,
                "add_generation_prompt": req.add_generation_prompt,
                "chat_template_kwargs": req.chat_template_kwargs,
                "special_tokens_in_content": req.special_tokens_in_content,
            }
        )
        ids = await serving._chat_prompt_ids(chat)
    else:
        text = req.prompt if req.prompt is not None else req.content
        add = True if req.add_special_tokens is None else req.add_special_tokens
        mode = serving.special_token_mode(req.special_tokens_in_content)
        ids = await serving.run_blocking(serving._encode_prompt, text, add, mode)
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}
    if req.return_token_strs:
        tok = serving.tokenizer
        out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
    return out


async def detokenize(serving: Any, req: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's ``prompt`` and llama.cpp's ``content``: the same text (special tokens kept)."""
    _check_model(serving, req.model)
    vocab = serving.llm.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"tokens: an id outside [0, {vocab})", param="tokens")
    text = await serving.run_blocking(serving.tokenizer.decode, req.tokens, False)
    return {"prompt": text, "content": text}


def model_card(serving: Any, model_id: str) -> dict[str, Any]:
    """``GET /v1/models/{id}``: the served model's card, or a 404 that does not echo the id."""
    _check_model(serving, model_id)
    card = ModelCard(id=model_id, root=serving.model_root, max_model_len=serving.max_model_len)
    return card.model_dump()


def model_list(serving: Any) -> ModelList:
    """``GET /v1/models``: a card per served name."""
    return ModelList(
        data=[
            ModelCard(id=n, root=serving.model_root, max_model_len=serving.max_model_len)
            for n in serving.served_model_names
        ]
    )
