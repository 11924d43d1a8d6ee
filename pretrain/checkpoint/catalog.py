"""Where checkpoints are and whether they can be trusted: names, manifests, the rank files' format,
and verification of every file's size and sha256 against its manifest.

Layout of ``--save DIR``::

    DIR/iter_0000020/rank_00003.pt   one file per rank: {"states": {name: state_dict}} of its rank-scoped
                                     owners (the ZeRO model state under "model", random streams, ...)
    DIR/iter_0000020/manifest.json   format, iteration, {"states": ...} of the run-scoped owners (the data
                                     position), layout, config, and every file's size and sha256
    DIR/latest                       the name of the newest complete checkpoint

With ``--ckpt-format torch_dcp`` the rank files are a PyTorch Distributed Checkpoint instead (DCP's
``.metadata`` and ``__R_0.distcp`` files, listed in the manifest, whose "storage" is "torch_dcp":
``pretrain.checkpoint.dcp_storage``).

A weights-only checkpoint (``"kind": "weights"``; a Hugging Face import) holds ``model.safetensors``
(the whole fp32 model under layout-independent names) instead of rank files. Files are read with
``torch.load(weights_only=True)`` only, after their checksums match. This module writes no checkpoint
(``checkpointer`` and the Hugging Face import do, through ``write_durably``).
"""

from __future__ import annotations

import functools
import json
import os

import torch

from data.file_digest import files_sha256
from pretrain.checkpoint.errors import CheckpointError
from pretrain.checkpoint.foreign.megatron_checkpoint import is_megatron, is_megatron_iteration, open_megatron
from pretrain.checkpoint.foreign.safe_pickle import load_failure

WEIGHTS_FILE = "model.safetensors"  # the one file of a weights-only checkpoint (an import from Hugging Face)
MODEL = "model"  # the rank-file state that holds the ZeRO model and optimizer, which other layouts re-cut
# rank files: 4 = {"states": {name: state}} with the model as pieces each written once
# (pretrain.checkpoint.saved_pieces), listed with their sha256 in the manifest; 3 = the same with the
# model as its ZeroOptimizer.state_dict() (every replica's copy); 2 = {pieces, optimizer, rng}, with the
# data position at the manifest's top level (read, and upgraded as it is read); 1 held the buffers and
# masters themselves
RANK_FORMAT = 4
READABLE_FORMATS = (2, 3, 4)
# --ckpt-format torch_dcp: the model's states in a PyTorch Distributed Checkpoint (``dcp_storage``)
# instead of rank files; the manifest's "storage" says so and lists DCP's files
DCP_STORAGE, DCP_METADATA = "torch_dcp", ".metadata"


