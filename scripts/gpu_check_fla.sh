#!/usr/bin/env bash
# The GPU items of `check` on Qwen3.5/3.6: tests/gpu/test_gpu_fp8.py (its `check --reference engine`
# on the composite checkpoint) and check's seconds per sample with the Gated-DeltaNet layers on the
# torch fallback and on flash-linear-attention (scripts/bench_check.py). On a GPU host with
# vLLM 0.26 and fla-core importable, from the project root:
#   OUT=/some/dir bash scripts/gpu_check_fla.sh          # both, ~10 min on one H100/H200
#   STEP=fp8 OUT=... bash scripts/gpu_check_fla.sh       # or one of them: fp8 | bench
# Results: $OUT/gpu-fp8.json, $OUT/check-fla.json, and each step's log under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to a directory for the results}"
mkdir -p "$OUT"
STEP=${STEP:-all}
export VHIDDEN_CACHE_DIR=${VHIDDEN_CACHE_DIR:-/tmp/vllm-hidden-cache}
python3 -c "import fla; print('fla', fla.__version__)" || echo "fla not importable: the fla runs are refused"
rc=0
if [ "$STEP" = all ] || [ "$STEP" = bench ]; then
  python3 scripts/bench_check.py --budget-s "${BENCH_BUDGET_S:-300}" 2>&1 | tee "$OUT/bench-check.log" | tail -40
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [ "$STEP" = all ] || [ "$STEP" = fp8 ]; then
  python3 -m pytest -q -s -x -p no:cacheprovider tests/gpu/test_gpu_fp8.py > "$OUT/gpu-fp8.log" 2>&1
  rc=$(( rc || $? ))
  grep -v "^INFO\|^(EngineCore\|^WARNING\|^(Worker" "$OUT/gpu-fp8.log" | tail -40
fi
exit $rc
