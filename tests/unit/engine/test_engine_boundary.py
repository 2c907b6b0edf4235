"""The engine boundary: outputs built from per-step messages, the one n / best_of fan-out, and
no entry point reaching into the engine's parts."""

import re
from pathlib import Path

from specdec.engine.core_output import EngineCoreOutput
from specdec.engine.output_processor import OutputProcessor
from specdec.engine.samples import merge_group, plan_samples, warmup_sampling
from specdec.outputs import RequestMetrics
from specdec.sample.logprobs import TokenLogprobs
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.metrics import SpecDecodeStats

REPO = Path(__file__).resolve().parents[3]


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


class _Req:
    """What ``OutputProcessor.add_request`` reads of a queued request."""

    def __init__(self, req_id: str, sampling: SamplingParams) -> None:
        self.req_id, self.prompt, self.prompt_token_ids = req_id, "hi", [1, 2]
        self.sampling = sampling


def _msg(req_id: str, ids: list[int], text: str, ends: list[int], **kw) -> EngineCoreOutput:
    return EngineCoreOutput(
        req_id=req_id, new_token_ids=ids, output_text=text, new_char_ends=ends,
        new_from_draft=[False] * len(ids), new_logprobs=kw.pop("logprobs", []),
        spec_stats=SpecDecodeStats(), metrics=RequestMetrics(arrival_time=0.0),
        num_cached_tokens=0, finished=kw.pop("finished", False), **kw,
    )  # fmt: skip


def test_outputs_come_from_messages_alone() -> None:
    proc = OutputProcessor(_Tok())  # type: ignore[arg-type]
    proc.add_request(_Req("a", SamplingParams(stop=["xyz"], logprobs=0)))  # type: ignore[arg-type]
    lp = TokenLogprobs(5, -0.5, 1, [], [])
    first = proc.make_output(_msg("a", [5], "hello", [5], logprobs=[lp]))
    assert first is not None and not first.finished
    # a possible stop string's start (2 characters) is held back
    assert first.delta_text == "hel" and first.delta_token_ids == [5]
    assert first.outputs[0].cumulative_logprob == -0.5
    last = proc.make_output(
        _msg("a", [6], "hello w", [8], logprobs=[lp], finished=True, finish_reason="stop")
    )
    assert last is not None and last.finished
    assert last.delta_text == "lo w" and last.outputs[0].token_ids == [5, 6]
    assert [p.text_end for p in last.delta_provenance] == [7]  # clipped to the final text
    assert len(last.outputs[0].logprobs) == 2
    assert proc.make_output(_msg("a", [], "", [])) is None  # forgotten once finished


def test_one_fan_out_for_n_and_best_of() -> None:
    one = plan_samples(SamplingParams(), "r", 10, True)
    assert one.samples == [("r", SamplingParams())] and one.warmup is None
    sp = SamplingParams(n=2, best_of=3, seed=7)
    plan = plan_samples(sp, "g", 10, True)
    assert [i for i, _ in plan.samples] == ["g-0", "g-1", "g-2"]
    assert [s.seed for _, s in plan.samples] == [7, 8, 9]
    assert plan.warmup is not None and plan.warmup.max_tokens == 1
    assert warmup_sampling(sp, 10, False) is None  # no prefix cache to share it through
    assert warmup_sampling(sp, 1, True) is None
    assert warmup_sampling(SamplingParams(n=2, prompt_logprobs=1), 10, True) is None
    assert merge_group("x", ["only"], SamplingParams()) == "only"  # type: ignore[list-item]


def test_entry_points_use_the_public_engine_surface() -> None:
    """The CLI, the server and the replicas hold no ``.engine.X`` reach-ins."""
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for path in sorted((REPO / "specdec" / "entrypoints").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\.engine\.[a-z_]", line) and "specdec.engine." not in line
    ]
    assert found == []