def write_durably(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a fsynced temporary file, renamed into place."""
    with open(path + ".part", "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".part", path)


def fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def iteration_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def latest_name(directory: str) -> str:
    with open(os.path.join(directory, "latest")) as handle:
        return handle.read().strip()


def not_a_checkpoint_directory(directory: str) -> str | None:
    """What ``--load directory`` is when it is something else than a directory of checkpoints, and what to
    give instead: a Hugging Face model, or one checkpoint of a directory (None: neither)."""
    weights = (".safetensors", ".bin", ".safetensors.index.json")
    if os.path.isfile(os.path.join(directory, "config.json")) and any(
            name.endswith(weights) for name in os.listdir(directory)):
        return (f"--load {directory} is a Hugging Face model, not a checkpoint of ours: import it with "
                f"python -m pretrain.convert --from-hf {directory} --output CKPT, then train from it with "
                "--pretrained-checkpoint CKPT")
    name = os.path.basename(os.path.normpath(directory))
    ours = os.path.isfile(os.path.join(directory, "manifest.json"))
    if (ours or is_megatron_iteration(directory)) and name.startswith("iter_"):
        parent = os.path.dirname(os.path.normpath(directory)) or "."
        return (f"--load {directory} is one checkpoint: give the directory that holds it, --load {parent}"
                + (f" --ckpt-step {int(name[5:])}" if name[5:].isdigit() else ""))
    return None


def exists(directory: str, step: int | None = None) -> bool:
    """Whether ``directory`` has a ``latest`` pointer (a run that saved at least once; or Megatron-LM's
    tracker), or with ``step`` that iteration's checkpoint."""
    if is_megatron(directory) and not os.path.exists(os.path.join(directory, "latest")):
        return step is None or os.path.isdir(os.path.join(directory, iteration_name(step)))
    if step is not None:
        return os.path.exists(os.path.join(directory, iteration_name(step), "manifest.json"))
    return os.path.exists(os.path.join(directory, "latest"))


def read_manifest(directory: str, step: int | None = None) -> tuple[str, dict]:
    """The newest complete checkpoint under ``directory`` (or that of iteration ``step``: Megatron's
    --ckpt-step) and its manifest (no rank file is read). A Megatron-LM directory gives the one its
    tracker names, described by a manifest of kind "megatron" (``foreign.megatron_checkpoint``)."""
    if is_megatron(directory) and not os.path.exists(os.path.join(directory, "latest")):
        checkpoint = open_megatron(directory, step)
        return checkpoint.folder, checkpoint.manifest()
    if step is not None:
        name = iteration_name(step)
        if not os.path.isdir(os.path.join(directory, name)):
            raise CheckpointError(f"--ckpt-step {step}: no checkpoint of iteration {step} under --load "
                                  f"{directory} "
                                  f"(saved: {', '.join(map(str, saved_iterations(directory))) or 'none'}); "
                                  "give one of those or drop --ckpt-step")
    else:
        try:
            name = latest_name(directory)
        except OSError as error:
            if not os.path.exists(directory):
                raise CheckpointError(f"--load {directory}: no such directory") from None
            raise CheckpointError(not_a_checkpoint_directory(directory) or
                                  f"--load {directory}: no readable 'latest' pointer ({error.strerror}): "
                                  "not a directory that --save wrote, or no save there completed") from None
    if not _plain_name(name):
        raise CheckpointError(f"{os.path.join(directory, 'latest')}: names {name!r}, not a checkpoint of "
                              "this directory; nothing was loaded")
    try:
        manifest = _manifest_of(os.path.join(directory, name))
    except CheckpointError as error:
        digits = name[len("iter_"):]
        if not (name.startswith("iter_") and digits.isdigit()):
            raise
        raise CheckpointError(f"{error}; {_intact_advice(directory, int(digits))}") from None
    named = [(entry, False) for entry in manifest["files"]] + [
        (value, True) for key, value in (manifest.get("tokenizer") or {}).items() if key != "tokenizer_type"]
    outside = [entry for entry, nested in named
               if not isinstance(entry, str) or not _plain_name(entry, nested)]
    if outside:
        raise CheckpointError(f"{os.path.join(directory, name, 'manifest.json')}: names {outside[0]!r}, a "
                              "file outside its checkpoint directory; refused, nothing was loaded")
    return os.path.join(directory, name), manifest


def _manifest_of(checkpoint: str) -> dict:
    """The manifest of one checkpoint directory, its required keys present."""
    path = os.path.join(checkpoint, "manifest.json")
    try:
        with open(path) as handle:
            manifest = json.load(handle)
        manifest["files"], manifest["iteration"], manifest["layout"]  # noqa: B018 - required keys
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path}: unreadable manifest ({error}); nothing was loaded") from None
    return manifest


def _plain_name(name: str, nested: bool = False) -> bool:
    """Whether ``name`` stays inside the directory it is joined to: relative, no "..", and (unless
    ``nested``: a tokenizer's files sit in a subdirectory) no separator."""
    parts = name.replace("\\", "/").split("/")
    return bool(name) and not os.path.isabs(name) and ".." not in parts and "" not in parts and \
        (nested or len(parts) == 1)


def saved_iterations(directory: str) -> list[int]:
    """The iterations of the complete-looking checkpoints under ``directory``, oldest first."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(entry[len("iter_"):]) for entry in entries
                  if entry.startswith("iter_") and entry[len("iter_"):].isdigit())


def files_to_read(manifest: dict) -> list[str]:
    """The files of a checkpoint whose sha256 a loading rank checks whole: the weights of an import,
    every rank file of formats 2-3 (each holds whole master ranges). A format-4 checkpoint's pieces are
    checked one by one as they are read (none here)."""
    if manifest.get("kind") == "weights":
        return [WEIGHTS_FILE]
    if manifest.get("storage") == DCP_STORAGE:
        return [DCP_METADATA]  # (its data files: each checked whole before a rank first reads it)
    return [] if manifest.get("format") == RANK_FORMAT else rank_entries(manifest)


def rank_entries(manifest: dict) -> list[str]:
    return sorted(entry for entry in manifest["files"] if entry.startswith("rank_"))


def stored_files(manifest: dict) -> list[str]:
    """The files a checkpoint of ours stores its states in: its rank files, or DCP's."""
    return sorted(manifest["files"]) if manifest.get("storage") == DCP_STORAGE else rank_entries(manifest)


def verify(directory: str, step: int | None) -> None:
    """Check, before anything is built, the manifest, that every file is there with its size, and the
    sha256 of each file checked whole (``files_to_read``); a damaged checkpoint raises CheckpointError
    naming the file, the newest intact earlier checkpoint and the flag that loads it."""
    checkpoint, manifest = read_manifest(directory, step)
    if manifest.get("kind") == "megatron":
        return  # no checksums: its files are read with weights_only as they are opened
    try:
        if manifest.get("kind") != "weights":
            check_format(checkpoint, manifest)
            for entry in stored_files(manifest):
                sized(checkpoint, manifest, entry)
        for entry in files_to_read(manifest):
            verified(checkpoint, manifest, entry)
    except CheckpointError as error:
        raise CheckpointError(f"{error}; {_intact_advice(directory, manifest['iteration'])}") from None


