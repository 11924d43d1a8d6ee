# Sourced by the launch scripts: activate .venv at the repository root, creating it first when missing
# (with the CPU build of torch: an unpinned torch pulls a multi-GB CUDA build).
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet torch==2.13.0
  .venv/bin/pip install --quiet -e '.[dev]'
  # the Newton-Schulz of Megatron's Muon, a test oracle (absl-py comes with tensorboard); it asks
  # for Python 3.12 for typing.override alone, which its test gives it on 3.11
  .venv/bin/pip install --quiet --no-deps --ignore-requires-python emerging-optimizers==0.3.0
fi
. .venv/bin/activate
