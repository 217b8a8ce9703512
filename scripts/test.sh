#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint (ruff, the project's rules in pyproject.toml), and run the
# whole test suite: unit tests, then the real vLLM engine on CPU with tiny random models.
# tests/gpu is skipped without CUDA. Arguments go to pytest (e.g. -m unit: one group).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
# the drafter trainers whose own loaders the tests run on our exports; their code only (their
# pins of torch, transformers and sglang would replace the CPU stack setup.sh installed)
python -m pip install -q --disable-pip-version-check --no-deps specforge==0.2.0 speculators==0.9.0 \
    hs-connectors==0.9.0
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
ruff check .
# the slowest tests are listed at the end: what each costs of the CI machine's time
python -m pytest -q -rs --durations=25 tests "$@"
