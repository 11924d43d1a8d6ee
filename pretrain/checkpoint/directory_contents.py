"""What a directory already holds, by its file names alone (no file is opened but a pointer): a
directory of our checkpoints, one checkpoint of ours, Megatron-LM's, a PyTorch Distributed Checkpoint (a
torchtitan step folder), a torchtitan run's checkpoint folder, a Hugging Face model, or other files.

Two users: a conversion, which must never write into a directory holding a checkpoint it would damage
(``check_output``), and ``--load``, which takes a missing or empty directory (or one our own first save is
still filling) as "no checkpoint yet" and refuses any other (``foreign_contents``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from pretrain.checkpoint.foreign.megatron_checkpoint import TRACKER, is_megatron_iteration

HF_WEIGHTS = (".safetensors", ".bin", ".safetensors.index.json")
DCP_METADATA = ".metadata"
# what a run of ours writes into --save before its first checkpoint is complete: iteration folders (being
# staged, or renamed but not yet named by ``latest``), the pointer's temporary file, the write probes
_OURS_IN_PROGRESS = re.compile(r"iter_\d{7}(\.tmp)?|latest\.part|\.write-probe-rank\d+")
_TORCHTITAN_STEP = re.compile(r"step-\d+")


@dataclass(frozen=True)
class Held:
    """A checkpoint found in a directory: its ``kind`` ("ours", "ours_one", "megatron", "megatron_one",
    "dcp", "torchtitan", "hf") and what a message calls it."""
    kind: str
    description: str


def _entries(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def held_checkpoint(directory: str) -> Held | None:
    """The checkpoint ``directory`` holds, or None (missing, empty, or no checkpoint among its files)."""
    entries = _entries(directory)
    if not entries:
        return None
    names = set(entries)
    iterations = [name for name in entries if re.fullmatch(r"iter_\d{7}", name)]
    if "latest" in names or any(os.path.isfile(os.path.join(directory, name, "manifest.json"))
                                for name in iterations):
        pointer = _read(os.path.join(directory, "latest"))
        return Held("ours", "checkpoints of ours (" + (f"latest: {pointer}" if pointer else
                                                        f"iterations {', '.join(iterations)}") + ")")
    if "manifest.json" in names and os.path.basename(os.path.normpath(directory)).startswith("iter_"):
        return Held("ours_one", "one checkpoint of ours (its manifest.json)")
    if TRACKER in names:
        return Held("megatron", f"a Megatron-LM checkpoint directory ({TRACKER}: "
                                f"{_read(os.path.join(directory, TRACKER)) or '?'})")
    if is_megatron_iteration(directory):
        return Held("megatron_one", "one iteration of a Megatron-LM checkpoint")
    if DCP_METADATA in names:
        return Held("dcp", "a PyTorch Distributed Checkpoint (.metadata, *.distcp: a torchtitan step folder)")
    steps = [name for name in entries if _TORCHTITAN_STEP.fullmatch(name)
             and os.path.isfile(os.path.join(directory, name, DCP_METADATA))]
    if steps:
        return Held("torchtitan", f"torchtitan's checkpoint folder (step folders {', '.join(steps[:3])}"
                                  f"{', ...' if len(steps) > 3 else ''})")
    if "config.json" in names and any(name.endswith(HF_WEIGHTS) for name in entries):
        return Held("hf", "a Hugging Face model (config.json and its weights)")
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read(64).strip()
    except OSError:
        return None


def check_output(directory: str, writes: str, flag: str, add: bool) -> Held | None:
    """Refuse (ValueError naming what is there) to write a checkpoint of kind ``writes`` ("ours",
    "megatron": a directory of checkpoints; "dcp", "hf": a folder that is one) into ``directory`` when it
    already holds a checkpoint, unless ``add`` (--add-to-output) and it holds checkpoints of the same
    directory kind, which the new one joins. Returns what is there (None: nothing)."""
    held = held_checkpoint(directory)
    if held is None:
        return None
    if add and held.kind == writes and writes in ("ours", "megatron"):
        return held
    joins = writes in ("ours", "megatron") and held.kind == writes
    raise ValueError(f"{flag} {directory} already holds {held.description}: writing there would overwrite "
                     "or mix with it; give a new or empty directory"
                     + (", or add --add-to-output to add this checkpoint beside it (its 'latest' is kept "
                        "unless the new one is newer)" if joins else ""))


def foreign_contents(directory: str) -> str | None:
    """Why ``--load directory`` (an existing directory without a checkpoint pointer) is refused, or None
    when it may start a run from iteration 0: empty, or holding only what our first save writes."""
    entries = _entries(directory)
    if all(_OURS_IN_PROGRESS.fullmatch(name) for name in entries):
        return None
    held = held_checkpoint(directory)
    if held is not None and held.kind in ("dcp", "torchtitan"):
        step = directory if held.kind == "dcp" else "STEP_DIR"
        return (f"--load {directory} is {held.description}, not a checkpoint of ours: import it with "
                f"python -m pretrain.convert --from-torchtitan {step} "
                "--output CKPT --num-attention-heads H, then train from it with --pretrained-checkpoint CKPT")
    if held is not None:
        return f"--load {directory} holds {held.description}, which --load cannot resume"
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    return (f"--load {directory} holds no checkpoint (it has {shown}): give the directory a run's --save "
            "wrote, or a missing or empty one to start from iteration 0")
