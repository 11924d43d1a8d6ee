#!/usr/bin/env bash
# The main job: create the environment when missing, then run it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet torch==2.13.0
  .venv/bin/pip install --quiet -e '.[dev]'
fi
. .venv/bin/activate
export OMP_NUM_THREADS=1
python -m parallel.topology --world-size 8 --tp 2 --pp 2 --gpus-per-node 4
