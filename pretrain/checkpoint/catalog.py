"""Sharded checkpoints that are never half-written, verified before they are trusted.

Layout of ``--save DIR``::

    DIR/iter_0000020/rank_00003.pt   one file per rank: its parameters (whole buffers, stage-3 shards),
                                     fp32 masters, optimizer and loss-scaler state, random states
    DIR/iter_0000020/manifest.json   iteration, consumed samples, layout, config, and every file's
                                     size and sha256
    DIR/latest                       the name of the newest complete checkpoint

A weights-only checkpoint (``"kind": "weights"`` in its manifest; a Hugging Face import) holds
``model.safetensors`` (the whole fp32 model under layout-independent names) instead of rank files,
and loads as fine-tuning does: weights into any layout, a fresh optimizer, iteration 0.

Each rank writes its file into ``iter_N.tmp`` (fsynced); after every rank has finished, rank 0 hashes
the files, writes the manifest, renames the directory to ``iter_N`` and only then replaces ``latest``
atomically, so a crash at any point leaves the previous checkpoint as ``latest`` and loadable. Loading
reads ``latest``, checks the manifest and the checksum of every file it reads, and uses
``torch.load(weights_only=True)`` only. A checkpoint of another layout (dp, tp, pp, ZeRO stage, virtual
stages) is re-cut by parameter name (``pretrain.checkpoint.reshard``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch
from torch import nn

from parallel import comm
from parallel.process_groups import ParallelGroups, default_device
from parallel.tensor.random import RNGTracker
from parallel.topology import Topology
from parallel.zero.optimizer import ZeroOptimizer
from parallel.zero.state_readers import saved_loss_scaler
from pretrain.checkpoint import reshard
from pretrain.training.progress import TrainingProgress


WEIGHTS_FILE = "model.safetensors"  # the one file of a weights-only checkpoint (an import from Hugging Face)
# what rank files hold: 2 = {pieces, optimizer: ZeroOptimizer.state_dict(), rng}; 1 (unmarked) had the buffers,
# shards and masters beside the optimizer state
RANK_FORMAT = 2


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or used, with the file that says so."""


