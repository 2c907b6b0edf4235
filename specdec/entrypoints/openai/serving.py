"""The OpenAI endpoints' logic as one object: ``OpenAIServing``, what ``api_server`` serves.

Each endpoint family lives in its own module over a shared base (``serving_engine.py``: checks,
thread pools, the engine requests behind a response and the one streaming loop):
``serving_chat.py`` (chat completions, the Responses API's path), ``serving_completion.py``
(completions), ``utility.py`` (models, tokenize, detokenize). The names other modules imported
from here before the split are re-exported.
"""

from __future__ import annotations

from specdec.entrypoints.openai.serving_chat import OpenAIServingChat
from specdec.entrypoints.openai.serving_completion import OpenAIServingCompletion
from specdec.entrypoints.openai.serving_engine import OpenAIServingBase
from specdec.entrypoints.openai.serving_stream import EventStream
from specdec.entrypoints.openai.serving_utils import (
    DONE,
    MAX_REASON_CHARS,
    encode_json,
    internal_error,
    shutting_down_error,
)

__all__ = [
    "DONE",
    "MAX_REASON_CHARS",
    "EventStream",
    "OpenAIServing",
    "OpenAIServingBase",
    "OpenAIServingChat",
    "OpenAIServingCompletion",
    "encode_json",
    "internal_error",
    "shutting_down_error",
]


class OpenAIServing(OpenAIServingChat, OpenAIServingCompletion):
    """Every endpoint family on one object (one set of thread pools, one shutdown). A
    ``template_sandbox``: requests may send their own chat template (vLLM's
    ``--trust-request-chat-template``), rendered there; otherwise such requests get a 400."""
