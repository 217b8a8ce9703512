#!/usr/bin/env bash
# A warm cache carried to a fresh cache root on the GPU host (vLLM 0.26.0 from ../shared/gpu-kit):
# `warmup` on an empty root (a cold start), `warmup --pack` (its caches as one archive), `extract
# --cache-from` the archive into an empty root elsewhere, and `extract` on the root that made it
# (the warm start the packed one is held to). Qwen3.6-27B dims at the reference settings
# (scripts/bench_start.py --qwen36-27b), ~7 minutes. Run from the repo root in the kit call that
# carries .kit/deps (the third), or in any later call on the same warm host:
#   OUT=... bash scripts/gpu_start_pack.sh
# What the same host cannot show: a fresh machine's empty page cache and CUDA driver caches (the
# archive is read back from the page cache here); the archive's size and the start itself are as
# elsewhere.
set -uo pipefail
: "${OUT:?set OUT to the output folder of the call}"
env_sh=$(ls .kit/*/device-env.sh /tmp/kitstage/device-env.sh 2>/dev/null | head -1)
[ -n "$env_sh" ] || { echo "gpu_start_pack: no kit piece carried and no /tmp/kitstage: ship the kit first"; exit 3; }
# shellcheck disable=SC1090
source "$env_sh" > /dev/null
[ -f /tmp/kitsite/.ok ] || { echo "gpu_start_pack: the kit is not complete on this host (carry p1, p2, deps)"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
reap() { pkill -9 -f "EngineCore|VLLM::" 2>/dev/null; sleep 2; }
trap reap EXIT
rm -rf /tmp/vh-start
timeout -s TERM "${START_TIMEOUT:-570}" python3 scripts/bench_start.py --qwen36-27b \
  --steps "${STEPS:-warmup,pack,packed,warm}" --cache-root /tmp/vh-start --result "$OUT/gpu-start-pack.json" \
  > "$OUT/start-pack.log" 2>&1
rc=$?
grep "^bench_start\|first sample" "$OUT/start-pack.log" | cut -c1-700
ls -l /tmp/vh-start/warm.tar.gz 2>/dev/null
echo "gpu_start_pack: bench_start.py exited with $rc"
exit $rc
