#!/usr/bin/env bash
# The main demo on a fresh machine: set up, then split the tutorial model over two devices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python examples/three_layer.py
