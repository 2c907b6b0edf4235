#!/usr/bin/env bash
# The main job: a speculative generation on the default model, next to plain decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/specdec generate --model smollm2-135m --chat --compare-plain \
  --speculative-config '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}' "$@"