def _intact_advice(directory: str, damaged: int) -> str:
    """Where a run goes instead of the damaged checkpoint of iteration ``damaged``."""
    intact = newest_intact(directory, below=damaged)
    return (f"the newest intact checkpoint is {intact[0]}: resume from it with --ckpt-step {intact[1]}"
            if intact else f"no earlier intact checkpoint under {directory}: start without --load")


def newest_intact(directory: str, below: int) -> tuple[str, int] | None:
    """The newest checkpoint under ``directory`` before iteration ``below`` whose files all match its
    manifest (path, iteration), or None."""
    for iteration in reversed([i for i in saved_iterations(directory) if i < below]):
        try:
            checkpoint, manifest = read_manifest(directory, iteration)
            for entry in manifest["files"]:
                verified(checkpoint, manifest, entry)
        except CheckpointError:
            continue
        return checkpoint, iteration
    return None


def sized(checkpoint: str, manifest: dict, entry: str) -> str:
    """The path of file ``entry`` once it exists with the size its manifest records."""
    path = os.path.join(checkpoint, entry)
    recorded = manifest["files"].get(entry)
    if recorded is None or not os.path.exists(path):
        raise CheckpointError(f"{path}: missing from the checkpoint")
    if os.path.getsize(path) != recorded["bytes"]:
        raise CheckpointError(f"{path}: its size differs from the manifest (truncated)")
    return path


def open_rank_file(checkpoint: str, manifest: dict, entry: str) -> dict:
    """Format-4 rank file ``entry``, memory-mapped, once its size matches (its pieces are checked by their
    own sha256 as they are read)."""
    return read_file(sized(checkpoint, manifest, entry))


def verified(checkpoint: str, manifest: dict, entry: str) -> str:
    """The path of rank file ``entry`` once its size and sha256 match the manifest (each file hashed once
    per process: the start-up check's hash serves the read that follows)."""
    path = os.path.join(checkpoint, entry)
    recorded = manifest["files"].get(entry)
    if recorded is None or not os.path.exists(path):
        raise CheckpointError(f"{path}: missing from the checkpoint")
    status = os.stat(path)
    if status.st_size != recorded["bytes"] or _sha256(path, status.st_size,
                                                      status.st_mtime_ns) != recorded["sha256"]:
        raise CheckpointError(f"{path}: size or sha256 differs from the manifest (corrupted or truncated)")
    return path


@functools.lru_cache(maxsize=4096)
def _sha256(path: str, size: int, modified_ns: int) -> str:
    """The file's sha256, once per (path, size, modification time): a file changed since is hashed anew."""
    return files_sha256(path)


def read_file(path: str) -> dict:
    try:  # memory-mapped: only the tensors used come off the disk
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a pickle with code in it, or any other unreadable content
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True): {load_failure(error)}") \
            from None


def check_format(checkpoint: str, manifest: dict) -> None:
    found = manifest.get("format", 1)
    if found not in READABLE_FORMATS:
        readable = ", ".join(map(str, READABLE_FORMATS[:-1])) + f" and {READABLE_FORMATS[-1]}"
        raise CheckpointError(f"{checkpoint}: its rank files are in format {found} and this version reads "
                              f"formats {readable}: load it with the version that wrote it and save it "
                              "again")


def run_states(manifest: dict) -> dict:
    """The run-scoped states of a manifest by name (format 2 kept the data position, the trainer's
    "progress", at its top level)."""
    if manifest.get("format") == 2:
        return {"progress": {key: manifest[key] for key in ("iteration", "consumed_samples")}}
    return manifest.get("states", {})


def read_rank_file(checkpoint: str, manifest: dict, entry: str) -> dict:
    """The states of rank file ``entry`` by name, once it matches the manifest (memory-mapped: only the
    tensors used come off the disk); a format-2 file's parts are named as format 3 names them."""
    content = read_file(verified(checkpoint, manifest, entry))
    if manifest.get("format") == 2:
        return {MODEL: {"pieces": content["pieces"], "optimizer": content["optimizer"]},
                "rng": content["rng"]}
    return content["states"]


def read_rank_files(directory: str, step: int | None = None) -> tuple[str, dict, list[dict]]:
    """The newest complete checkpoint under ``directory`` (or iteration ``step``'s), its manifest and
    every rank file's states."""
    checkpoint, manifest = read_manifest(directory, step)
    check_format(checkpoint, manifest)
    return checkpoint, manifest, [read_rank_file(checkpoint, manifest, entry)
                                  for entry in rank_entries(manifest)]
