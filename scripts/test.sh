#!/usr/bin/env bash
# The test suite on a fresh machine: set up (with test, solver, benchmark, drawing and dev extras), lint, type-check,
# then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v dot >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing graphviz with apt-get (the rendering tests draw plans with its dot program)"
  (apt-get update -qq && apt-get install -y -qq graphviz) >/dev/null 2>&1 || echo "note: could not install graphviz; rendering tests will check the install hint instead"
fi
bash scripts/setup.sh "test,solver,bench,viz,hf,dev"
. .venv/bin/activate
ruff check fxsplit tests benchmarks examples
ruff format --check fxsplit tests benchmarks examples
mypy fxsplit
# two worker processes (pytest-xdist): the suite takes about half as long on CI's two cores; FXSPLIT_TEST_WORKERS
# sets another count (0: one process, no workers)
python -m pytest -q -n "${FXSPLIT_TEST_WORKERS:-2}" "$@"
