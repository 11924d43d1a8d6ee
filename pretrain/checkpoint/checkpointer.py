"""Save and load a checkpoint over named stateful owners; never half-written.

Each rank writes its file into ``iter_N.tmp`` (fsynced, hashed as it is written, its pieces listed
with their sha256); after every rank has finished, rank 0 writes the manifest, renames the directory
to ``iter_N`` and only then replaces ``latest`` atomically, so a crash at any point leaves the previous
checkpoint as ``latest`` and loadable. A load fills each rank's model state from the pieces that
overlap it, in any layout (``pretrain.checkpoint.reshard``), agreed over the world before any parameter
changes. Where each state goes is ``pretrain.checkpoint.stateful``'s rule.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass

import torch

from data.file_digest import HashingWriter
from parallel import comm
from parallel.process_groups import ParallelGroups, default_device
from pretrain.checkpoint import reshard
from parallel.zero.state_readers import saved_loss_scaler
from pretrain.checkpoint.catalog import (DCP_STORAGE, MODEL, RANK_FORMAT, WEIGHTS_FILE, CheckpointError,
                                         check_format,
                                         exists, fsync_directory, iteration_name, latest_name, newest_intact,
                                         open_rank_file, rank_entries, read_manifest, read_rank_file,
                                         run_states, verified, write_durably)
from pretrain.checkpoint.dcp_storage import DCPPieces, write_dcp
from pretrain.checkpoint.foreign.megatron_checkpoint import READ_OPTIMIZER_STATES
from pretrain.checkpoint.foreign.megatron_pieces import megatron_pieces
from pretrain.checkpoint.saved_pieces import index_of
from pretrain.checkpoint.stateful import RunState, Stateful, ZeroModelState


class SaveError(CheckpointError):
    """A save that failed on some rank, raised alike on every rank (the previous checkpoint stays latest)."""


class LoadError(CheckpointError):
    """A load that failed on some rank (a damaged piece, another model), raised alike on every rank before
    any parameter changed."""


def _split(states: dict[str, Stateful]) -> tuple[ZeroModelState, dict[str, Stateful], dict[str, Stateful]]:
    """(the model state, the run-scoped states, the other rank-scoped states)."""
    model = states.get(MODEL)
    if not isinstance(model, ZeroModelState):
        raise TypeError(f"a checkpoint's states need a ZeroModelState under {MODEL!r}")
    run = {name: state for name, state in states.items() if isinstance(state, RunState)}
    rank = {name: state for name, state in states.items() if name != MODEL and name not in run}
    return model, run, rank


@dataclass(frozen=True)
class Written:
    """One rank file on disk: its entry name, size and sha256 (taken as it was written), its pieces'
    listing and the digest of the rest (``saved_pieces``), or the problem that stopped it."""

    entry: str
    bytes: int = 0
    sha256: str = ""
    problem: str | None = None
    pieces: tuple = ()
    rest: str = ""


def storage_key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return str(storage.device), storage.data_ptr(), storage.nbytes()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def whole_storages(content) -> set[tuple]:
    """The storages that ``content``'s tensors view almost wholly (90% of their bytes or more): written
    whole, once, with their views. Any other tensor is written alone: torch.save writes a view's whole
    storage, and a piece of a master that views the whole flat parameter buffer would otherwise carry
    every replica's elements along."""
    viewed: dict[tuple, int] = {}
    for tensor in _tensors(content):
        key = storage_key(tensor)
        viewed[key] = viewed.get(key, 0) + tensor.numel() * tensor.element_size()
    return {key for key, size in viewed.items() if size >= 0.9 * key[2]}


