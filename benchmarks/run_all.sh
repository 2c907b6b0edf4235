#!/usr/bin/env bash
# Every benchmark recorded in BENCHMARKS.md, in one sequential run (keep the machine otherwise idle).
#   bash benchmarks/run_all.sh [OUT] [PROMPTS_PER_CATEGORY]
# The transformers / llama.cpp anchors are slow (transformers decodes at ~15 tok/s here); they run
# only with ANCHORS=1.
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/specdec
OUT=${1:-bench_out/record}
PER=${2:-20}
mkdir -p "$OUT"
.venv/bin/python benchmarks/make_datasets.py --per-file "$PER" --repeat 20 --out "$OUT/data"
# Before/after of the kernel work: instruction set x layer path x activations, round-robin.
.venv/bin/python benchmarks/forward_variants.py --repeats 7 | tee "$OUT/forward_variants.txt"
for act in int8 float32; do
  $S bench forward-cost --model smollm2-135m --activation-dtype $act --ns 1,2,3,4,6,8,9,12,16 \
    --repeats 7 --json "$OUT/forward_cost_$act.json" | tee "$OUT/forward_cost_$act.txt"
done
# --interleave: every configuration loaded at once, each prompt run on all of them in turn (this
# machine's speed drifts by up to 45% over minutes; run one after the other, the configurations
# would be measured at different speeds).
$S bench latency --model smollm2-135m --dataset "$OUT/data/mixed.jsonl" --max-tokens 256 --no-progress \
  --interleave --output-dir "$OUT/methods" --configs plain ngram:k=5 ngram:k=8 ngram:k=8,adaptive=false suffix \
  suffix:k=32,adaptive=false suffix:k=8 layer_skip:k=2 layer_skip:k=3,layers=4 \
  draft_model:model=smollm2-135m,k=4 || true
$S bench latency --model smollm2-135m --dataset "$OUT/data/repeated.jsonl" --max-tokens 256 --no-progress \
  --interleave --output-dir "$OUT/repeated" --configs plain ngram:k=5 suffix suffix:k=32,adaptive=false suffix:k=8 \
  || true
# Serving, and the same conversations offline (same prompts, turns and max_tokens): issue 5 asks
# that concurrency 1 keeps the offline speedup within 10%.
$S bench serve --model smollm2-135m --dataset "$OUT/data/mixed.jsonl" --num-prompts 4 --max-tokens 128 \
  --concurrency 1,4,16 --rounds 2 --output-dir "$OUT/serve" --configs plain ngram:k=5 suffix || true
$S bench latency --model smollm2-135m --dataset "$OUT/data/mixed.jsonl" --num-prompts 4 --max-tokens 128 \
  --no-progress --interleave --output-dir "$OUT/serve_offline" --configs plain ngram:k=5 suffix || true
if [ "${ANCHORS:-0}" = 1 ]; then
  $S bench latency --model smollm2-135m --dataset "$OUT/data/mixed.jsonl" --num-prompts 4 \
    --max-tokens 256 --no-progress --output-dir "$OUT/anchors" --configs plain ngram:k=5 \
    hf:plain hf:prompt_lookup:k=10 llama_cpp:plain llama_cpp:prompt_lookup:k=10 || true
fi
echo "all done"
