"""``specdec train`` end to end on the tiny model: records, training, export, loading.

A random tiny target cannot be predicted from a couple of thousand tokens, so acceptance is
checked on the prompts the head was trained on: it shows that training moves the head toward
the target and that the exported files carry what it learnt (a layout slip drops it to chance).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.model.llama import HIDDEN_FINAL
from specdec.spec_decode import DraftInput, DraftRequest, draft_model, hidden_head
from specdec.spec_decode.eagle3 import Eagle3Proposer
from specdec.train import data
from specdec.train.cli import main as train_main
from specdec.train.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def records(tiny_llama, tmp_path_factory):
    llm = LLM(str(tiny_llama), max_model_len=512, max_num_seqs=8)
    prompts = data.magpie_prompts(llm, 16, max_tokens=40)
    out = tmp_path_factory.mktemp("records")
    data.collect(llm, prompts, out, max_tokens=40, progress=False)
    return llm, prompts, out


def test_magpie_prompts_are_distinct_user_turns(records) -> None:
    llm, prompts, _ = records
    # NOTE: a random tiny model seldom ends its turn: a few rounds may still leave fewer
    assert 12 <= len(prompts) <= 16 and len(set(prompts)) == len(prompts)
    assert all(12 <= len(p) <= 600 for p in prompts)


def test_records_are_the_targets_own(records) -> None:
    llm, prompts, out = records
    d = data.TrainData(out)
    m = d.manifest
    assert m["num_sequences"] == len(prompts) == len(d)
    H = m["hidden_size"]
    tok = llm.get_tokenizer()
    greedy = 0
    for k in range(len(d)):
        s = d.sequence(k)
        n, p = len(s["tokens"]), s["prompt_len"]
        assert s["aux"].shape == (n, 3 * H) and s["aux"].dtype == np.float16
        assert s["final"].shape == (n, H) and s["topk_ids"].shape == (n, data.TOP_K)
        assert np.all(np.diff(s["topk_probs"].astype(np.float32), axis=1) <= 0)
        want = tok.apply_chat_template([{"role": "user", "content": prompts[k]}], tokenize=True)
        assert list(s["tokens"][:p]) == want
        # a greedy response is the target's top choice at every step
        if list(s["tokens"][p:]) == list(s["topk_ids"][p - 1 : n - 1, 0]):
            greedy += 1
    assert greedy == (len(prompts) + 1) // 2  # sampled_fraction 0.5: every other one sampled

    # the stored states are the target's: compare one sequence with a fresh capture
    s = d.sequence(3)
    engine = llm.engine
    layers = tuple(m["aux_layers"]) + (HIDDEN_FINAL,)
    slot = engine.kv.allocate()
    try:
        n = len(s["tokens"])
        _, states = engine.model.forward_capture(
            torch.tensor(s["tokens"], dtype=torch.long), torch.arange(n),
            hidden_head.SeqBatch([slot], [0], [n]), engine.kv, layers,
        )  # fmt: skip
    finally:
        engine.kv.free(slot)
    got = np.concatenate([s["aux"], s["final"]], axis=1).astype(np.float32)
    np.testing.assert_allclose(got, states.numpy(), rtol=2e-3, atol=2e-3)


def test_records_kept_from_generation_equal_a_second_pass(records) -> None:
    # collect keeps the states of generation's own forward passes (and computes a prompt
    # prefix the prefix cache served); a separate pass over the stored tokens gives the same
    # bytes, for every field
    llm, _, out = records
    d = data.TrainData(out)
    for k in range(len(d)):
        s = d.sequence(k)
        again = data.states_of(llm, [int(t) for t in s["tokens"]])
        for name in ("aux", "final", "topk_ids", "topk_probs"):
            assert np.array_equal(np.asarray(s[name]), again[name]), (k, name)


def _chat(llm, prompts) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True) for p in prompts
    ]


def _acceptance(target, head, method: str, prompts) -> tuple[float, list]:
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(target), max_model_len=512, speculative_config=spec)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(_chat(llm, prompts), sp)
    return llm.engine.spec_stats.acceptance_rate, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["eagle3", "eagle", "medusa"])
def test_trained_head_loads_exact_and_better_than_untrained(method, records, tiny_llama, tmp_path):
    llm, prompts, out = records
    cfg = TrainConfig(method=method, epochs=40, batch=4, lr=1e-2, draft_vocab=128,
                      eval_every=50, ckpt_every=1000, val_fraction=0.1)  # fmt: skip
    trainer = Trainer(llm, out, tmp_path / method, cfg)
    before, _ = _acceptance(tiny_llama, trainer.export(), method, prompts)
    trainer.fit(progress=False)
    head = trainer.export()
    after, got = _acceptance(tiny_llama, head, method, prompts)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert got == [o.outputs[0].token_ids for o in llm.generate(_chat(llm, prompts), sp)]
    # NOTE: Medusa guesses two tokens ahead without seeing the next one: it learns least
    assert after > before + (0.01 if method == "medusa" else 0.05), (before, after)
    log = [json.loads(line) for line in (tmp_path / method / "train_log.jsonl").open()]
    assert log[-1]["loss"] < log[0]["loss"] and "val_accepted" in log[-1]


def test_training_head_computes_what_the_drafter_computes(records, tmp_path, monkeypatch):
    """Steps 0 and 1 of the training-time test equal the loaded EAGLE-3 drafter's first and
    second draft logits on the same sequence and states (its first draft forced to the true
    token, as training assumes)."""
    llm, _, out = records
    trainer = Trainer(llm, out, tmp_path / "t", TrainConfig(draft_vocab=128, epochs=1, batch=4))
    trainer.fit(progress=False)
    seq = trainer._tensors(0)
    tokens, aux = seq["tokens"], seq["aux"]
    n = len(tokens)
    with torch.no_grad():
        steps = trainer.model.forward_ttt(trainer.target.embed[tokens[1:]], aux[:-1], 2)
    seen: list[torch.Tensor] = []

    def spy(logits, r, position, earlier, method):
        seen.append(logits.clone())
        return int(tokens[n - 1]), None  # the true token after the prefix

    monkeypatch.setattr(draft_model, "draw_draft", spy)
    monkeypatch.setattr(Eagle3Proposer, "_greedy_chain", lambda *a: False)  # via draw_draft
    spec = {"method": "eagle3", "model": str(trainer.export()), "num_speculative_tokens": 2}
    engine = LLM(trainer.target.source, max_model_len=512, speculative_config=spec).engine
    m = n - 1  # the prefix the drafter extends: tokens[:m]; states for positions 0..m-2
    d = DraftRequest("x", tokens[:m].tolist(), 2, SamplingParams(temperature=0), 0, 1)
    d.hidden_states, d.hidden_start = aux[: m - 1], 0
    engine.speculator.proposer.propose(DraftInput([d]))
    used = trainer.used
    # (float32 sums in other orders; a layout slip would differ by whole units)
    torch.testing.assert_close(seen[0][0, used], steps[0][m - 2], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(seen[1][0, used], steps[1][m - 1], atol=1e-2, rtol=1e-2)


def test_resume_continues_from_the_checkpoint(records, tmp_path) -> None:
    llm, _, out = records
    cfg = TrainConfig(method="medusa", epochs=2, batch=4, ckpt_every=2, eval_every=100)
    first = Trainer(llm, out, tmp_path / "r", cfg)
    first.total_steps = 4  # stop early, as an interrupted run would
    first.fit(progress=False)
    again = Trainer(llm, out, tmp_path / "r", cfg)
    assert again.resume() and again.step == 4
    for a, b in zip(first.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)
    again.fit(progress=False)
    assert again.step == again.total_steps > 4


def test_init_from_a_head_on_several_folders(records, tmp_path) -> None:
    """--init: a new run starts from an exported head (its weights, its draft vocabulary, as
    fp16 stores them) over two data folders; a time limit ends it early."""
    llm, _, out = records
    first = Trainer(llm, out, tmp_path / "a", TrainConfig(draft_vocab=96, epochs=2, batch=4))
    first.fit(progress=False)
    head = first.export()
    cfg = TrainConfig(draft_vocab=200, epochs=50, batch=4, init=str(head), time_limit=1e-3)
    again = Trainer(llm, [out, out], tmp_path / "b", cfg)
    assert len(again.data) == 2 * len(first.data)
    n = len(first.data)  # validation from the second folder only; every sequence used once
    assert all(k >= n for k in again.val_ids)
    assert sorted(again.train_ids + again.val_ids) == list(range(2 * n))
    assert again.data.manifest["num_tokens"] == 2 * first.data.manifest["num_tokens"]
    assert torch.equal(again.used, first.used)  # the head's vocabulary, not the data's top 200
    for (name, a), b in zip(first.model.state_dict().items(), again.model.state_dict().values()):
        torch.testing.assert_close(a.half().float(), b, msg=name)
    again.fit(progress=False)
    assert 1 <= again.step < again.total_steps  # stopped by the time limit


def test_cli_writes_records_and_a_head(tiny_llama, tmp_path, capsys) -> None:
    train_main(["data", "--model", str(tiny_llama), "--out", str(tmp_path / "d"),
                "--num-prompts", "4", "--max-tokens", "16"])  # fmt: skip
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_sequences"] == 4
    train_main(["eagle3", "--model", str(tiny_llama), "--data", str(tmp_path / "d"),
                "--out", str(tmp_path / "h"), "--epochs", "1", "--batch", "2",
                "--draft-vocab", "64"])  # fmt: skip
    cfg = json.loads((tmp_path / "h" / "head" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 64
    from specdec.cli import main as specdec_main  # `specdec train ...`

    assert specdec_main(["train", "plot", "--log", str(tmp_path / "h" / "train_log.jsonl"),
                         "--out", str(tmp_path / "loss.png")]) == 0  # fmt: skip
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_records_fill_a_prefix_the_cache_served(tiny_llama, tmp_path, monkeypatch) -> None:
    # a second batch finds the chat template's opening in the prefix cache: those positions were
    # never fed, so collect computes them, and the records still equal a separate pass's
    llm = LLM(str(tiny_llama), max_model_len=512, max_num_seqs=4)
    filled = []
    second_pass = data._target_states

    def spy(llm, ids, chunk=256):
        filled.append(len(ids))
        return second_pass(llm, ids, chunk)

    monkeypatch.setattr(data, "_target_states", spy)
    prompts = ["Name a fruit.", "Name a color.", "Name a city.", "Say hi."]
    data.collect(llm, prompts, tmp_path, max_tokens=12, progress=False, batch=2)
    assert filled and all(0 < n < 40 for n in filled)
    monkeypatch.setattr(data, "_target_states", second_pass)
    d = data.TrainData(tmp_path)
    assert len(d) == 4
    for k in range(len(d)):
        s = d.sequence(k)
        again = data.states_of(llm, [int(t) for t in s["tokens"]])
        for name in ("aux", "final", "topk_ids", "topk_probs"):
            assert np.array_equal(np.asarray(s[name]), again[name]), (k, name)