def map_tensors(value, function):
    """``value`` with each tensor in its nested dicts, lists and tuples replaced by ``function(tensor)``."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, dict):
        return {key: map_tensors(item, function) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(item, function) for item in value)
    return value


def compacted(value, whole: set[tuple]):
    """``value`` with each tensor whose storage is not in ``whole`` replaced by a copy of its elements."""
    return map_tensors(value, lambda tensor: tensor if storage_key(tensor) in whole
                       else tensor.detach().to("cpu", copy=True))


class SaveAttempt:
    """One save of ``iteration`` under ``directory``: its staging directory (made ready by rank 0 and
    agreed over the world when the attempt begins), the world's agreement on each phase, and the
    publishing. ``token`` names the attempt (an asynchronous save's store keys). Owns no state to save."""

    def __init__(self, directory: str, iteration: int, groups: ParallelGroups):
        self.directory, self.iteration, self.groups = directory, iteration, groups
        name = iteration_name(iteration)
        self.final, self.staging = os.path.join(directory, name), os.path.join(directory, name + ".tmp")
        problem = None
        if groups.rank == 0:
            try:
                shutil.rmtree(self.staging, ignore_errors=True)  # a crashed earlier attempt: never trusted
                os.makedirs(self.staging)
            except OSError as error:
                problem = f"{error.strerror or error}: {self.staging}"
        self.token = self.agreed((problem, uuid.uuid4().hex if groups.rank == 0 else None))[0][1]

    def agreed(self, value: tuple) -> list[tuple]:
        """Every rank's ``(problem, ...)``; SaveError alike on every rank if any rank had a problem."""
        values = comm.all_gather_object(value, self.groups.world, default_device())
        failed = [(rank, v[0]) for rank, v in enumerate(values) if v[0]]
        if failed:
            self.fail(*failed[0])
        return values

    def fail(self, rank: int, problem: str) -> None:
        """Raise the SaveError that every rank reports (rank 0 drops the staging directory first)."""
        raise SaveError(self.failure(rank, problem))

    def failure(self, rank: int, problem: str) -> str:
        if self.groups.rank == 0:
            shutil.rmtree(self.staging, ignore_errors=True)
        kept = (f"{os.path.join(self.directory, latest_name(self.directory))} is still the latest "
                "checkpoint, intact" if exists(self.directory) else "no earlier checkpoint exists")
        return (f"saving iteration {self.iteration} failed on rank {rank}: {problem}; {kept}. Free space "
                f"under --save {self.directory} (or choose another) and resume with --load")

    @property
    def entry(self) -> str:
        return f"rank_{self.groups.rank:05d}.pt"

    def write(self, content: dict) -> Written:
        """This rank's file, written durably and hashed as it is written, with its pieces' digests."""
        path = os.path.join(self.staging, self.entry)
        model = content["states"][MODEL]
        rest = {"states": {**content["states"], MODEL: {k: v for k, v in model.items() if k != "pieces"}}}
        pieces, rest_digest = index_of(model, rest)
        try:  # through a Python file: a full disk or a file-size limit is an OSError that says so
            with open(path + ".part", "wb") as handle:
                hashed = HashingWriter(handle)
                torch.save(compacted(content, whole_storages(content)), hashed)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(path + ".part", path)
        except (OSError, RuntimeError) as error:  # torch's zip writer re-raises a failed write so
            cause = error if isinstance(error, OSError) else error.__context__
            if not isinstance(cause, OSError):
                raise
            return Written(self.entry, problem=f"cannot write {path} ({cause.strerror or cause})")
        return Written(self.entry, hashed.size, hashed.hexdigest(), pieces=tuple(pieces), rest=rest_digest)

    def publish(self, written: list[Written], manifest: dict, keep_last: int, retain_interval: int | None,
                protected: str | None = None) -> None:
        """Rank 0, once every rank file is down: the manifest (with the sizes and sha256 taken as the files
        were written), the rename, ``latest``, then pruning (never ``protected``, the checkpoint this run
        resumed from)."""
        manifest["files"] = {w.entry: {"bytes": w.bytes, "sha256": w.sha256, "pieces": list(w.pieces),
                                       "rest": w.rest} for w in written}
        write_durably(os.path.join(self.staging, "manifest.json"),
                      json.dumps(manifest, indent=1, default=str).encode())
        fsync_directory(self.staging)
        shutil.rmtree(self.final, ignore_errors=True)
        os.replace(self.staging, self.final)
        write_durably(os.path.join(self.directory, "latest"), os.path.basename(self.final).encode())
        fsync_directory(self.directory)
        kept = sorted(entry for entry in os.listdir(self.directory)
                      if entry.startswith("iter_") and not entry.endswith(".tmp"))
        dropped = set(kept[:-keep_last]) if keep_last > 0 else set()
        if retain_interval:
            dropped |= {entry for entry in kept[:-1] if int(entry[len("iter_"):]) % retain_interval}
        for old in sorted(dropped - {protected}):
            shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)


