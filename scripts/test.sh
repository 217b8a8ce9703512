#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint (ruff, the project's rules in pyproject.toml), and run the
# whole test suite: the real vLLM engine on CPU with tiny random models, and beside it the unit
# tests. tests/gpu is skipped without CUDA. Arguments go to pytest, in one run (e.g. -m unit: one group).
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
if [ $# -gt 0 ]; then  # a selection: one run
    exec python -m pytest -q -rs --durations=25 tests "$@"
fi
# The whole suite: the unit tests (no engine) run beside the engine tests, which leave one of
# two cores idle much of the time (process starts, waits on servers). Each run has its own
# temporary root; the slowest tests are listed at the end: what each costs of the CI machine's time.
tmp=$(mktemp -d)
python -m pytest -q -rs --durations=10 -p no:cacheprovider --basetemp="$tmp/unit" tests/unit > "$tmp/unit.log" 2>&1 &
unit=$!
rc=0
python -m pytest -q -rs --durations=25 --basetemp="$tmp/engine" tests --ignore=tests/unit || rc=$?
urc=0
wait $unit || urc=$?
echo "== tests/unit (run beside the engine tests) =="
cat "$tmp/unit.log"
rm -rf "$tmp"
[ $rc -eq 0 ] && [ $urc -eq 0 ]
