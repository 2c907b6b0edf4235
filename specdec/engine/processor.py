"""Request building: a prompt and its sampling parameters become a checked ``Request``.

Tokenization, prompt checks, the seed drawn at admission, penalties, logit_bias and bad_words as
tensors, the grammar of a structured output, the cache salt. Everything that can refuse a request
happens here, before it reaches the scheduler (vLLM v1's processor).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import time

import torch

from specdec.engine.detokenizer import IncrementalDetokenizer
from specdec.engine.request import Request
from specdec.model.tokenizer import Tokenizer
from specdec.outputs import RequestMetrics
from specdec.sample.bad_words import BadWords
from specdec.sample.logprobs import LogitsAdjust
from specdec.sample.random import normalize_seed
from specdec.sample.rejection_sampler import PenaltyState
from specdec.sampling_params import SamplingParams
from specdec.structured.grammar import GrammarCompiler


class Processor:
    """Builds checked requests for a model with ``vocab_size`` tokens and ``max_model_len``."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        device: torch.device,
        seed: int | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = device
        # NOTE: requests without a seed draw one here, at admission, and then take the same
        # keyed path as seeded ones.
        self._seeds = random.Random(seed)
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # built on the first structured request

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def make_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        req_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """A checked request, not yet queued. Raises ValueError naming what is wrong."""
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(
                f"sampling params must be a SamplingParams, not {type(sampling).__name__}"
            )
        sampling.validate()  # NOTE: fields may have been changed since it was made
        if sampling.num_samples > 1:
            raise ValueError(
                "n and best_of: one engine request is one sequence; LLM.generate and the server "
                "expand them (SamplingParams.for_sample)"
            )
        ids = self._prompt_ids(prompt)
        self._check_prompt(ids)
        req = Request(
            req_id=req_id or self.new_request_id(),
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=ids,
            sampling=sampling,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, sampling.skip_special_tokens),
            metrics=RequestMetrics(arrival_time=time.monotonic()),
        )
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(64)
        req.seed = normalize_seed(seed)
        if sampling.has_penalties:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            mask[torch.tensor(ids, device=self.device)] = True
            req.penalty = PenaltyState(mask, torch.zeros(self.vocab_size, device=self.device))
        req.logits_adjust = self._logits_adjust(sampling)
        if sampling.structured_outputs is not None:
            req.grammar = self.grammar_compiler.compile(sampling.structured_outputs)
        if cache_salt is not None:
            req.cache_salt = _salt(cache_salt)
        return req

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints against this model's tokenizer."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer, self.vocab_size, sorted(self.tokenizer.eog_token_ids)
            )
        return self._grammars

    def bad_words(self, words: list[str]) -> BadWords:
        """``words`` tokenized and indexed for ``SamplingParams.compiled_bad_words`` (thread-safe:
        the server calls it on its preparation pool). Raises ValueError naming bad_words."""
        return BadWords.build(words, lambda texts: self.tokenizer.encode_batch(texts, False))

    def _logits_adjust(self, sampling: SamplingParams) -> LogitsAdjust | None:
        """logit_bias as tensors (token ids checked against the vocabulary) and bad_words as
        token sequences (vLLM's tokenization), or None."""
        if not sampling.logit_bias and not sampling.bad_words:
            return None
        adjust = LogitsAdjust()
        if sampling.logit_bias:
            bad = [t for t in sampling.logit_bias if t >= self.vocab_size]
            if bad:
                raise ValueError(f"logit_bias: token id {bad[0]} is not in [0, {self.vocab_size})")
            ids = list(sampling.logit_bias)
            adjust.bias_token_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
            adjust.bias_values = torch.tensor(
                [float(sampling.logit_bias[t]) for t in ids], device=self.device
            )
        if sampling.bad_words:
            ready = sampling.compiled_bad_words
            if not (isinstance(ready, BadWords) and ready.words == tuple(sampling.bad_words)):
                ready = self.bad_words(sampling.bad_words)
            adjust.bad_words = ready
        return adjust

    def _prompt_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            for i, t in enumerate(prompt):
                if not isinstance(t, int) or isinstance(t, bool):
                    raise ValueError(
                        f"prompt token ids must be integers; item {i} is {type(t).__name__}"
                    )
            return list(prompt)
        raise ValueError(
            f"prompt must be a string or a list of token ids, not {type(prompt).__name__}"
        )

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, at or beyond max_model_len {self.max_model_len}"
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")


def _salt(cache_salt: object) -> int:
    """vLLM's ``cache_salt`` as the nonzero 64-bit key the prefix cache and drafters compare."""
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError("cache_salt must be a non-empty string")
    digest = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little", signed=True) or 1
