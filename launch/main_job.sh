#!/usr/bin/env bash
# The main job: a small 3D-parallel GPT pretraining run on this machine's CPU, on the built-in stdlib
# corpus (no download). Creates .venv with the CPU build of torch when missing. Extra arguments go
# to pretrain (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/venv.sh
exec python -m launch.torchrun --nproc 8 --config launch/configs/cpu-default.yaml "$@"
