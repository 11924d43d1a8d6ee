# Sourced by the launch scripts: activate .venv at the repository root, creating it first when missing
# (with the CPU build of torch: an unpinned torch pulls a multi-GB CUDA build).
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet torch==2.13.0
  .venv/bin/pip install --quiet -e '.[dev]'
fi
. .venv/bin/activate
