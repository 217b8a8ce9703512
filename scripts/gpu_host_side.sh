#!/usr/bin/env bash
# The GPU items of "the host never the bottleneck": FP8 targets against plain vLLM, the host side
# alone on the GPU host's CPUs, and the GPU tests the change touches. Run from the repo root in a
# call that carries the kit's last piece (.kit/deps, with .kit/extra), or in any later call on the
# same warm host. Each STEP fits one 10-minute call (a cold 27B engine takes ~4 min to start):
#   STEP=fp8      tests/gpu/test_gpu_fp8.py alone (~6-9 min with cold compile caches)
#   STEP=fp8gen   its --generate case alone (test_gpu_fp8_generate)
#   STEP=tests    scripts/bench_writer.py --pipeline on this host's CPUs, then test_gpu_capture.py
#                 (parity with HF, and the statistics made from the device's row sums)
#   STEP=plain    scripts/bench.py --qwen36-27b plain-fp8w on W-chat and W-short
#   STEP=extract  ... extract-fp8w, merged into the same result (run STEP=plain first on this host,
#                 or pass RESULT=<an earlier call's result file in the working tree>)
#   STEP=server   tests/gpu/test_gpu_server.py (~3.5 min)
#   STEP=bf16     bench.py plain and extract (two cold engines: one call each with CASES=plain, then
#                 CASES=extract; or STEP=plain-bf16, then STEP=extract-bf16)
#   STEP=fp8b     bench.py plain-fp8b, then extract-fp8b (CASES= as for bf16)
#   STEP=generate scripts/bench_generate.py single turn (TURNS=3 for turn by turn)
#   STEP=trace-plain, then STEP=trace-extract: bench.py --step-trace of plain-fp8w, then extract-fp8w,
#                 on W-chat and W-short: every scheduler step of each (with the scheduler's queues), merged
#                 into bench-trace.json; plain once per feed (FEEDS, bench.py --feeds: default window,all)
#   STEP=trace-extract-notaper: the same extract-fp8w trace with VHIDDEN_TAPER=0 (the end of the run not
#                 tapered), into bench-notaper.json: what the taper costs or saves, against trace-extract
#   STEP=trace-extract-norelease: the same with VHIDDEN_RELEASE=0 (prompt-only requests keep their KV blocks
#                 until they finish, as vLLM's), into bench-norelease.json: what freeing them at scheduling moves
#   STEP=release-test tests/gpu/test_gpu_capture.py's freed-blocks case alone (parity with HF, blocks reused)
#   STEP=seqs512  bench.py --step-trace of CASES (default extract-fp8w) at --max-num-seqs 512, into bench-seqs512.json
#   STEP=profile-short  py-spy record of bench.py's CASES (default plain-fp8w) on W-short (.kit/extra: py-spy)
#   STEP=truncate scripts/check_truncate.py under torch.compile and CUDA graphs, tiny hybrid: layers 1,4 (built
#                 whole, the forward stopped at layer 5 of 8) and 1,3 (built with 4 layers), each against
#                 --full-model (each pair compiles cold, Triton autotune included: up to 7 min a pair, so run
#                 it in scripts/gpu_background.sh)
#   STEP=colocated tests/gpu/test_gpu_colocated.py, then scripts/bench_colocated.py --qwen36-27b (SAMPLES, CASES): drafter
#                 steps/s colocated (pull-through, look-ahead), from offline shards and from `serve` files, one card (four cold 27B
#                 engines and an extract: run it in scripts/gpu_background.sh)
#   STEP=colocated-test tests/gpu/test_gpu_colocated.py alone (tiny model, two compiled starts)
#   STEP=online   scripts/gpu_online.sh, CASES default plain-fp8w,vllm-connector-fp8w,ours-fp8w (three cold
#                 servers: run it in scripts/gpu_background.sh, it outlasts one call)
# Environment: OUT (required: results and logs go there), RESULT (see STEP=extract), CASES.
# Everything takes about ten calls after the kit's three (fp8, tests, plain, extract, server, bf16 x2,
# fp8b x2, generate x2): each 27B case starts its own cold engine (~4 min) and a call may run 10.
# What matters most first: fp8, then plain + extract (FP8 extract against plain FP8 on both workloads).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the output folder of the call}"
STEP=${STEP:?set STEP to fp8, fp8gen, tests, plain, extract, server, bf16, plain-bf16, extract-bf16, fp8b, generate, trace-plain, trace-extract, trace-extract-notaper, trace-extract-norelease, release-test, seqs512, profile-short, truncate, colocated, colocated-test or online}
mkdir -p "$OUT"

