"""Structured output: a request's text constrained by a JSON schema, regex, choice or grammar."""

from specdec.structured.grammar import Grammar, GrammarCompiler, GrammarError, TokenMask
from specdec.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = [
    "Grammar",
    "GrammarCompiler",
    "GrammarError",
    "GuidedDecodingParams",
    "StructuredOutputsParams",
    "TokenMask",
]
