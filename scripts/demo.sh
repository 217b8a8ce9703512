#!/usr/bin/env bash
# Set up, write a tiny random Qwen3-Next (GDN hybrid) model and a prompt file under .demo/,
# and run `vllm-hidden extract` on it end to end (real vLLM engine, CPU, eager: about a minute on
# 2 cores after the set-up). Extra arguments go to the extract (e.g. --no-enforce-eager to
# compile the model as the GPU runs do: ~5 minutes here).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# everything the demo writes stays under .demo/: the model, prompts, output and the engine's caches
export VHIDDEN_CACHE_DIR=${VHIDDEN_CACHE_DIR:-$PWD/.demo/cache}
python scripts/demo.py "$@"
