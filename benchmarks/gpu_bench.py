"""specdec against Hugging Face transformers' ``generate`` on one device (a GPU by default).

For one model (a GGUF file or a Hugging Face folder), each engine runs in a process of its own:

* transformers (``--worker hf``): ``AutoModelForCausalLM`` in bfloat16, greedy ``generate`` at
  batch 1, plain and with prompt lookup (``prompt_lookup_num_tokens``);
* specdec (``--worker specdec``): ``LLM(...)`` plain, then each ``--methods`` drafter: greedy at
  batch 1 (one prompt per ``generate``), greedy as one batch of every prompt, and sampled as one
  batch (temperature 0.8, seed 1234); each method's token ids are compared with plain's.

Both engines get the same prompt token ids (rendered here with specdec's tokenizer and the model's
chat template) and stop on the same end-of-generation ids. Tokens per second are new tokens over
wall time of the ``generate`` calls (prefill included), with ``torch.cuda.synchronize`` around
them; every configuration does a warm-up first on a prompt of its own, and the prefix cache and
the drafters' learnt state (suffix trees) are reset before each measured pass, so no pass is
measured on a repeat of an earlier one.

    python3 benchmarks/gpu_bench.py /path/model.gguf --out gpu_out
    .venv/bin/python benchmarks/gpu_bench.py /tmp/synth-tiny --device cpu --max-new-tokens 16

Prints one table and writes ``OUT/<model-name>.json``. Uses specdec's public API only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Our own prompts (no benchmark data set): two code edits that repeat a block of the prompt, two
# open questions, two summaries of a paragraph written here.
CODE_A = """def mean_and_spread(values):
    total = 0
    for v in values:
        total += v
    mean = total / len(values)
    spread = 0
    for v in values:
        spread += (v - mean) ** 2
    spread = (spread / len(values)) ** 0.5
    return mean, spread