def model_state(states: dict[str, Stateful]) -> ZeroModelState:
    """The ZeRO model state among ``states``."""
    return _split(states)[0]


def rank_content(states: dict[str, Stateful]) -> dict:
    """What this rank's file holds: the model state and the other rank-scoped states (call inside the
    model state's ``in_memory()``)."""
    model, _, rank_states = _split(states)
    return {"states": {MODEL: model.state_dict(), **{n: s.state_dict() for n, s in rank_states.items()}}}


def manifest_base(states: dict[str, Stateful], iteration: int, config: dict,
                  storage: str | None = None) -> dict:
    """The manifest of a save, but for its files: format, iteration, the run-scoped states, layout, config
    (and ``storage`` "torch_dcp" where the rank files are a Distributed Checkpoint)."""
    model, run, _ = _split(states)
    return {"format": RANK_FORMAT, "iteration": iteration, **({"storage": storage} if storage else {}),
            "states": {n: s.state_dict() for n, s in run.items()}, "layout": model.layout(), "config": config}


def _write_dcp(attempt: SaveAttempt, content: dict) -> list[Written]:
    """This rank's part of a Distributed Checkpoint in the staging directory (a collective), each file it
    wrote as ``Written`` (a failure: one carrying the problem)."""
    try:
        files = write_dcp(attempt.staging, content, attempt.groups.rank, attempt.groups.world.group)
    except Exception as error:  # DCP raises a write's failure alike on every rank
        return [Written(f"__{attempt.groups.rank}_0.distcp", problem=f"cannot write the Distributed "
                        f"Checkpoint under {attempt.staging} ({str(error).splitlines()[0]})")]
    return [Written(entry, size, sha256) for entry, size, sha256 in files]


def save(directory: str, iteration: int, states: dict[str, Stateful], groups: ParallelGroups, config: dict,
         keep_last: int = 0, retain_interval: int | None = None, protected: str | None = None,
         storage: str | None = None) -> str:
    """Write the checkpoint of ``iteration`` (a collective over the world); return its final path. Each
    state is written by its own ``state_dict()``: run-scoped ones into the manifest, the rest into the
    rank file (``storage`` "torch_dcp": into a Distributed Checkpoint). Then prune: keep the newest
    ``keep_last`` (0: all), and with ``retain_interval`` only the checkpoints at its multiples besides the
    newest, never ``protected``."""
    attempt = SaveAttempt(directory, iteration, groups)
    with model_state(states).in_memory():
        if storage == DCP_STORAGE:
            written = _write_dcp(attempt, rank_content(states))
        else:
            written = [attempt.write(rank_content(states))]
    problems = [entry.problem for entry in written if entry.problem]
    files = [entry for value in attempt.agreed((problems[0] if problems else None, written))
             for entry in value[1]]
    problem = None
    if groups.rank == 0:
        try:
            attempt.publish(files, manifest_base(states, iteration, config, storage), keep_last,
                            retain_interval, protected)
        except OSError as error:
            problem = f"{error.strerror or error}: {error.filename or attempt.staging}"
    attempt.agreed((problem,))
    return attempt.final


