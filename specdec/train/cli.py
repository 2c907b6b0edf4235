"""``specdec train data|eagle3|eagle|medusa`` (also ``python -m specdec.train``).

specdec train data --model smollm2-135m --out data/smollm2 --num-prompts 2000
specdec train eagle3 --model smollm2-135m --data data/smollm2 --out heads/smollm2-eagle3
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

from specdec.train.trainer import TrainConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``train`` on a ``specdec`` sub-command parser."""
    p = sub.add_parser("train", help="train drafter heads (EAGLE-3, EAGLE, Medusa) for a model")
    build(p)
    p.set_defaults(func=run)


def build(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    kinds = p.add_subparsers(dest="train_command", required=True)
    d = kinds.add_parser("data", help="self-distillation records from the target's own outputs")
    d.add_argument("--model", required=True, help="the target model whose outputs are recorded")
    d.add_argument("--out", required=True, help="folder for the shards")
    d.add_argument("--prompts", help="JSONL of prompts (default: the target writes them)")
    d.add_argument("--num-prompts", type=int, default=1000, help="prompts to record (default 1000)")
    d.add_argument("--max-tokens", type=int, default=256, help="response length cap")
    d.add_argument("--sampled-fraction", type=float, default=0.5,
                   help="share of responses sampled at T 0.7 (the rest greedy)")  # fmt: skip
    d.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    d.add_argument("--max-num-seqs", type=int, default=16, help="sequences generated together")
    d.add_argument("--batch", type=int, default=32, help="prompts per generate call")
    d.add_argument("--time-limit", type=float, default=None,
                   help="seconds: start no batch of responses after this (the rest is written)")  # fmt: skip
    pl = kinds.add_parser("plot", help="draw a run's train_log.jsonl (loss, validation)")
    pl.add_argument("--log", required=True, help="a run's train_log.jsonl")
    pl.add_argument("--out", required=True, help="PNG file")
    for method in ("eagle3", "eagle", "medusa"):
        t = kinds.add_parser(method, help=f"train a {method} head on `train data` records")
        t.add_argument("--model", required=True, help="the target model the head drafts for")
        t.add_argument("--data", required=True, nargs="+", help="one or more `train data` folders")
        t.add_argument("--out", required=True, help="folder: checkpoint.pt, train_log.jsonl, head/")
        t.add_argument("--resume", action="store_true", help="continue from out/checkpoint.pt")
        defaults = TrainConfig()
        for name, what in TRAIN_FLAGS.items():
            value = getattr(defaults, name)
            t.add_argument(
                "--" + name.replace("_", "-"),
                type=type(value),
                default=value,
                help=f"{what} (default: {value!r})",
            )
    return p


# TrainConfig's fields a command line sets, and what each means
TRAIN_FLAGS = {
    "epochs": "passes over the records (fractions allowed)",
    "lr": "peak learning rate (AdamW)",
    "batch": "sequences per optimizer step",
    "ttt_steps": "drafting steps unrolled in training (eagle3, eagle)",
    "medusa_heads": "heads, one per future position (medusa)",
    "draft_vocab": "eagle3: the draft vocabulary, the target's most frequent tokens",
    "max_len": "tokens kept per sequence",
    "val_fraction": "share of the records held out for validation",
    "eval_every": "optimizer steps between validations",
    "ckpt_every": "optimizer steps between checkpoints",
    "warmup": "share of the schedule spent warming the learning rate up",
    "seed": "shuffling and initialisation seed",
    "device": "cpu, cuda or auto",
    "init": "eagle3: an exported head to start from (empty: fresh)",
    "time_limit": "seconds of training (0: none); the schedule decays over whichever ends first",
}


def run(args: argparse.Namespace) -> None:
    if args.train_command == "plot":
        from specdec.train.plot import plot_log

        print(plot_log(args.log, args.out))
        return
    from specdec import LLM
    from specdec.train import data

    if args.train_command == "data":
        llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048)
        start = time.monotonic()
        if args.prompts:
            prompts = data.read_prompts(args.prompts)[: args.num_prompts]
        else:
            stream = data.magpie_stream(llm, args.batch, seed=args.seed)
            prompts = itertools.islice(stream, args.num_prompts)  # written batch by batch
        deadline = None if args.time_limit is None else start + args.time_limit
        manifest = data.collect(
            llm, prompts, args.out, args.max_tokens, args.sampled_fraction, args.seed,
            batch=args.batch, deadline=deadline,
        )  # fmt: skip
        manifest["seconds"] = round(time.monotonic() - start, 1)
        print(json.dumps(manifest))
        return
    from specdec.train.trainer import Trainer

    cfg = TrainConfig(method=args.train_command, **{
        k: getattr(args, k) for k in TrainConfig.__dataclass_fields__ if k != "method"
    })  # fmt: skip
    trainer = Trainer(LLM(args.model, max_num_seqs=1), args.data, args.out, cfg)
    if args.resume and trainer.resume():
        print(f"resumed at step {trainer.step}", file=sys.stderr)
    result = trainer.fit()
    head = trainer.export()
    print(json.dumps({"head": str(head), "steps": trainer.step, **result}))


def main(argv: list[str] | None = None) -> None:
    parser = build(
        argparse.ArgumentParser(prog="specdec train", description=__doc__.splitlines()[0])
    )
    run(parser.parse_args(argv))
