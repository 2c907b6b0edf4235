"""Request and response bodies of the OpenAI-compatible API (with vLLM's sampling extras).

Unknown fields are accepted and reported (``ignored_fields``), as vLLM does, except those that
would silently change the result (beam search, logits processors, ...): those are rejected by
``check_supported``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    ValidationError,
)

from specdec.sampling_params import (
    INT_MAX,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    SEED_RANGE,
    TEMPERATURE_MAX,
    SamplingParams,
)
from specdec.structured.params import StructuredOutputsParams

# Fields we do not implement whose presence changes the output: reject rather than ignore.
_UNSUPPORTED: dict[str, str] = {
    "use_beam_search": "beam search is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "logits_processors": "logits processors are not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "continue_final_message": "continue_final_message is not supported",
}

# NOTE: integers and booleans are strict (``n: true``, ``stream: "yes"``, ``max_tokens: "16"``
# are refused, naming the field, not coerced); the numbers come from SamplingParams, which
# checks them again; floats are finite here
# (allow_inf_nan=False below, and the body parser refuses NaN, Infinity and 1e999 before this).
Temperature = Annotated[float, Field(ge=0.0, le=TEMPERATURE_MAX)]
Penalty = Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]
RepetitionPenalty = Annotated[
    float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
PositiveInt = Annotated[StrictInt, Field(ge=1, le=INT_MAX)]
NonNegInt = Annotated[StrictInt, Field(ge=0, le=INT_MAX)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT_MAX)]
Seed = Annotated[StrictInt, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])]
Logprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
MAX_CACHE_SALT_CHARS = 256
MAX_PROMPTS = 128  # a batched completion request
MAX_CHAT_TEMPLATE_CHARS = 128 * 1024
MAX_NAME_CHARS = 256  # user
MAX_MODEL_NAME_CHARS = 4096  # served names default to the model path


MAX_ERROR_CHARS = 1024  # an error body's message
# what str.splitlines() breaks at: a message cut at the first is one line for every reader
_LINE_BREAK = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def one_line(text: str, limit: int) -> str:
    """``text``'s first line, cut to ``limit`` characters (``...`` where something was cut)."""
    line, *rest = _LINE_BREAK.split(text, maxsplit=1)
    if len(line) > limit or rest:
        return line[:limit] + "..."
    return line


class RequestError(ValueError):
    """A request the server refuses: HTTP ``status`` with an OpenAI-style error body. The
    message is cut to one line of at most ``MAX_ERROR_CHARS`` characters, whatever it holds."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = "invalid_value",
        type: str = "invalid_request_error",
    ) -> None:
        message = one_line(message, MAX_ERROR_CHARS)
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump()


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _is_union_label(part: int | str) -> bool:
    """pydantic adds the failing branch's type (``str``, ``list[int]``, ``constrained-str``) to a
    union's location."""
    return isinstance(part, str) and (
        part in _TYPE_LABELS or "[" in part or part.startswith("constrained-")
    )


