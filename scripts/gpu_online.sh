#!/usr/bin/env bash
# scripts/bench_online.py on the GPU host (vLLM 0.26.0 from ../shared/gpu-kit): plain vLLM vs vLLM's
# hidden-states connector vs `vllm-hidden serve`, Qwen3.6-27B dims, speculators' own client.
#
# Run from the repo root in the kit call that carries .kit/deps (the third), with .kit/extra carried too
# (speculators 0.9.0 and hs-connectors 0.9.0 wheels: ../shared/gpu-kit/build.sh speculators==0.9.0
# hs-connectors==0.9.0), or in any later call on the same warm host:
#   CASES=plain,vllm-connector bash scripts/gpu_online.sh
# Environment:
#   OUT      the call's output folder (the result JSON and the servers' log tails go there)
#   CASES    comma list (default: plain,vllm-connector,ours,plain-fp8w,vllm-connector-fp8w,ours-fp8w);
#            a cold 27B server takes ~4 min to start, so two cases fit one 10-minute call at most (a
#            vllm-connector case and its ours case in one call, or on one warm host, also get their states
#            compared)
#   RESULT   optional: the result file of an earlier call, in the working tree (e.g.
#            benchmarks/results/gpu-online-20261205.json); it is copied to $OUT and these cases merged in
#            (without it, an earlier call's result on this warm host is merged into)
#   BENCH_ARGS  more options for bench_online.py (e.g. "--samples 256 --concurrency 64")
#   BENCH_TIMEOUT  seconds before the benchmark is stopped (SIGTERM: its servers are stopped, what it
#            measured is kept); default 570
set -uo pipefail
: "${OUT:?set OUT to the output folder of the call}"
CASES=${CASES:-plain,vllm-connector,ours,plain-fp8w,vllm-connector-fp8w,ours-fp8w}

# vLLM from the kit: stage whatever pieces this call carried, unpack once all are there
env_sh=$(ls .kit/*/device-env.sh /tmp/kitstage/device-env.sh 2>/dev/null | head -1)
[ -n "$env_sh" ] || { echo "gpu_online: no .kit piece carried and no /tmp/kitstage: ship the kit first"; exit 3; }
# shellcheck disable=SC1090
source "$env_sh"
[ -f /tmp/kitsite/.ok ] || { echo "gpu_online: the kit is not complete on this host (carry p1, p2, deps)"; exit 3; }

set -e
# the project (vLLM finds its plugin through the installed entry point)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
# speculators' client and hs_connectors' connector configs: wheels from .kit/extra (device-env.sh already put
# them into /tmp/kitsite if they were staged before the kit was unpacked); --no-deps: the client needs only
# openai (in the kit's deps); bench_online.py loads speculators' vllm_client.py by itself where the package's
# own imports (datasets, ...) are missing on the host
if ! python3 -c "import hs_connectors, importlib.metadata as m; m.version('speculators')" 2>/dev/null; then
  wheels=$(ls .kit/extra/speculators-0.9.0-*.whl .kit/extra/hs_connectors-0.9.0-*.whl 2>/dev/null ||
           ls /tmp/kitstage/speculators-0.9.0-*.whl /tmp/kitstage/hs_connectors-0.9.0-*.whl)
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps $wheels
fi
python3 -c "import openai, hs_connectors, importlib.metadata as m; print('gpu_online: speculators',
m.version('speculators'), 'hs-connectors', m.version('hs-connectors'), 'openai', openai.__version__)"

export VHIDDEN_CACHE_DIR=/tmp/vhc  # vllm-hidden's compile caches: kept on a warm host
name=$(basename "${RESULT:-gpu-online-$(date +%Y%m%d).json}")
# cases merge into one file per host: an earlier call's result on this warm host, or RESULT from the tree
mkdir -p /tmp/vh-results
if [ -n "${RESULT:-}" ] && [ -f "$RESULT" ]; then cp "$RESULT" "$OUT/$name";
elif [ -f "/tmp/vh-results/$name" ]; then cp "/tmp/vh-results/$name" "$OUT/$name"; fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

# EMULATE_MIB=81559: the engines get the memory budget of a card with that much memory (an H100 80GB's) at the
# reference --gpu-memory-utilization 0.85, on a larger card: the same utilization scaled by its size
if [ -n "${EMULATE_MIB:-}" ]; then
  total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  util=$(python3 -c "print(round(0.85 * ${EMULATE_MIB} / ${total}, 4))")
  echo "gpu_online: --gpu-memory-utilization $util on this ${total} MiB card = 0.85 of ${EMULATE_MIB} MiB"
  BENCH_ARGS="${BENCH_ARGS:-} --engine-arg=--gpu-memory-utilization --engine-arg=$util"
fi
set +e
# shellcheck disable=SC2086
timeout -s TERM "${BENCH_TIMEOUT:-570}" python3 scripts/bench_online.py --cases "$CASES" --output "$OUT/$name" \
  ${BENCH_ARGS:-}
rc=$?
[ -f "$OUT/$name" ] && cp "$OUT/$name" "/tmp/vh-results/$name"
mkdir -p "$OUT/logs"
for f in .bench/online/server-*.log; do [ -f "$f" ] && tail -c 100000 "$f" > "$OUT/logs/$(basename "$f")"; done
echo "gpu_online: bench_online.py exited with $rc; result $OUT/$name"
exit $rc
