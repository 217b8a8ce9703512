#!/usr/bin/env bash
# Runs scripts/gpu_host_side.sh steps one after another in a process session of their own, so
# that one sequence of cold 27B engines can outlast a single 10-minute call on a warm GPU host;
# later calls on the same host wait for it and bring back what it wrote so far (one tar.gz:
# each step's JSON results, logs and printed tail, and the progress file).
#   OUT=... STEPS=plain,extract,fp8gen bash scripts/gpu_background.sh start [WAIT_SECONDS]
#   OUT=... bash scripts/gpu_background.sh wait [WAIT_SECONDS]
# Run `start` in the call that carries the kit's last piece (or later on the same host).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the output folder of the call}"
dir=/tmp/vh-bg

collect() {
  local deadline=$((SECONDS + ${1:-560}))
  while [ ! -f $dir/done ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
  cat $dir/progress 2>/dev/null
  [ -f $dir/done ] && echo "gpu_background: all steps ended" || echo "gpu_background: still running"
  tar czf "$OUT/gpu-background.tar.gz" -C $dir out progress 2>/dev/null
}

case "${1:-}" in
  start)
    : "${STEPS:?set STEPS to a comma list of gpu_host_side.sh steps}"
    [ -f $dir/progress ] && [ ! -f $dir/done ] && { echo "gpu_background: a sequence is running"; exit 2; }
    rm -rf $dir && mkdir -p $dir/out
    env_sh=$(ls .kit/*/device-env.sh /tmp/kitstage/device-env.sh 2>/dev/null | head -1)
    # shellcheck disable=SC1090
    [ -n "$env_sh" ] && source "$env_sh"
    [ -f /tmp/kitsite/.ok ] || { echo "gpu_background: the kit is not complete on this host"; exit 3; }
    export STEPS dir
    setsid nohup bash -c 'for s in ${STEPS//,/ }; do
        echo "$(date +%T) start $s" >> $dir/progress
        OUT=$dir/out STEP=$s bash scripts/gpu_host_side.sh > $dir/out/step-$s.txt 2>&1
        echo "$(date +%T) end $s rc=$?" >> $dir/progress
      done; touch $dir/done' > /dev/null 2>&1 < /dev/null &
    sleep 2
    collect "${2:-540}"
    ;;
  wait) collect "${2:-560}" ;;
  *) echo "usage: OUT=... [STEPS=a,b] bash scripts/gpu_background.sh start|wait [SECONDS]"; exit 2 ;;
esac