def _loc_to_param(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` -> ``messages[0].role``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def validation_error(e: ValidationError) -> RequestError:
    """The first problem of a pydantic error, as a 400 naming the field."""
    errors = e.errors(include_url=False)
    loc = tuple(errors[0].get("loc", ()))
    kind = errors[0].get("type", "")
    cut = next((i for i, part in enumerate(loc) if _is_union_label(part)), None)
    if cut is not None:  # a union fails once per branch
        base = loc[:cut]
        branches = [x for x in errors if tuple(x["loc"][:cut]) == base and len(x["loc"]) > cut]
        for x in branches:  # a branch of the right type failed a bound: say which
            if not x["type"].endswith(("_type", "_parsing")):
                rest = tuple(p for p in x["loc"][cut + 1 :] if not _is_union_label(p))
                param = _loc_to_param(base + rest)
                return RequestError(f"{param}: {x['msg']}", param, code="invalid_value")
        labels = dict.fromkeys(str(x["loc"][cut]).replace("constrained-", "") for x in branches)
        param = _loc_to_param(base)
        return RequestError(
            f"{param}: invalid type or value, expected one of: {', '.join(labels)}",
            param,
            code="invalid_type",
        )
    param = _loc_to_param(loc) or None
    if kind == "missing":
        code = "missing_required_parameter"
    elif kind.endswith(("_type", "_parsing")):
        code = "invalid_type"
    else:
        code = "invalid_value"
    message = f"{param}: {errors[0].get('msg')}" if param else str(errors[0].get("msg"))
    return RequestError(message, param=param, code=code)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def check_supported(self) -> None:
        for key, message in _UNSUPPORTED.items():
            value = (self.model_extra or {}).get(key)
            if value not in (None, False, [], {}, ""):
                raise RequestError(message, param=key, code="unsupported_parameter")


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingRequest(OpenAIBaseModel):
    """The sampling fields both endpoints share."""

    model: Annotated[str, Field(max_length=MAX_MODEL_NAME_CHARS)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # NOTE: keys and values are checked by SamplingParams, with messages that name logit_bias
    # and never its keys (pydantic's would put the key in the error's location)
    logit_bias: Annotated[dict[str, Any], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None
    # vLLM's extras
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT_MAX)] | None = None
    min_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    min_tokens: NonNegInt = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    prompt_logprobs: Logprobs | None = None
    bad_words: (
        Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                  Field(max_length=MAX_BAD_WORDS)]
        | None
    ) = None  # fmt: skip
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # special-token strings in client text: as the server's --special-tokens-in-content, or
    # stricter (allow < text < reject)
    special_tokens_in_content: Literal["allow", "text", "reject"] | None = None
    # per-request speculation: at most this many drafts per step (0 = off), in vLLM's key, and
    # llama.cpp's server keys speculative.n_max (the same) / n_min / p_min
    num_speculative_tokens: NonNegInt | None = None
    speculative_n_max: NonNegInt | None = Field(
        None, validation_alias=AliasChoices("speculative.n_max", "speculative_n_max")
    )
    speculative_n_min: NonNegInt | None = Field(
        None, validation_alias=AliasChoices("speculative.n_min", "speculative_n_min")
    )
    speculative_p_min: Probability | None = Field(
        None, validation_alias=AliasChoices("speculative.p_min", "speculative_p_min")
    )
    # streaming only: each chunk's choice says, per token, how many characters of its text the
    # token wrote and whether it was an accepted draft (``token_provenance``); off by default
    return_token_provenance: StrictBool = False
    # structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: there is one backend (llguidance)
    guided_whitespace_pattern: str | None = None
    # llama.cpp server's fields: a GBNF grammar, a JSON schema
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    _structured_field: str | None = PrivateAttr(None)  # the field the constraint came from
    # who sent it (a hash of the API key, else the host): its lane in shared queues
    _client: str | None = PrivateAttr(None)
    _tool_plan: Any = PrivateAttr(None)  # chat with tools: a tools.ToolPlan

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.return_token_provenance and not self.stream:
            raise RequestError(
                "return_token_provenance is only allowed when stream is true",
                "return_token_provenance",
            )

    def to_sampling_params(
        self, max_tokens: int, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling(
        self,
        max_tokens: int,
        logprobs: int | None,
        defaults: dict[str, Any] | None,
        best_of: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """SamplingParams for this request (``max_tokens`` already resolved against the
        context); ``defaults`` (the server's) fill the sampling fields the request leaves out."""
        d = defaults or {}
        max_drafts = self.num_speculative_tokens
        if self.speculative_n_max is not None:
            if max_drafts is not None and max_drafts != self.speculative_n_max:
                raise RequestError(
                    f"num_speculative_tokens ({max_drafts}) and speculative.n_max "
                    f"({self.speculative_n_max}) disagree; give one",
                    "num_speculative_tokens",
                )
            max_drafts = self.speculative_n_max

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else d.get(name, fallback)

        try:
            return SamplingParams(
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", -1),
                min_p=pick("min_p", 0.0),
                presence_penalty=pick("presence_penalty", 0.0),
                frequency_penalty=pick("frequency_penalty", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=list(self.stop_token_ids or []),
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                n=self.n,
                best_of=best_of,
                prompt_logprobs=prompt_logprobs,
                logit_bias=self.logit_bias,
                bad_words=self.bad_words,
                num_speculative_tokens=max_drafts,
                speculative_n_min=self.speculative_n_min,
                speculative_p_min=self.speculative_p_min,
                structured_outputs=self.structured_params(),
            )
        except RequestError:
            raise
        except ValueError as e:
            raise self.error_for(str(e)) from e

    def structured_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever field gave it (at most one)."""
        given: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, bool)):
                    raise RequestError(
                        "response_format.json_schema.schema must be a JSON schema (an object)",
                        "response_format.json_schema.schema",
                    )
                given.append(("response_format.json_schema.schema", {"json": js["schema"]}))
            elif kind != "text":
                raise RequestError(
                    f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                    "response_format.type",
                )
        if self.structured_outputs is not None:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given.append((f"guided_{name}", {name: value}))
        if self.grammar is not None:
            given.append(("grammar", {"grammar": self.grammar}))
        if self.json_schema is not None:
            given.append(("json_schema", {"json": self.json_schema}))
        if self._tool_plan is not None:
            if given:
                raise RequestError(
                    f"tools that may be called and {given[0][0]} cannot be combined", given[0][0]
                )
            self._structured_field = "tools"
            return self._tool_plan.constraint()
        if not given:
            return None
        if len(given) > 1:
            raise RequestError(
                f"give one output constraint, not {given[0][0]} and {given[1][0]}", given[1][0]
            )
        field, spec = given[0]
        if self.guided_whitespace_pattern is not None and field != "structured_outputs":
            spec["whitespace_pattern"] = self.guided_whitespace_pattern
        self._structured_field = field
        try:
            params = StructuredOutputsParams.from_any(spec)
            params.validate()
        except (TypeError, ValueError) as e:
            raise self.error_for(str(e)) from e
        return params

    def error_for(self, message: str) -> RequestError:
        """A 400 for an error message from SamplingParams or the engine, naming the field the
        user wrote (a structured-output error names response_format / guided_json / ...)."""
        if message.startswith("structured_outputs") and self._structured_field:
            head, _, rest = message.partition(":")
            field = self._structured_field
            if field == "structured_outputs":
                field = head  # structured_outputs.json, ...
            return RequestError(f"{field}:{rest}" if rest else message, field)
        return RequestError(message, self.field_named_by(message))

    @classmethod
    def field_named_by(cls, message: str) -> str | None:
        """The request field an error message starts with (SamplingParams' and the engine's
        messages name the field first), or None."""
        field = message.split(" ", 1)[0].rstrip(":,").split("[", 1)[0]  # stop[1] -> stop
        return field if field in cls.model_fields else None


# ---- /v1/completions ------------------------------------------------------------------------


SamplingRequest = _SamplingRequest  # the fields chat and completion requests share


class CompletionRequest(_SamplingRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: PositiveInt | None = 16
    logprobs: Logprobs | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    echo: StrictBool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of < self.n:
            raise RequestError(f"best_of must be >= n ({self.n}), got {self.best_of}", "best_of")
        if self.stream and (self.best_of or self.n) > self.n:
            raise RequestError("best_of > n cannot be streamed", "best_of")
        if self.echo and self.return_token_provenance:
            raise RequestError(
                "return_token_provenance cannot be combined with echo", "return_token_provenance"
            )

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one, or a batch (a list of strings or of token id lists)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        if len(batch) > MAX_PROMPTS:
            raise RequestError(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        for one in batch:
            if not one:
                raise RequestError("prompt is empty", "prompt")
        return batch  # type: ignore[return-value]

    def to_sampling_params(
        self, max_tokens: int, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        # NOTE: echo with logprobs reports the prompt's tokens too, as vLLM does
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs
        return self._sampling(max_tokens, self.logprobs, defaults, self.best_of, prompt_logprobs)


# ---- /v1/chat/completions -------------------------------------------------------------------


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template_dict(self, index: int) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise RequestError(
                        f"content part type '{part.type}' is not supported; only text",
                        f"messages[{index}].content[{j}].type",
                    )
                texts.append(part.text)
            content = "".join(texts)
        msg: dict[str, Any] = {**(self.model_extra or {}), "role": self.role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Logprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # vLLM's chat extras
    add_generation_prompt: StrictBool = True
    chat_template: Annotated[str, Field(max_length=MAX_CHAT_TEMPLATE_CHARS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if (self.model_extra or {}).get("echo"):
            raise RequestError(
                "echo is not supported on chat completions", "echo", code="unsupported_parameter"
            )
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict(i) for i, m in enumerate(self.messages)]

    def to_sampling_params(
        self, max_tokens: int, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, defaults, None, self.prompt_logprobs)


# ---- responses --------------------------------------------------------------------------------


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


# vLLM's prompt_logprobs: per prompt token (None for the first) token id -> its figures
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    spec_decode: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


# return_token_provenance: per token of a chunk's text, [characters it wrote, 1 if it was an
# accepted draft token else 0]; the characters add up to the chunk's text
TokenProvenanceList = list[list[int]]


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_provenance: TokenProvenanceList | None = None


class _ChoicesBody(BaseModel):
    """The fields a completion and a chat chunk share, in the order they are written; a
    subclass narrows ``object`` and ``choices`` (pydantic keeps an overridden field's place)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: UsageInfo | None = None
    spec_decode: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None  # llama.cpp's server: on the last chunk
    metrics: dict[str, Any] | None = None  # vLLM's per-request metrics: on the last chunk


class ChatCompletionChunk(_ChoicesBody):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    token_provenance: TokenProvenanceList | None = None


class CompletionResponse(_ChoicesBody):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "specdec"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump_chunk(chunk: BaseModel) -> str:
    """One SSE event; ``usage``, ``spec_decode``, ``timings``, ``metrics``, a choice's
    ``token_provenance`` and a delta's ``tool_calls`` appear only where set."""
    d = chunk.model_dump()
    for key in ("usage", "spec_decode", "timings", "metrics"):
        if d.get(key) is None:
            d.pop(key, None)
    for choice in d.get("choices", []):
        if choice.get("token_provenance") is None:
            choice.pop("token_provenance", None)
        delta = choice.get("delta")
        if isinstance(delta, dict) and delta.get("tool_calls") is None:
            delta.pop("tool_calls", None)
    # NOTE: ASCII only: U+2028, U+0085 etc. would end the line for splitlines()-based SSE readers.
    return f"data: {json.dumps(d, separators=(',', ':'))}\n\n"
