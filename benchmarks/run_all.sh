#!/usr/bin/env bash
# Every benchmark recorded in BENCHMARKS.md, in one sequential run (keep the machine otherwise idle).
set -euo pipefail
cd "$(dirname "$0")/.."
S=.venv/bin/specdec
OUT=${1:-bench_out/record}
mkdir -p "$OUT"
.venv/bin/python benchmarks/make_datasets.py --per-file 4 --repeat 10 --out "$OUT/data"
# Before/after of the kernel work: instruction set x layer path, round-robin in one process.
.venv/bin/python benchmarks/forward_variants.py --repeats 7 | tee "$OUT/forward_variants.txt"
for q in auto q8_0 fp32; do
  $S bench forward-cost --model smollm2-135m --quantization $q --ns 1,2,3,4,6,8,12,16 --repeats 7 \
    --json "$OUT/forward_cost_$q.json" | tee "$OUT/forward_cost_$q.txt"
done
# Plain decode vs transformers: ~300-token code-edit prompts, 256 new tokens.
for q in auto fp32; do
  $S bench latency --model smollm2-135m --dataset "$OUT/data/mixed.jsonl" --categories stdlib_edit \
    --quantization $q --max-tokens 256 --ignore-eos --no-progress --output-dir "$OUT/decode_$q" \
    --configs plain hf:plain || true
done
$S bench latency --model smollm2-135m --dataset "$OUT/data/mixed.jsonl" --max-tokens 256 --no-progress \
  --output-dir "$OUT/methods" --configs plain ngram:k=5 ngram:k=5,adaptive=false suffix:k=8 \
  layer_skip:k=2 layer_skip:k=3,layers=4 draft_model:model=smollm2-135m,k=4 \
  hf:plain hf:prompt_lookup:k=10 llama_cpp:plain llama_cpp:prompt_lookup:k=10 || true
$S bench latency --model smollm2-135m --dataset "$OUT/data/repeated.jsonl" --max-tokens 256 --no-progress \
  --output-dir "$OUT/repeated" --configs plain ngram:k=5 suffix:k=8 suffix:k=8,adaptive=false || true
$S bench serve --model smollm2-135m --dataset "$OUT/data/mixed.jsonl" --max-tokens 64 \
  --concurrency 1,4,16 --output-dir "$OUT/serve" --configs plain ngram:k=5 suffix:k=8 || true
echo "all done"
