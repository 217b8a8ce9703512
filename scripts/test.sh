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
# The whole suite in three pytest processes on the machine's two cores: the unit tests (no
# engine), and the engine tests in two halves. An engine on CPU runs one thread and waits on
# process starts and servers much of the time, so one engine process alone leaves a core idle.
# The servers' files share one half, with the data-parallel ones (a server or an engine is up
# to three processes of ~1.7 GB, and test_server.py holds three servers: the halves' biggest
# files at once must fit 24 GB); the other half takes every other engine file, new ones too.
# Each process has its own temporary root; the slowest tests are listed at the end of each
# log: what each costs of the CI machine's time.
tmp=$(mktemp -d)
servers=(tests/integration/test_server.py tests/integration/test_connector.py tests/integration/test_mooncake.py
         tests/reliability/test_server_faults.py tests/integration/test_warmup.py tests/integration/test_parallel.py)
python -m pytest -q -rs --durations=10 -p no:cacheprovider --basetemp="$tmp/unit" tests/unit > "$tmp/unit.log" 2>&1 &
unit=$!
python -m pytest -q -rs --durations=15 -p no:cacheprovider --basetemp="$tmp/servers" "${servers[@]}" \
    > "$tmp/servers.log" 2>&1 &
half=$!
rc=0
python -m pytest -q -rs --durations=15 -p no:cacheprovider --basetemp="$tmp/engine" tests --ignore=tests/unit \
    "${servers[@]/#/--ignore=}" || rc=$?
hrc=0
wait $half || hrc=$?
urc=0
wait $unit || urc=$?
echo "== the engine tests' other half (run beside them): ${servers[*]} =="
cat "$tmp/servers.log"
echo "== tests/unit (run beside the engine tests) =="
cat "$tmp/unit.log"
rm -rf "$tmp"
[ $rc -eq 0 ] && [ $hrc -eq 0 ] && [ $urc -eq 0 ]
