#!/usr/bin/env bash
# The main job: a small 3D-parallel GPT pretraining run on this machine's CPU, on the built-in stdlib
# corpus (no download). Creates .venv with the CPU build of torch when missing. Extra arguments go
# to pretrain (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet torch==2.13.0   # the CPU wheel; an unpinned torch pulls a CUDA build
  .venv/bin/pip install --quiet -e '.[dev]'
fi
. .venv/bin/activate
exec python -m launch.torchrun --nproc 8 --config launch/configs/cpu-default.yaml "$@"