class SaveError(CheckpointError):
    """A save that failed on some rank, raised alike on every rank (the previous checkpoint stays latest)."""


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_durably(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a fsynced temporary file, renamed into place."""
    with open(path + ".part", "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".part", path)


def _fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def layout_of(topology: Topology, zero_stage: int, shard_size: int | None = None) -> dict:
    """What a same-layout load must match (``shard_size``: a MiCS / HSDP shard group smaller than dp)."""
    layout = {"world_size": topology.world_size, "tp": topology.tp, "pp": topology.pp, "dp": topology.dp,
              "zero_stage": zero_stage}
    if shard_size is not None and shard_size != topology.dp:
        layout["zero_shard_size"] = shard_size
    return layout


def save(directory: str, progress: TrainingProgress, groups: ParallelGroups, optimizer: ZeroOptimizer,
         names: dict[nn.Parameter, str], rng: RNGTracker, config: dict, keep_last: int = 0,
         retain_interval: int | None = None) -> str:
    """Write the checkpoint of ``progress.iteration`` (a collective over the world); return its final
    path. Each state is written by its owner's ``state_dict()``: ``progress`` into the manifest, the
    optimizer (parameters, masters, optimizer states, loss scale) and ``rng`` into the rank file.
    ``names`` are the parameters' layout-independent names (what another layout re-cuts the states by).
    Then prune: keep the newest ``keep_last`` (0: all), and with ``retain_interval`` only the checkpoints
    at its multiples besides the newest."""
    name = iteration_name(progress.iteration)
    final, staging = os.path.join(directory, name), os.path.join(directory, name + ".tmp")

    def agreed(problem: str | None) -> None:  # every rank learns of any rank's failure: no one waits alone
        failed = [(rank, text) for rank, text in enumerate(comm.all_gather_object(problem, groups.world,
                                                                                    default_device())) if text]
        if failed:
            if groups.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            kept = f"{os.path.join(directory, _latest_name(directory))} is still the latest checkpoint, intact" \
                if exists(directory) else "no earlier checkpoint exists"
            rank, text = failed[0]
            raise SaveError(f"saving iteration {progress.iteration} failed on rank {rank}: {text}; {kept}. "
                                  f"Free space under --save {directory} (or choose another) and resume with --load")

    problem = None
    if groups.rank == 0:
        try:
            shutil.rmtree(staging, ignore_errors=True)  # a crashed earlier attempt: never trusted
            os.makedirs(staging)
        except OSError as error:
            problem = f"{error.strerror or error}: {staging}"
    agreed(problem)
    path = os.path.join(staging, f"rank_{groups.rank:05d}.pt")
    problem = None
    with optimizer.states_in_memory():
        pieces = reshard.describe(optimizer, names, groups.tp_rank, groups.topology.tp)
        state = {"pieces": pieces, "optimizer": optimizer.state_dict(), "rng": rng.state_dict()}
        try:  # through a Python file: a full disk or a file-size limit is an OSError that says so
            with open(path + ".part", "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(path + ".part", path)
        except (OSError, RuntimeError) as error:  # torch's zip writer re-raises a failed write as a RuntimeError
            cause = error if isinstance(error, OSError) else error.__context__
            if not isinstance(cause, OSError):
                raise
            problem = f"cannot write {path} ({cause.strerror or cause})"
    agreed(problem)
    problem = None
    if groups.rank == 0:
        try:
            _publish(directory, staging, final, name, progress, groups, optimizer, config, keep_last,
                     retain_interval)
        except OSError as error:
            problem = f"{error.strerror or error}: {error.filename or staging}"
    agreed(problem)
    return final


def _publish(directory: str, staging: str, final: str, name: str, progress: TrainingProgress,
             groups: ParallelGroups, optimizer: ZeroOptimizer, config: dict, keep_last: int,
             retain_interval: int | None) -> None:
    """Rank 0, once every rank file is down: the manifest, the rename, ``latest``, then pruning."""
    files = {entry: {"bytes": os.path.getsize(os.path.join(staging, entry)),
                     "sha256": file_sha256(os.path.join(staging, entry))}
             for entry in sorted(os.listdir(staging))}
    manifest = {"format": RANK_FORMAT, **progress.state_dict(),
                "layout": layout_of(groups.topology, optimizer.stage, optimizer.dp.size), "config": config,
                "files": files}
    write_durably(os.path.join(staging, "manifest.json"), json.dumps(manifest, indent=1, default=str).encode())
    _fsync_directory(staging)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    write_durably(os.path.join(directory, "latest"), name.encode())
    _fsync_directory(directory)
    kept = sorted(entry for entry in os.listdir(directory)
                  if entry.startswith("iter_") and not entry.endswith(".tmp"))
    dropped = set(kept[:-keep_last]) if keep_last > 0 else set()
    if retain_interval:
        dropped |= {entry for entry in kept[:-1] if int(entry[len("iter_"):]) % retain_interval}
    for old in sorted(dropped):
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def iteration_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _latest_name(directory: str) -> str:
    with open(os.path.join(directory, "latest")) as handle:
        return handle.read().strip()


def exists(directory: str, step: int | None = None) -> bool:
    """Whether ``directory`` has a ``latest`` pointer (a run that saved at least once), or with ``step``
    that iteration's checkpoint."""
    if step is not None:
        return os.path.exists(os.path.join(directory, iteration_name(step), "manifest.json"))
    return os.path.exists(os.path.join(directory, "latest"))


def read_manifest(directory: str, step: int | None = None) -> tuple[str, dict]:
    """The newest complete checkpoint under ``directory`` (or that of iteration ``step``: Megatron's
    --ckpt-step) and its manifest (no rank file is read)."""
    if step is not None:
        name = iteration_name(step)
        if not os.path.isdir(os.path.join(directory, name)):
            raise CheckpointError(f"--ckpt-step {step}: no checkpoint of iteration {step} under --load {directory} "
                                  f"(saved: {', '.join(map(str, saved_iterations(directory))) or 'none'}); give "
                                  "one of those or drop --ckpt-step")
    else:
        try:
            name = _latest_name(directory)
        except OSError as error:
            raise CheckpointError(f"--load {directory}: no readable 'latest' pointer ({error.strerror})") from None
    path = os.path.join(directory, name, "manifest.json")
    try:
        with open(path) as handle:
            manifest = json.load(handle)
        manifest["files"], manifest["iteration"], manifest["layout"]  # noqa: B018 - required keys
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path}: unreadable manifest ({error}); nothing was loaded") from None
    return os.path.join(directory, name), manifest