env_sh=$(ls .kit/*/device-env.sh /tmp/kitstage/device-env.sh 2>/dev/null | head -1)
[ -n "$env_sh" ] || { echo "gpu_host_side: no kit piece carried and no /tmp/kitstage: ship the kit first"; exit 3; }
# shellcheck disable=SC1090
source "$env_sh" > /dev/null
[ -f /tmp/kitsite/.ok ] || { echo "gpu_host_side: the kit is not complete on this host (carry p1, p2, deps)"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 3
export VHIDDEN_CACHE_DIR=/tmp/vhc  # compile caches kept on a warm host
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lscpu | grep -m1 "Model name" || true

# one result file for the bench.py cases of one host: kept in /tmp while the host is warm
BENCH=/tmp/vh-results/bench-fp8.json
mkdir -p /tmp/vh-results
if [ -n "${RESULT:-}" ] && [ -f "$RESULT" ] && [ ! -f "$BENCH" ]; then cp "$RESULT" "$BENCH"; fi

# a step stopped by its time limit leaves vLLM's engine processes holding the GPU: the next start
# would wait for memory that never frees
reap() { pkill -9 -f "EngineCore|VLLM::" 2>/dev/null; sleep 2; }
trap reap EXIT
quiet() { grep -v "^INFO\|^(EngineCore\|^WARNING\|^(Worker\|^(APIServer" "$1" | tail -"${2:-30}"; }
bench() {  # bench.py cases $1 on both workloads, merged into $BENCH
  local append=()
  [ -f "$BENCH" ] && append=(--append)
  # shellcheck disable=SC2086  # BENCH_EXTRA: extra flags, word-split on purpose
  timeout -s TERM "${BENCH_TIMEOUT:-560}" python3 scripts/bench.py --qwen36-27b --workloads w-chat,w-short \
    --cases "$1" --result "$BENCH" "${append[@]}" ${BENCH_EXTRA:-} > "$OUT/bench-$1.log" 2>&1
  local rc=$?
  quiet "$OUT/bench-$1.log" 25
  cp "$BENCH" "$OUT/" 2>/dev/null
  return $rc
}

rc=0
case "$STEP" in
  fp8)
    timeout -k 10 "${FP8_S:-560}" python3 -m pytest -q -s -x -p no:cacheprovider tests/gpu/test_gpu_fp8.py \
      > "$OUT/gpu-fp8.log" 2>&1
    rc=$?
    quiet "$OUT/gpu-fp8.log" 30
    ;;
  fp8gen)
    timeout -k 10 "${FP8_S:-560}" python3 -m pytest -q -s -x -p no:cacheprovider tests/gpu/test_gpu_fp8.py \
      -k generate > "$OUT/gpu-fp8-generate.log" 2>&1
    rc=$?
    quiet "$OUT/gpu-fp8-generate.log" 30
    ;;
  tests)
    df -h /dev/shm | tail -1
    timeout 70 python3 scripts/bench_writer.py --dir /dev/shm/vh-wb --pipeline w-short,w-chat --pipeline-gb 6 \
      --threads 4 --stats device,host --result "$OUT/writer-pipeline.json" 2>&1 | tail -6
    timeout -k 10 "${CAPTURE_S:-400}" python3 -m pytest -q -s -x -p no:cacheprovider tests/gpu/test_gpu_capture.py \
      > "$OUT/gpu-capture.log" 2>&1
    rc=$?
    reap
    quiet "$OUT/gpu-capture.log" 15
    ;;
  plain) bench plain-fp8w; rc=$? ;;
  extract) bench extract-fp8w; rc=$? ;;
  bf16) bench "${CASES:-plain}"; rc=$? ;;
  plain-bf16) bench plain; rc=$? ;;
  trace-plain | trace-extract)
    BENCH=/tmp/vh-results/bench-trace.json BENCH_EXTRA="--step-trace --feeds ${FEEDS:-window,all}" \
      bench "${STEP#trace-}-fp8w"
    rc=$? ;;
  trace-extract-notaper)
    BENCH=/tmp/vh-results/bench-notaper.json BENCH_EXTRA="--step-trace --feeds window" VHIDDEN_TAPER=0 \
      bench extract-fp8w
    rc=$? ;;
  trace-extract-norelease)
    BENCH=/tmp/vh-results/bench-norelease.json BENCH_EXTRA="--step-trace --feeds window" VHIDDEN_RELEASE=0 \
      bench extract-fp8w
    rc=$? ;;
  seqs512)
    # the same trace at --max-num-seqs 512 for every case (plain and extract alike): with the blocks
    # freed at scheduling the step made while a full one runs is capped by max_num_seqs, not the cache
    seqs="--engine-arg=--max-num-seqs --engine-arg=512"
    BENCH=/tmp/vh-results/bench-seqs512.json BENCH_EXTRA="--step-trace --feeds window $seqs" bench "${CASES:-extract-fp8w}"
    rc=$? ;;
  profile-short)
    # where W-short's time goes, host side: py-spy's samples of every process of one bench run
    # (raw: one line per stack with its count; the engine core's lines name its process), the
    # cold compile included (its stacks are torch's); py-spy from .kit/extra (build.sh py-spy==0.4.3)
    command -v py-spy > /dev/null || python3 -m pip install -q --no-index --no-deps .kit/extra/py_spy-*.whl || exit 3
    timeout -s INT "${BENCH_TIMEOUT:-560}" py-spy record --subprocesses --rate 100 --format raw --nonblocking \
      -o "$OUT/profile-${CASES:-plain-fp8w}.txt" -- python3 scripts/bench.py --qwen36-27b --workloads w-short \
      --cases "${CASES:-plain-fp8w}" --result /tmp/vh-results/bench-profile.json > "$OUT/profile.log" 2>&1
    rc=$?
    quiet "$OUT/profile.log" 15
    ;;
  release-test)
    timeout -k 10 "${CAPTURE_S:-400}" python3 -m pytest -q -s -x -p no:cacheprovider tests/gpu/test_gpu_capture.py \
      -k freed_prompt_blocks > "$OUT/gpu-release.log" 2>&1
    rc=$?
    quiet "$OUT/gpu-release.log" 15
    ;;
  extract-bf16) bench extract; rc=$? ;;
  fp8b) bench "${CASES:-plain-fp8b}"; rc=$? ;;
  server)
    timeout -k 10 540 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_server.py -rxXf \
      > "$OUT/gpu-server.log" 2>&1
    rc=$?
    quiet "$OUT/gpu-server.log" 30
    ;;
  generate)
    timeout -k 10 560 python3 scripts/bench_generate.py --qwen36-27b --turns "${TURNS:-1}" \
      --max-tokens "$([ "${TURNS:-1}" = 1 ] && echo 256 || echo 128)" --result "$OUT/generate.json" \
      > "$OUT/generate.log" 2>&1
    rc=$?
    quiet "$OUT/generate.log" 25
    ;;
  truncate)
    for layers in 1,4 1,3; do
      TRITON_CACHE_DIR=/tmp/vh-truncate-triton timeout 420 python3 scripts/check_truncate.py --layers $layers --result "$OUT/check-truncate-${layers/,/-}.json" \
        > "$OUT/check-truncate-${layers/,/-}.log" 2>&1 || rc=1
      quiet "$OUT/check-truncate-${layers/,/-}.log" 6
    done
    ;;
  online)
    CASES=${CASES:-plain-fp8w,vllm-connector-fp8w,ours-fp8w} BENCH_TIMEOUT=${BENCH_TIMEOUT:-1500} \
      bash scripts/gpu_online.sh > "$OUT/online.log" 2>&1
    rc=$?
    quiet "$OUT/online.log" 30
    ;;
  colocated-test)
    [ -n "${SKIP_TEST:-}" ] || timeout -k 10 420 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_colocated.py -rxXf \
      > "$OUT/gpu-colocated-test.log" 2>&1 || rc=1
    quiet "$OUT/gpu-colocated-test.log" 12
    ;;
  colocated)
    # speculators' client and hs_connectors (the online case), as gpu_online.sh installs them
    python3 -c "import hs_connectors, importlib.metadata as m; m.version('speculators')" 2>/dev/null ||
      python3 -m pip install -q --no-index --no-deps .kit/extra/speculators-0.9.0-*.whl .kit/extra/hs_connectors-0.9.0-*.whl
    [ -n "${SKIP_TEST:-}" ] || timeout -k 10 420 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_colocated.py -rxXf \
      > "$OUT/gpu-colocated-test.log" 2>&1 || rc=1
    quiet "$OUT/gpu-colocated-test.log" 12
    VHIDDEN_CACHE_DIR=/tmp/vhc timeout -k 10 "${BENCH_TIMEOUT:-1500}" python3 scripts/bench_colocated.py --qwen36-27b \
      --cases "${CASES:-colocated,colocated-ahead,offline,online}" --samples "${SAMPLES:-1024}" \
      --work /tmp/vh-colocated --result "$OUT/bench-colocated.json" > "$OUT/bench-colocated.log" 2>&1 || rc=1
    quiet "$OUT/bench-colocated.log" 20
    mkdir -p "$OUT/colocated-logs" && cp /tmp/vh-colocated/*.log "$OUT/colocated-logs/" 2>/dev/null
    ;;
  *) echo "gpu_host_side: unknown STEP=$STEP"; exit 2 ;;
esac
exit $rc