def load(directory: str, states: dict[str, Stateful], groups: ParallelGroups, weights_only: bool = False,
         step: int | None = None) -> dict:
    """Restore ``states`` from the newest checkpoint (or iteration ``step``'s: --ckpt-step); return its
    manifest. The model state is filled by parameter name from the pieces that overlap this rank's, in
    any layout (a collective over the world: every rank agrees the pieces it read were intact before any
    parameter changes); run-scoped states load in any layout; the other rank states only where this
    rank holds the parameters of the rank that saved them. ``weights_only`` (fine-tuning, and a
    checkpoint that holds weights only, such as a Hugging Face import) loads the weights alone."""
    model, run, rank_states = _split(states)
    checkpoint, manifest = read_manifest(directory, step)
    # (a Megatron-LM checkpoint's optimizer states are read where READ_OPTIMIZER_STATES names them; of
    # another, validation asked for --no-load-optim)
    weights_only = weights_only or manifest.get("kind") == "weights" or (
        manifest.get("kind") == "megatron" and manifest["megatron"]["optimizer"] not in READ_OPTIMIZER_STATES)
    mine = _fill(model, checkpoint, manifest, weights_only, groups, directory)
    if mine is not None and model.holds_the_same(mine[MODEL]):
        for name, state in rank_states.items():
            if name in mine:
                state.load_state_dict(mine[name])
    saved_run = run_states(manifest)
    for name, state in run.items():
        if name in saved_run:
            state.load_state_dict(saved_run[name])
    return manifest


def _opened(model: ZeroModelState, checkpoint: str, manifest: dict, weights_only: bool,
            rank: int) -> tuple[reshard.PieceSource, dict | None, dict | None]:
    """(the checkpoint's pieces, the loss scale to load, this rank's own saved states where the layout
    is the same) of a weights file, a format-4 checkpoint, or a format 2-3 one (every rank file,
    verified whole, every replica's copy in it)."""
    if manifest.get("kind") == "weights":
        return reshard.WeightsFile(verified(checkpoint, manifest, WEIGHTS_FILE)), None, None
    if manifest.get("kind") == "megatron":
        return megatron_pieces(manifest), None, None
    check_format(checkpoint, manifest)
    same_layout = manifest["layout"] == model.layout() and not weights_only
    entry = f"rank_{rank:05d}.pt"
    if manifest.get("storage") == DCP_STORAGE:
        dcp = DCPPieces(checkpoint, manifest)
        return (dcp, None if weights_only else dcp.rank_states(0)[MODEL]["loss_scaler"],
                dcp.rank_states(rank) if same_layout else None)
    if manifest.get("format") == RANK_FORMAT:
        source = reshard.SavedPieces(checkpoint, manifest, open_rank_file)
        scaler = None if weights_only else source.rest(rank_entries(manifest)[0])[MODEL]["loss_scaler"]
        return source, scaler, source.rest(entry) if same_layout else None
    files = [read_rank_file(checkpoint, manifest, name) for name in rank_entries(manifest)]
    scaler = None if weights_only else saved_loss_scaler(files[0][MODEL]["optimizer"])
    source = reshard.LegacyPieces([states[MODEL] for states in files])
    return source, scaler, files[rank] if same_layout else None


def _fill(model: ZeroModelState, checkpoint: str, manifest: dict, weights_only: bool, groups: ParallelGroups,
          directory: str) -> dict | None:
    """Fill the model state from the checkpoint; return this rank's own saved states (or None). Every
    rank's problems are agreed before the parameters take the values, and raised alike on every rank as
    a LoadError naming the file (and the newest intact checkpoint) or the parameter."""
    with model.in_memory():
        mine, damaged, problems = None, [], []
        try:
            source, scaler, mine = _opened(model, checkpoint, manifest, weights_only, groups.rank)
            model.load(source, weights_only, scaler)
            damaged = problems = list(source.problems)
        except reshard.ReshardError as error:
            problems = [f"{checkpoint} (layout {manifest.get('layout', 'weights')}): cannot be re-cut for "
                        f"this run: {error}"]
        except CheckpointError as error:  # a rank file torch.load refuses, or one of another size
            damaged = problems = [str(error)]
        found = [(problem, bool(theirs[1])) for theirs in
                 comm.all_gather_object((problems, damaged), groups.world, default_device())
                 for problem in theirs[0]]
        if found:
            message, damage = found[0]
            if damage:  # say where an intact checkpoint is
                intact = newest_intact(directory, below=manifest["iteration"])
                message += (f"; the newest intact checkpoint is {intact[0]}: resume from it with --ckpt-step "
                            f"{intact[1]}" if intact else f"; no earlier intact checkpoint under {directory}")
            raise LoadError(message)
        model.masters_to_parameters()
    return mine