"""
CODE_B = """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        if self.items.get(name, 0) < count:
            raise ValueError("not enough " + name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
"""
LIBRARY = (
    "The town library in Elmsworth closed for eight months last year while builders replaced "
    "its leaking roof and turned the old storage basement into a study room with forty desks. "
    "The renovation cost 1.2 million, two thirds of it paid by a regional grant and the rest by "
    "local donations. Since reopening in March, daily visitors have almost doubled, and the "
    "study room is full most evenings with students preparing for exams. The librarians now "
    "plan to extend opening hours on weekends, if they can hire two more staff."
)
BIKES = (
    "For six weeks this spring, the city of Harlow tested a bicycle-sharing scheme with 150 "
    "bikes at 12 stations near the train station and the university. Riders made about 9,000 "
    "trips, most of them shorter than fifteen minutes, and fewer than ten bikes were damaged. "
    "A survey of users found that a third of them had replaced a car trip with a bike ride. "
    "The council will vote in autumn on whether to make the scheme permanent and add stations "
    "in the eastern neighbourhoods."
)
PROMPTS: list[str] = [
    "Here is a Python function:\n\n"
    + CODE_A
    + "\nRename the variable `spread` to `std_dev` everywhere and add type hints. "
    "Reply with the complete updated function only.",
    "Here is a Python class:\n\n"
    + CODE_B
    + "\nChange `remove` so that it deletes the entry when its count reaches zero. "
    "Reply with the complete updated class.",
    "What are three practical ways to keep houseplants healthy in a dark apartment?",
    "Why do we see the sky as blue during the day and reddish at sunset? Explain simply.",
    "Summarize the following paragraph in two sentences.\n\n" + LIBRARY,
    "Summarize the following paragraph in one sentence, then list the numbers it mentions.\n\n"
    + BIKES,
]
WARMUP_PROMPT = "Write a short poem about a cup of tea on a rainy morning."
SEEDED_TEMPERATURE = 0.8
SEED = 1234
DEFAULT_METHODS = ["ngram", "suffix", "eagle3", "draft_model"]


# ---- shared helpers ---------------------------------------------------------------------------
def first_line(e: BaseException | str) -> str:
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[0][:300] if lines else (text if isinstance(text, str) else "error")


def model_name(path: Path) -> str:
    name = path.name if path.is_dir() else path.stem
    return name or "model"


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def render_prompts(model: Path, num_prompts: int, chat: bool) -> dict[str, Any]:
    """Prompt token ids with specdec's tokenizer (the model's chat template when it has one),
    and the ids that end generation, for both engines."""
    from specdec.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_file(model) if model.is_file() else Tokenizer.from_hf_folder(model)
    use_chat = chat and bool(tok.chat_template)

    def ids(text: str) -> list[int]:
        if use_chat:
            msgs = [{"role": "user", "content": text}]
            return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        return tok.encode(text)

    texts = PROMPTS[:num_prompts]
    return {
        "chat_template": use_chat,
        "texts": texts,
        "prompt_ids": [ids(t) for t in texts],
        "warmup_ids": ids(WARMUP_PROMPT),
        "eog_token_ids": sorted(tok.eog_token_ids),
    }


def sync(torch_mod: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch_mod.cuda.synchronize()


# ---- transformers worker ---------------------------------------------------------------------
def hf_worker(req: dict[str, Any], result_path: Path) -> None:
    import torch
    import transformers

    device = req["device"]
    path = Path(req["model"])
    result: dict[str, Any] = {
        "library": {"transformers": transformers.__version__, "torch": torch.__version__},
        "configs": [],
    }
    t0 = time.perf_counter()
    dtype = getattr(torch, req["dtype"])
    auto = transformers.AutoModelForCausalLM
    kwargs: dict[str, Any] = {"dtype": dtype}
    if path.is_file():
        kwargs["gguf_file"] = path.name
    folder = str(path.parent if path.is_file() else path)
    try:
        model = auto.from_pretrained(folder, **kwargs)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        kwargs["torch_dtype"] = kwargs.pop("dtype")
        model = auto.from_pretrained(folder, **kwargs)
    model = model.to(device=device, dtype=dtype).eval()
    result["load_s"] = time.perf_counter() - t0
    result["model_dtype"] = str(next(model.parameters()).dtype)
    eog = req["eog_token_ids"]
    n = req["max_new_tokens"]

    def generate(ids: list[int], max_new: int, extra: dict[str, Any]) -> tuple[list[int], float]:
        x = torch.tensor([ids], dtype=torch.long, device=device)
        gen_kwargs: dict[str, Any] = dict(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=eog or None,
            pad_token_id=eog[0] if eog else 0,
            **extra,
        )
        if req["ignore_eos"]:
            gen_kwargs["min_new_tokens"] = max_new
        sync(torch, device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**gen_kwargs)
        sync(torch, device)
        return out[0, len(ids) :].tolist(), time.perf_counter() - start

    configs: list[tuple[str, dict[str, Any]]] = [("plain", {})]
    if req["prompt_lookup"] > 0:
        configs.append(("prompt_lookup", {"prompt_lookup_num_tokens": req["prompt_lookup"]}))
    for name, extra in configs:
        entry: dict[str, Any] = {"name": name, "generate_kwargs": extra}
        try:
            generate(req["warmup_ids"], min(n, 16), extra)
            ids_out, secs = [], []
            for ids in req["prompt_ids"]:
                new, s = generate(ids, n, extra)
                ids_out.append(new)
                secs.append(s)
            entry.update(token_ids=ids_out, seconds=secs)
        except Exception as e:  # noqa: BLE001 (recorded, the other configs go on)
            entry["error"] = first_line(e)
            entry["traceback"] = traceback.format_exc()[-2000:]
        result["configs"].append(entry)
        write_json(result_path, result)


# ---- specdec worker --------------------------------------------------------------------------
def speculative_config(method: str, model: str, draft_model: str | None, k: int | None) -> Any:
    """vLLM's keys for ``method``; ``NAME:fixed`` turns specdec's adaptive controller off (it
    otherwise decodes plain where it predicts drafting cannot pay, e.g. a draft as big as the
    target), so the speculative path is exercised whatever it costs."""
    if method == "plain":
        return None
    method, _, variant = method.partition(":")
    if variant not in ("", "fixed"):
        raise ValueError(f"unknown method variant {variant!r} (NAME or NAME:fixed)")
    spec: dict[str, Any] = {"method": method}
    if variant == "fixed":
        spec["adaptive"] = False
    if method == "draft_model":
        spec["model"] = draft_model or model
        spec["num_speculative_tokens"] = k or 4
    elif k:
        spec["num_speculative_tokens"] = k
    return spec


def specdec_worker(req: dict[str, Any], result_path: Path) -> None:
    # NOTE: what specdec/__init__.py sets, before torch loads OpenMP (spin-waiting threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from specdec import LLM, SamplingParams

    device = req["device"]
    n = req["max_new_tokens"]
    result: dict[str, Any] = {"library": {"torch": torch.__version__}, "configs": []}
    if device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=req["ignore_eos"])
    seeded = SamplingParams(
        temperature=SEEDED_TEMPERATURE, seed=SEED, max_tokens=n, ignore_eos=req["ignore_eos"]
    )
    warm = SamplingParams(temperature=0.0, max_tokens=min(n, 16))
    prompts = [{"prompt_token_ids": ids} for ids in req["prompt_ids"]]
    warm_prompt = {"prompt_token_ids": req["warmup_ids"]}

    def timed(llm: Any, batch: Any, params: Any) -> tuple[list[Any], float]:
        sync(torch, device)
        start = time.perf_counter()
        outs = llm.generate(batch, params)
        sync(torch, device)
        return outs, time.perf_counter() - start

    def reset(llm: Any) -> None:
        engine = getattr(llm, "engine", None)
        for hook in ("reset_prefix_cache", "reset_drafter_cache"):
            fn = getattr(engine, hook, None)
            if fn is not None:
                fn()

    def stats(outs: list[Any]) -> dict[str, int]:
        total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        for o in outs:
            s = getattr(o, "spec_decode_stats", None)
            for key in total:
                total[key] += int(getattr(s, key, 0) or 0)
        return total

    def ids_of(outs: list[Any]) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) if o.outputs else [] for o in outs]

    def errors_of(outs: list[Any]) -> list[str]:
        return [o.error for o in outs if getattr(o, "error", None)]

    for method in ["plain", *req["methods"]]:
        entry: dict[str, Any] = {"name": method}
        result["configs"].append(entry)
        llm = None
        try:
            spec = speculative_config(method, req["model"], req["draft_model"], req["k"])
            entry["speculative_config"] = spec
            t0 = time.perf_counter()
            llm = LLM(
                model=req["model"],
                device=device,
                dtype=req["dtype"],
                kernels=req["kernels"],
                max_model_len=req["max_model_len"],
                speculative_config=spec,
                **req["engine_kwargs"],
            )
            sync(torch, device)
            entry["load_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 (a method that cannot be built is recorded)
            entry["error"] = "construct: " + first_line(e)
            entry["traceback"] = traceback.format_exc()[-2000:]
            write_json(result_path, result)
            continue
        try:
            t0 = time.perf_counter()
            llm.generate(warm_prompt, warm)
            if req["batch"]:
                llm.generate([warm_prompt, warm_prompt], warm)
            sync(torch, device)
            entry["warmup_s"] = time.perf_counter() - t0
            reset(llm)
            bs1_ids, bs1_secs, bs1_outs = [], [], []
            for p in prompts:
                outs, s = timed(llm, p, greedy)
                bs1_outs += outs
                bs1_ids += ids_of(outs)
                bs1_secs.append(s)
            entry.update(token_ids=bs1_ids, seconds=bs1_secs, spec_stats=stats(bs1_outs))
            entry["request_errors"] = errors_of(bs1_outs)
            write_json(result_path, result)
            if req["batch"]:
                reset(llm)
                outs, s = timed(llm, prompts, greedy)
                entry.update(batch_token_ids=ids_of(outs), batch_seconds=s)
                entry["request_errors"] += errors_of(outs)
                write_json(result_path, result)
            if req["seeded"]:
                reset(llm)
                outs, s = timed(llm, prompts, seeded)
                entry.update(seeded_token_ids=ids_of(outs), seeded_seconds=s)
                entry["request_errors"] += errors_of(outs)
        except Exception as e:  # noqa: BLE001 (recorded, the other methods go on)
            entry["error"] = "run: " + first_line(e)
            entry["traceback"] = traceback.format_exc()[-2000:]
        finally:
            shutdown = getattr(getattr(llm, "engine", None), "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # noqa: BLE001
                    pass
            del llm
            import gc

            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        write_json(result_path, result)


# ---- parent: run the workers, compare, print ------------------------------------------------
def run_worker(
    kind: str, req: dict[str, Any], workdir: Path, timeout: float, log_path: Path
) -> dict[str, Any]:
    """Run one engine's worker process; its result file (written as it goes, so a timeout keeps
    what finished) plus how the process ended; its output goes to ``log_path``."""
    req_path = workdir / f"{kind}-request.json"
    res_path = workdir / f"{kind}-result.json"
    write_json(req_path, req)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        kind,
        "--request",
        str(req_path),
    ]
    cmd += ["--result", str(res_path)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if kind == "hf":  # NOTE: specdec's passive OpenMP waiting is its own; transformers runs as is
        env.pop("OMP_WAIT_POLICY", None)
    start = time.perf_counter()
    status: dict[str, Any] = {}
    status["log"] = str(log_path)
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd, env=env, timeout=timeout, stdout=log, stderr=subprocess.STDOUT, text=True
            )
            status["returncode"] = proc.returncode
        except subprocess.TimeoutExpired:
            status["returncode"] = None
            status["timeout_s"] = timeout
    log_text = Path(log_path).read_text(errors="replace")
    if status["returncode"] != 0:
        status["log_tail"] = log_text[-3000:]
    status["wall_s"] = time.perf_counter() - start
    result: dict[str, Any] = {"configs": []}
    if res_path.is_file():
        result = json.loads(res_path.read_text())
    result["process"] = status
    return result


def report_process(kind: str, status: dict[str, Any]) -> None:
    rc = status.get("returncode")
    how = f"timed out after {status['timeout_s']:.0f} s" if rc is None else f"exit {rc}"
    print(f"[gpu_bench] {kind} worker: {how}, {status['wall_s']:.0f} s, log {status['log']}")
    if rc != 0:
        print(status.get("log_tail", "")[-1500:])


def rate(entry: dict[str, Any], ids_key: str, secs_key: str) -> float | None:
    if "error" in entry and ids_key not in entry:
        return None
    ids, secs = entry.get(ids_key), entry.get(secs_key)
    if ids is None or secs is None:
        return None
    total_s = sum(secs) if isinstance(secs, list) else secs
    return sum(len(x) for x in ids) / total_s if total_s > 0 else None


def same(a: list[list[int]] | None, b: list[list[int]] | None) -> str:
    if a is None or b is None:
        return "-"
    return f"{sum(x == y for x, y in zip(a, b))}/{len(b)}"


def ratio(x: float | None, y: float | None) -> str:
    return f"{x / y:.2f}x" if x is not None and y else "-"


def fmt(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else "-"


def request_errors(entry: dict[str, Any]) -> str | None:
    errs = entry.get("request_errors") or []
    return f"{len(errs)} request(s) failed: {first_line(errs[0])}" if errs else None


def build_rows(hf: dict[str, Any], sd: dict[str, Any]) -> list[dict[str, Any]]:
    sd_cfgs = {c["name"]: c for c in sd.get("configs", [])}
    hf_cfgs = {c["name"]: c for c in hf.get("configs", [])}
    sd_plain = sd_cfgs.get("plain", {})
    hf_plain = hf_cfgs.get("plain", {})
    sd_rate = rate(sd_plain, "token_ids", "seconds")
    sd_batch_rate = rate(sd_plain, "batch_token_ids", "batch_seconds")
    hf_rate = rate(hf_plain, "token_ids", "seconds")
    rows = []
    for name, c in hf_cfgs.items():
        r = rate(c, "token_ids", "seconds")
        rows.append(
            {
                "engine": "transformers",
                "method": name,
                "tok_s": r,
                "vs_specdec_plain": ratio(r, sd_rate),
                "vs_hf_plain": ratio(r, hf_rate),
                "batch_tok_s": None,
                "batch_vs_plain": "-",
                "acceptance": "-",
                "identical_greedy": same(c.get("token_ids"), hf_plain.get("token_ids"))
                if name != "plain"
                else "-",
                "identical_seeded": "-",
                "load_s": hf.get("load_s") if name == "plain" else None,
                "error": c.get("error"),
            }
        )
    for name, c in sd_cfgs.items():
        r = rate(c, "token_ids", "seconds")
        br = rate(c, "batch_token_ids", "batch_seconds")
        st = c.get("spec_stats") or {}
        acc = "-"
        if name != "plain" and st.get("num_draft_tokens"):
            acc = (
                f"{st['num_accepted_tokens'] / st['num_draft_tokens']:.2f}"
                f" ({1 + st['num_accepted_tokens'] / max(st['num_drafts'], 1):.2f}/step)"
            )
        greedy = "-"
        seeded = "-"
        if name != "plain":
            greedy = same(c.get("token_ids"), sd_plain.get("token_ids"))
            if "batch_token_ids" in c:
                greedy += "," + same(c.get("batch_token_ids"), sd_plain.get("batch_token_ids"))
            seeded = same(c.get("seeded_token_ids"), sd_plain.get("seeded_token_ids"))
        rows.append(
            {
                "engine": "specdec",
                "method": name,
                "tok_s": r,
                "vs_specdec_plain": ratio(r, sd_rate),
                "vs_hf_plain": ratio(r, hf_rate),
                "batch_tok_s": br,
                "batch_vs_plain": ratio(br, sd_batch_rate),
                "acceptance": acc,
                "identical_greedy": greedy,
                "identical_seeded": seeded,
                "load_s": c.get("load_s"),
                "error": c.get("error") or request_errors(c),
            }
        )
    return rows


COLUMNS = [
    ("engine/method", 26),
    ("tok/s", 8),
    ("vs sd plain", 11),
    ("vs HF plain", 11),
    ("batch tok/s", 11),
    ("batch vs plain", 14),
    ("accept (tok/step)", 17),
    ("same greedy", 11),
    ("same seeded", 11),
    ("load s", 6),
]


def table(rows: list[dict[str, Any]]) -> str:
    head = "  ".join(f"{name:<{w}}" for name, w in COLUMNS)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [
            f"{r['engine']}/{r['method']}",
            fmt(r["tok_s"]),
            r["vs_specdec_plain"],
            r["vs_hf_plain"],
            fmt(r["batch_tok_s"]),
            r["batch_vs_plain"],
            r["acceptance"],
            r["identical_greedy"],
            r["identical_seeded"],
            fmt(r["load_s"]),
        ]
        lines.append("  ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, COLUMNS)))
        if r.get("error"):
            lines.append(f"    ! {r['error']}")
    return "\n".join(lines)


def parent(args: argparse.Namespace) -> int:
    model = Path(args.model).resolve()
    if not model.exists():
        print(f"gpu_bench: {model} not found", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or model_name(model)
    prompts = render_prompts(model, args.num_prompts, not args.no_chat)
    common = {
        "model": str(model),
        "device": args.device,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "ignore_eos": args.ignore_eos,
        "prompt_ids": prompts["prompt_ids"],
        "warmup_ids": prompts["warmup_ids"],
        "eog_token_ids": prompts["eog_token_ids"],
    }
    sd_req = common | {
        "kernels": args.kernels,
        "max_model_len": args.max_model_len,
        "methods": [m for m in args.methods if m != "plain"],
        "draft_model": args.draft_model,
        "k": args.num_speculative_tokens,
        "batch": not args.no_batch,
        "seeded": not args.no_seeded,
        "engine_kwargs": json.loads(args.engine_kwargs) if args.engine_kwargs else {},
    }
    hf_req = common | {"prompt_lookup": args.prompt_lookup}
    with tempfile.TemporaryDirectory(prefix="gpu_bench-") as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        sd_limit = args.worker_timeout
        if args.time_budget is not None:  # the transformers worker keeps 40% unless skipped
            sd_limit = args.time_budget * (1.0 if args.skip_hf else 0.6)
        sd = run_worker("specdec", sd_req, work, sd_limit, out_dir / f"{name}.specdec.log")
        report_process("specdec", sd["process"])
        hf: dict[str, Any] = {"configs": [], "process": {"skipped": True}}
        if not args.skip_hf:
            hf_limit = args.worker_timeout
            if args.time_budget is not None:
                hf_limit = max(30.0, args.time_budget - (time.perf_counter() - start))
            hf = run_worker("hf", hf_req, work, hf_limit, out_dir / f"{name}.hf.log")
            report_process("hf", hf["process"])
    rows = build_rows(hf, sd)
    hf_plain = next((c for c in hf.get("configs", []) if c["name"] == "plain"), {})
    sd_plain = next((c for c in sd.get("configs", []) if c["name"] == "plain"), {})
    hf_vs_sd = same(hf_plain.get("token_ids"), sd_plain.get("token_ids"))
    lengths = [len(x) for x in sd_plain.get("token_ids", [])]
    title = (
        f"{name} on {args.device} ({sd.get('gpu', args.device)}), dtype {args.dtype}, "
        f"kernels {args.kernels}, {len(prompts['prompt_ids'])} prompts, "
        f"max_new_tokens {args.max_new_tokens}"
        f"{' (ignore_eos)' if args.ignore_eos else ''}, prompt lengths "
        f"{[len(x) for x in prompts['prompt_ids']]}, specdec plain output lengths {lengths}"
    )
    text = "\n".join(
        [
            title,
            table(rows),
            "tok/s: batch 1, one prompt per generate; batch: all prompts in one generate "
            "(specdec only); same greedy: outputs identical to specdec plain at batch 1 and "
            "in the batch (transformers rows: to transformers plain); same seeded: the batch at "
            f"temperature {SEEDED_TEMPERATURE}, seed {SEED}; load s: LLM(...) / from_pretrained "
            "(specdec's adaptive drafters time forward passes there)",
            f"transformers plain == specdec plain (greedy, batch 1): {hf_vs_sd}",
        ]
    )
    print(text)
    report = {
        "model": str(model),
        "name": name,
        "args": vars(args),
        "prompts": prompts,
        "rows": rows,
        "table": text,
        "specdec": sd,
        "transformers": hf,
        "hf_plain_identical_to_specdec_plain": hf_vs_sd,
    }
    out_path = out_dir / f"{name}.json"
    write_json(out_path, report)
    print(f"[gpu_bench] wrote {out_path}")
    ok = any(r["engine"] == "specdec" and r["tok_s"] is not None for r in rows)
    return 0 if ok else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="a .gguf file or a Hugging Face folder")
    p.add_argument("--out", default="gpu_bench_out", help="folder for <model-name>.json")
    p.add_argument("--name", default=None, help="the JSON's name (default: the model's)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernels", default="torch", help="specdec kernels: torch (default) or auto")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    p.add_argument(
        "--methods",
        nargs="*",
        default=DEFAULT_METHODS,
        help="specdec drafters after plain; NAME:fixed turns the adaptive controller off "
        f"(default: {' '.join(DEFAULT_METHODS)})",
    )
    p.add_argument(
        "--draft-model", default=None, help="draft_model's drafter (default: the model itself)"
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="k for every method (default: specdec's; draft_model: 4)",
    )
    p.add_argument("--prompt-lookup", type=int, default=8, help="transformers' prompt lookup k")
    p.add_argument("--ignore-eos", action="store_true", help="always max_new_tokens tokens")
    p.add_argument("--no-chat", action="store_true", help="raw prompts, no chat template")
    p.add_argument("--no-batch", action="store_true", help="skip the greedy batch pass")
    p.add_argument("--no-seeded", action="store_true", help="skip the sampled batch pass")
    p.add_argument("--skip-hf", action="store_true", help="no transformers worker")
    p.add_argument("--engine-kwargs", default=None, help="JSON of extra LLM(...) keyword arguments")
    p.add_argument("--worker-timeout", type=float, default=420.0, help="seconds per worker")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds for both workers: specdec gets 60%%, transformers what is left (>= 30)",
    )
    p.add_argument("--worker", choices=["hf", "specdec"], help=argparse.SUPPRESS)
    p.add_argument("--request", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None and args.model is None:
        p.error("give a model path")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        req = json.loads(Path(args.request).read_text())
        worker = specdec_worker if args.worker == "specdec" else hf_worker
        worker(req, Path(args.result))
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
