"""Prompt shapes ``LLM.generate`` takes besides a string, as vLLM's ``vllm.inputs`` names them:
``TextPrompt`` ({"prompt": text}) and ``TokensPrompt`` ({"prompt_token_ids": ids}), each with an
optional ``cache_salt``. Plain dicts of these keys work the same."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt
