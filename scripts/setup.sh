#!/usr/bin/env bash
# Create .venv (if needed) and install fxsplit with the given extras.
# torch==2.13.0 is installed first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q "torch==2.13.0"
if [ -n "$extras" ]; then
  python -m pip install -q -e ".[$extras]"
else
  python -m pip install -q -e .
fi
