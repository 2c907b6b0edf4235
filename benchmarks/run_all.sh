#!/usr/bin/env bash
# Rerun the commands behind BENCHMARKS.md, one after the other (keep the machine otherwise idle),
# and copy the two headline plots into docs/bench/.
#   bash benchmarks/run_all.sh [OUT] [PROMPTS_PER_CATEGORY]
# ANCHORS=1 also runs the transformers / llama.cpp anchors ([A], [B]; slow: transformers decodes
# at ~30 tok/s here). TINY=1 checks the script itself in minutes (a few short prompts; the plots
# are not copied). PY picks the interpreter (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
S="$PY -m specdec"
OUT=${1:-bench_out/record}
PER=${2:-20}
TOKENS=256
REPEATS=40
NS=1,2,4,8,16
METHODS="plain ngram:k=5 ngram:k=8 ngram:k=8,adaptive=false suffix suffix:k=32,adaptive=false suffix:k=8 layer_skip:k=2 layer_skip:k=3,layers=4 draft_model:model=smollm2-135m,k=4"
VARIANTS="plain suffix_gated suffix suffix_fixed hybrid_gated hybrid"
PROBE_PER=5
BATCHES="6 16"
ROUNDS=5
if [ "${TINY:-0}" = 1 ]; then
  PER=1 TOKENS=16 REPEATS=2 NS=1,2 PROBE_PER=1 BATCHES=2 ROUNDS=1
  METHODS="plain ngram:k=5 suffix"
  VARIANTS="plain suffix"
fi
mkdir -p "$OUT"
$PY benchmarks/make_datasets.py --per-file "$PER" --repeat "$PER" --out "$OUT/data"
# [F] verification cost
$S bench forward-cost --model smollm2-135m --context 200 --ns $NS --repeats $REPEATS \
  --json "$OUT/forward_cost.json" | tee "$OUT/forward_cost.txt"
# [C] / [C4] every drafter per category, interleaved (the plots come from this run)
$S bench latency --model smollm2-135m --dataset "$OUT/data/mixed.jsonl" --max-tokens $TOKENS \
  --no-progress --interleave --output-dir "$OUT/methods" --configs $METHODS
# [E] the repeated task
$S bench latency --model smollm2-135m --dataset "$OUT/data/repeated.jsonl" --max-tokens $TOKENS \
  --no-progress --interleave --kv-cache-dtype float16 --output-dir "$OUT/repeated" --configs plain suffix
# [D] suffix and hybrid over all four sets
$PY benchmarks/hybrid_probe.py --per-category $PROBE_PER --max-tokens $TOKENS --variants $VARIANTS \
  | tee "$OUT/hybrid_probe.txt"
# offline batches of 6 and 16 prompts: every drafter against plain, alternated round by round
$PY benchmarks/offline_batch.py --dataset "$OUT/data/mixed.jsonl" --batch $BATCHES --max-tokens $TOKENS \
  --rounds $ROUNDS \
  --configs eagle3 ngram suffix layer_skip hybrid draft_model:model=smollm2-135m \
  | tee "$OUT/offline_batch.txt"
if [ "${ANCHORS:-0}" = 1 ]; then
  # [A] anchors, each in its own process; [B] plain against transformers on code edits
  $S bench latency --model smollm2-135m --dataset "$OUT/data/mixed.jsonl" --max-tokens $TOKENS \
    --no-progress --output-dir "$OUT/anchors" --configs plain ngram:k=5 suffix llama_cpp:plain \
    llama_cpp:prompt_lookup:k=10 hf:plain hf:prompt_lookup:k=10
  for q in auto fp32; do
    $S bench latency --model smollm2-135m --dataset "$OUT/data/mixed.jsonl" --categories stdlib_edit \
      --quantization $q --max-tokens $TOKENS --ignore-eos --no-progress --output-dir "$OUT/plain_$q" \
      --configs plain hf:plain llama_cpp:plain
  done
fi
if [ "${TINY:-0}" != 1 ]; then
  cp "$OUT/methods/speedup.png" docs/bench/headline_speedup.png
  cp "$OUT/methods/acceptance_by_position.png" docs/bench/headline_acceptance.png
  echo "copied the plots to docs/bench/; put the new figures (with machine and date) in BENCHMARKS.md"
fi
echo "all done: $OUT"
