#!/usr/bin/env bash
# Set up, write a tiny random Qwen3-Next (GDN hybrid) model and a prompt file under .demo/,
# and run `vllm-hidden extract` on it end to end (real vLLM engine, CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
python scripts/demo.py "$@"