def saved_iterations(directory: str) -> list[int]:
    """The iterations of the complete-looking checkpoints under ``directory``, oldest first."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(entry[len("iter_"):]) for entry in entries
                  if entry.startswith("iter_") and entry[len("iter_"):].isdigit())


def files_to_read(manifest: dict, layout: dict, rank: int, weights_only: bool) -> list[str]:
    """The files of a checkpoint that ``rank`` of a run in ``layout`` reads: its own rank file when the
    layout is the same, every rank file to re-cut another layout, the weights of an import."""
    if manifest.get("kind") == "weights":
        return [WEIGHTS_FILE]
    if manifest["layout"] == layout and not weights_only:
        return [f"rank_{rank:05d}.pt"]
    return _rank_entries(manifest)


def _rank_entries(manifest: dict) -> list[str]:
    return sorted(entry for entry in manifest["files"] if entry.startswith("rank_"))


def verify(directory: str, step: int | None, layout: dict, rank: int, weights_only: bool) -> None:
    """Check, before anything is built, the manifest and every file ``rank`` will read (sizes and
    sha256); a damaged checkpoint raises CheckpointError naming the file, the newest intact earlier
    checkpoint and the flag that loads it."""
    checkpoint, manifest = read_manifest(directory, step)
    try:
        if manifest.get("kind") != "weights":
            _check_format(checkpoint, manifest)
        for entry in files_to_read(manifest, layout, rank, weights_only):
            _verified(checkpoint, manifest, entry)
    except CheckpointError as error:
        intact = newest_intact(directory, below=manifest["iteration"])
        advice = (f"the newest intact checkpoint is {intact[0]}: resume from it with --ckpt-step {intact[1]}"
                  if intact else f"no earlier intact checkpoint under {directory}: start without --load")
        raise CheckpointError(f"{error}; {advice}") from None


def newest_intact(directory: str, below: int) -> tuple[str, int] | None:
    """The newest checkpoint under ``directory`` before iteration ``below`` whose files all match its
    manifest (path, iteration), or None."""
    for iteration in reversed([i for i in saved_iterations(directory) if i < below]):
        try:
            checkpoint, manifest = read_manifest(directory, iteration)
            for entry in manifest["files"]:
                _verified(checkpoint, manifest, entry)
        except CheckpointError:
            continue
        return checkpoint, iteration
    return None


def _verified(checkpoint: str, manifest: dict, entry: str) -> str:
    """The path of rank file ``entry`` once its size and sha256 match the manifest."""
    path = os.path.join(checkpoint, entry)
    recorded = manifest["files"].get(entry)
    if recorded is None or not os.path.exists(path):
        raise CheckpointError(f"{path}: missing from the checkpoint")
    if os.path.getsize(path) != recorded["bytes"] or file_sha256(path) != recorded["sha256"]:
        raise CheckpointError(f"{path}: size or sha256 differs from the manifest (corrupted or truncated)")
    return path


def _read(path: str) -> dict:
    try:  # memory-mapped: only the tensors used come off the disk
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a pickle with code in it, or any other unreadable content
        raise CheckpointError(f"{path}: refused by torch.load(weights_only=True): {error}") from None


def _check_format(checkpoint: str, manifest: dict) -> None:
    found = manifest.get("format", 1)
    if found != RANK_FORMAT:
        raise CheckpointError(f"{checkpoint}: its rank files are in format {found} and this version reads format "
                              f"{RANK_FORMAT}: load it with the version that wrote it and save it again")


def read_rank_files(directory: str, step: int | None = None) -> tuple[str, dict, list[dict]]:
    """The newest complete checkpoint under ``directory``, its manifest and every rank file's content
    (each verified against the manifest, then memory-mapped)."""
    checkpoint, manifest = read_manifest(directory, step)
    _check_format(checkpoint, manifest)
    return checkpoint, manifest, [_read(_verified(checkpoint, manifest, entry)) for entry in _rank_entries(manifest)]


def load(directory: str, groups: ParallelGroups, optimizer: ZeroOptimizer, names: dict[nn.Parameter, str],
         weights_only: bool = False, step: int | None = None) -> tuple[dict, dict | None]:
    """Restore this rank's state from the newest checkpoint; return (manifest, random states). A
    checkpoint of another layout is re-cut by parameter name (``pretrain.checkpoint.reshard``); its random
    states do not apply (None) unless this rank holds the same parameters as the rank that saved it. ``weights_only`` (fine-tuning, and a checkpoint that holds weights only,
    such as a Hugging Face import) loads the model and leaves the optimizer fresh. ``step``: the
    checkpoint of that iteration instead of the newest (--ckpt-step)."""
    checkpoint, manifest = read_manifest(directory, step)
    rng = None
    if manifest.get("kind") == "weights":
        path = _verified(checkpoint, manifest, WEIGHTS_FILE)
        source = reshard.WeightsFile(path)
        what = f"{checkpoint} (weights)"
        weights_only, scaler = True, None
    else:
        _check_format(checkpoint, manifest)
        if manifest["layout"] == layout_of(groups.topology, optimizer.stage, optimizer.dp.size) and not weights_only:
            path = _verified(checkpoint, manifest, f"rank_{groups.rank:05d}.pt")
            state = _read(path)
            mine = reshard.describe(optimizer, names, groups.tp_rank, groups.topology.tp)
            if _places(mine) == _places(state["pieces"]):  # the same elements in the same masters and places
                with optimizer.states_in_memory():
                    _restore(optimizer, state, path)
                return manifest, state["rng"]
            # the same sizes but other layers here (virtual stages, uneven stages: the random states do not
            # apply), or the same layers cut into other buckets or master pieces (another
            # --zero-bucket-size or --zero-sub-group-size, or a checkpoint of an earlier release): re-cut
            if {piece["name"] for piece in mine} == {piece["name"] for piece in state["pieces"]}:
                rng = state["rng"]
        _, _, states = read_rank_files(directory, step)
        source, what = reshard.CheckpointPieces(states), f"{checkpoint} (layout {manifest['layout']})"
        scaler = saved_loss_scaler(states[0]["optimizer"])
    try:
        with optimizer.states_in_memory():
            reshard.load(source, optimizer, names, groups.tp_rank, groups.topology.tp, weights_only, scaler)
    except reshard.ReshardError as error:
        raise CheckpointError(f"{what}: cannot be re-cut for this run: {error}") from None
    return manifest, rng


def _places(pieces: list[dict]) -> list[tuple]:
    """Where a rank's masters hold which elements of which parameter (what a same-layout load needs)."""
    return [tuple(piece[key] for key in ("name", "master", "state", "start", "offset", "length")) for piece in pieces]


def _restore(optimizer: ZeroOptimizer, state: dict, path: str) -> None:
    try:
        optimizer.load_state_dict(state["optimizer"])
    except KeyError as error:
        raise CheckpointError(f"{path}: its optimizer state has no {error} entry (a rank file of another "
                              "version of this stack?)") from None
    except ValueError as error:
        raise CheckpointError(f"{path}: {error}") from None
