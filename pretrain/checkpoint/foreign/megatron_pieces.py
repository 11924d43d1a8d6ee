"""A Megatron-LM checkpoint's weights as the pieces our re-cut fills any layout from
(``reshard.PieceSource``).

Legacy files hold each tensor-parallel rank's slice under its pipeline stage's own layer numbers: each
becomes one piece with our slice geometry at the checkpoint's tp (a replicated tensor is taken from tp
rank 0), its layers renumbered by the stage's offset. torch_dist holds global tensors, layers stacked on
a first axis: each layer's row is one whole piece, read from the Distributed Checkpoint when a rank
needs it. A tensor whose shape is not the one the args' model has, or a key with no place in it, is
refused by name; files are memory-mapped and one tensor is kept at a time.
"""

from __future__ import annotations

import itertools
import math
import os

import torch

from models.config import GPTConfig
from models.counting import stage_model
from parallel.param_meta import meta
from pretrain.checkpoint.errors import CheckpointError
from pretrain.checkpoint.foreign.dcp_folder import DCPFolder
from pretrain.checkpoint.foreign.megatron_parts import PARTS, joined_key, to_ours
from pretrain.checkpoint.foreign.megatron_checkpoint import (READ_OPTIMIZER_STATES, MegatronCheckpoint,
                                                             legacy_file, reopen)
from pretrain.checkpoint.foreign.megatron_optimizer import (KINDS, MODEL_SPACE_STATES, BucketStates,
                                                            DistributedOptimizerStates, PlainOptimizerStates,
                                                            adam_step, param_groups)
from pretrain.checkpoint.foreign.megatron_names import (LAYER_KEY, LEGACY_EXPERTS, ROW_SPLIT_DOWN,
                                                        STACKED_PREFIX, UnknownKey, ours_of, ours_of_stacked,
                                                        registration_order, skipped)
from pretrain.checkpoint.foreign.safe_pickle import load_torch_file
from pretrain.checkpoint.geometry import SliceGeometry
from pretrain.checkpoint.reshard import PieceSource, SavedPiece


def our_slices(config: GPTConfig, tp: int) -> dict[str, tuple[tuple[int, ...], int | None, bool]]:
    """Each of our parameters at tensor-parallel size ``tp`` (the experts' too: Megatron's expert tp is
    its tp unless told otherwise): (one rank's shape, its split dimension, whether it is a vocabulary
    table)."""
    model = stage_model(config, tp, experts=(1, tp))[0]
    return {name: (tuple(param.shape), meta(param).partition_dim, meta(param).unpadded_rows is not None)
            for param, name in model.global_parameter_names().items()}


def masters_are_weights(masters: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether saved fp32 masters are the weights beside them within bf16's rounding (a layout read at the
    right places)."""
    return torch.allclose(masters.float(), weights.float(), rtol=2 ** -7, atol=1e-6)


class MegatronPieces(PieceSource):
    """The weights of ``checkpoint`` (its model config ``config``) by our names, and the distributed
    optimizer's states where a legacy checkpoint holds them (``kinds``: Adam's moments). Holds the open
    files and the last tensor read."""

    def __init__(self, checkpoint: MegatronCheckpoint, config: GPTConfig):
        super().__init__()
        self.checkpoint, self.config = checkpoint, config
        self.tied = not config.untie_embeddings_and_output_weights
        self._last: tuple[tuple, torch.Tensor] | None = None
        self._row: tuple[tuple, torch.Tensor] | None = None
        self.unread_optimizer: str | None = None  # why its optimizer's states cannot be read, if so
        self.held = checkpoint.optimizer_states()  # (looked up once: a file test or the DCP metadata)
        self.reads_optimizer = self.held in READ_OPTIMIZER_STATES
        if (config.hybrid_layer_pattern or config.mtp_depths) and self.reads_optimizer:  # (its weights load)
            what = ("a HybridModel's optimizer states (its mixers' buffers)" if config.hybrid_layer_pattern
                    else "the optimizer states of a model with multi-token prediction depths")
            self.unread_optimizer = f"{checkpoint.folder}: {what} are not read yet"
            self.reads_optimizer = False
        # a legacy rank file's optimizer states: its distrib_optim.pt, or the plain optimizer's in it
        self.optimizers: dict[str, DistributedOptimizerStates | PlainOptimizerStates] = {}
        self.buckets: BucketStates | None = None  # torch_dist's dp_reshardable states, where read
        self.local_spec = getattr(checkpoint.args, "transformer_impl", "transformer_engine") == "local"
        if checkpoint.format == "torch_dist":
            self.folder = DCPFolder(checkpoint.folder)
            self._list_distributed(our_slices(config, 1))
        else:
            self.files: dict[str, dict] = {}
            if checkpoint.layout.etp != checkpoint.layout.tp:
                raise CheckpointError(f"{checkpoint.folder}: saved with --expert-tensor-parallel-size "
                                      f"{checkpoint.layout.etp} beside --tensor-model-parallel-size "
                                      f"{checkpoint.layout.tp}: legacy files of another expert tp are not "
                                      "read yet (torch_dist ones are)")
            self._list_legacy(our_slices(config, checkpoint.layout.tp))
        missing = sorted(set(our_slices(config, 1)) - set(self.by_name))
        if missing:
            raise CheckpointError(f"{checkpoint.folder}: holds no {', '.join(missing[:3])}"
                                  + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                                  + " (a shard missing, or another model than its args describe)")

    # listing ------------------------------------------------------------------------------------------
    def _place(self, key: str, offset: int = 0, stacked: bool = False, expert_offset: int = 0) -> str | None:
        """Our name of ``key``, None for what is no parameter here (the last stage's copy of tied
        embeddings)."""
        latent = self.config.multi_latent_attention
        try:
            name = ours_of_stacked(key, latent) if stacked else ours_of(key, offset, expert_offset, latent)
        except UnknownKey:
            raise CheckpointError(f"{self.checkpoint.folder}: {key} has no place in the model its args "
                                  "describe (an architecture this reader does not take); refused") from None
        return None if name == "output_layer.weight" and self.tied else name

    def _check_shape(self, key: str, name: str, saved: tuple, wanted: tuple, table: bool) -> None:
        same = saved[1:] == wanted[1:] if table else math.prod(saved) == math.prod(wanted)
        if not same:
            raise CheckpointError(f"{self.checkpoint.folder}: {key} has shape {list(saved)}; the model its "
                                  f"args describe needs {list(wanted)} for {name}; refused")

    def _list_legacy(self, slices: dict) -> None:
        layout = self.checkpoint.layout
        local_experts = (self.config.num_experts or 0) // layout.ep
        for pp, tp, ep in itertools.product(range(layout.pp), range(layout.tp), range(layout.ep)):
            path = legacy_file(self.checkpoint.folder, layout, tp, pp, ep)
            state = load_torch_file(path, "a legacy rank file")
            self._list_legacy_file(path, state, slices, pp, tp, ep * local_experts, ep > 0)
        if self.unread_optimizer:  # the weights still load (fine-tuning, --no-load-optim)
            self.optimizers, self.kinds = {}, ()

    def _list_legacy_file(self, path: str, state: dict, slices: dict, pp: int, tp: int, expert_offset: int,
                          experts_only: bool) -> None:
        """The pieces of one legacy rank file: of an expert-parallel rank past the first, its experts
        alone (the rest is the first's replica)."""
        layout = self.checkpoint.layout
        chunks = ["model"] if layout.vp == 1 else [f"model{v}" for v in range(layout.vp)]
        for vp, chunk in enumerate(chunks):
            if chunk not in state:
                raise CheckpointError(f"{path}: holds no {chunk!r} (saved with another "
                                      "--virtual-pipeline-model-parallel-size than its args say?)")
            for key, tensor in state[chunk].items():
                if skipped(key) or not isinstance(tensor, torch.Tensor) or (
                        experts_only and LEGACY_EXPERTS not in key):
                    continue
                if key.startswith("embedding.") and (pp, vp) != (0, 0):
                    continue  # the prediction depths' stage's copy of the first stage's embedding
                name = self._place(key, layout.layer_offset(pp, vp), expert_offset=expert_offset)
                if name is None or name not in slices:
                    if name is not None:
                        raise CheckpointError(f"{path}: {key} ({name}) has no place in the model "
                                              "its args describe; refused")
                    continue
                shape, dim, table = slices[name]
                shape, dim = self._split_of(key, shape, dim)
                if dim is None and tp > 0:
                    continue  # replicated over tp: rank 0's copy
                self._check_shape(key, name, tuple(tensor.shape), shape, table)
                local = tuple(tensor.shape) if table else shape
                geometry = SliceGeometry.of(local, dim, tp, layout.tp,
                                            self.config.vocab_size if table else None)
                self.files.setdefault(path, state)
                self.by_name[name].append(SavedPiece(name, geometry, 0, tensor.numel(),
                                                     (path, chunk, key)))
        if self.reads_optimizer:
            self._list_optimizer(path, state, chunks, pp)

    def _split_of(self, key: str, shape: tuple, dim: int | None) -> tuple[tuple, int | None]:
        """(one tp rank's shape, split dimension) of Megatron's ``key`` where ours is (``shape``,
        ``dim``): the local spec's latent down projections are split by rows (Transformer Engine's
        whole)."""
        if key.endswith(ROW_SPLIT_DOWN) and self.local_spec:
            return (shape[0] // self.checkpoint.layout.tp, *shape[1:]), 0
        return shape, dim

    def _list_optimizer(self, path: str, state: dict, chunks: list[str], pp: int) -> None:
        """The distributed optimizer's states beside rank file ``path``: every saved tensor of each chunk
        (the tied embedding's copies between the first and last stage each in a bucket of their own).
        States it cannot read are recorded in ``unread_optimizer``, for a whole resume to refuse."""
        if self.unread_optimizer:
            return
        shared = ("embedding.word_embeddings.weight", "output_layer.weight") if (
            self.tied and self.checkpoint.layout.pp > 1) else ()
        tensors = {chunk: [(key, tensor) for key, tensor in state[chunk].items()
                           if isinstance(tensor, torch.Tensor) and not skipped(key)] for chunk in chunks}
        try:
            if self.held == "plain":
                shapes = {chunk: [(key, tuple(tensor.shape)) for key, tensor in entries]
                          for chunk, entries in tensors.items()}
                states = PlainOptimizerStates(path, state, shapes)
                step = states.step()
            else:
                states = DistributedOptimizerStates(os.path.dirname(path), {
                    chunk: [(key, tensor.numel(), key in shared) for key, tensor in entries]
                    for chunk, entries in tensors.items()}, self.checkpoint.args, pp)
                step = adam_step(param_groups(state), path)
            self.optimizers[path] = states
            if not self.kinds:
                self.kinds, self.step = ("exp_avg", "exp_avg_sq"), step
        except CheckpointError as error:
            self.unread_optimizer = str(error)

    def _list_distributed(self, slices: dict) -> None:
        """Each torch_dist tensor's pieces: one per layer of a key stacked over the layers (and per expert
        of one whose next axis runs over the experts); a key of one layer (a model whose layers are not
        all alike, as Megatron saves a mixture of experts with --moe-layer-freq) has its own number."""
        for key in self._distributed_keys():
            stacked = key.startswith(STACKED_PREFIX) and not LAYER_KEY.match(key)
            template = self._place(key, stacked=stacked)
            if template is None:
                continue
            saved, axes = self._distributed_shape(key), template.count("{}")
            one = saved[axes:]
            for index in itertools.product(*(range(size) for size in saved[:axes])):
                ours = template.format(*index)
                if ours not in slices:
                    raise CheckpointError(f"{self.checkpoint.folder}: {key} holds {ours}, which the model "
                                          "its args describe has not; refused")
                shape, _, table = slices[ours]
                self._check_shape(key, ours, one, shape, table)
                geometry = (SliceGeometry.of(one, 0, 0, 1, self.config.vocab_size) if table
                            else SliceGeometry(shape))
                self.by_name[ours].append(SavedPiece(ours, geometry, 0, math.prod(one), (key, index)))
            if self.reads_optimizer and self.checkpoint.sharding == "fully_reshardable":
                self._check_model_space_states(key, saved)
        if self.reads_optimizer and self.checkpoint.sharding == "dp_reshardable":
            self._list_buckets()
        if self.reads_optimizer and not self.unread_optimizer:
            self.kinds = ("exp_avg", "exp_avg_sq")
            self.step = self.buckets.step if self.buckets else adam_step(param_groups(self.checkpoint.common),
                                                                          self.checkpoint.folder)

    def _distributed_keys(self) -> list[str]:
        """The torch_dist keys of the model's tensors, a mixer's part-major parts (``megatron_parts.PARTS``)
        as one key of the whole tensor."""
        keys = []
        for key in self.folder.tensors:
            if skipped(key) or not key.startswith(("embedding.", "decoder.", "mtp.", "output_layer.")):
                continue  # the optimizer's states, rng and other run states
            joined = joined_key(key)
            if joined is None:
                keys.append(key)
            elif joined[1] == PARTS[LAYER_KEY.match(joined[0]).group(2)][0]:
                keys.append(joined[0])
        return keys

    def _parts(self, key: str) -> list[str]:
        """The torch_dist keys holding ``key``'s tensor: itself, or a mixer tensor's parts."""
        match = LAYER_KEY.match(key)
        if key in self.folder.tensors or not match or match.group(2) not in PARTS:
            return [key]
        parts = [f"{key}.{part}" for part in PARTS[match.group(2)]]
        for part in parts:
            if part not in self.folder.tensors:
                raise CheckpointError(f"{self.checkpoint.folder}: holds no {part} beside the other parts of "
                                      f"{key}; refused")
        return parts

    def _distributed_shape(self, key: str) -> tuple[int, ...]:
        shapes = [self.folder.shape(part) for part in self._parts(key)]
        return (sum(shape[0] for shape in shapes), *shapes[0][1:])

    def _read_distributed(self, key: str) -> torch.Tensor:
        """The whole torch_dist tensor ``key`` (a mixer's parts joined) in our row order."""
        tensor = torch.cat([self.folder.read(part) for part in self._parts(key)])
        match = LAYER_KEY.match(key)
        return to_ours(match.group(2), tensor, self.config, 1) if match else tensor

    def _check_model_space_states(self, key: str, saved: tuple) -> None:
        """The distributed optimizer's model-space states of torch_dist tensor ``key`` (its
        ``fully_reshardable`` sharding: ``optimizer.state.<kind>.<key>``, the tensor's own shape); a
        missing one is recorded in ``unread_optimizer``, and so are fp32 masters of a layer's 1-D tensors
        (norms, biases: few elements) that are not its weights within bf16's rounding: megatron-core
        0.16.1 misplaces these states when --overlap-grad-reduce cut buckets."""
        for kind in KINDS.values():
            state = f"{MODEL_SPACE_STATES}{kind}.{key}"
            if not self.unread_optimizer and (state not in self.folder.tensors
                                              or self.folder.shape(state) != saved):
                self.unread_optimizer = (f"{self.checkpoint.folder}: holds no {state} of the shape of {key} "
                                         "(optimizer states of another sharding?)")
        if self.unread_optimizer or len(saved) != 2 or not key.startswith(STACKED_PREFIX):
            return
        weights = self.folder.read(key)
        if not masters_are_weights(self.folder.read(f"{MODEL_SPACE_STATES}{KINDS['master']}.{key}"), weights):
            self.unread_optimizer = (f"{self.checkpoint.folder}: its fully_reshardable fp32 masters of {key} "
                                     "are not its weights (megatron-core misplaces these states when "
                                     "--overlap-grad-reduce cut buckets); its optimizer states are refused")

    def _list_buckets(self) -> None:
        """torch_dist's ``dp_reshardable`` states: each tensor re-listed as the tp slices the (pp, tp) ranks'
        buffers hold (``BucketStates``; the weights their fp32 masters), laid out in megatron-core's
        parameter order. The layout is checked where it shows: each rank's 1-D masters (norms, biases,
        spread over the whole buffer) must be its weights within bf16's rounding. What cannot be read is
        recorded in ``unread_optimizer`` (the whole pieces stay, for a fresh optimizer)."""
        folder, layout = self.checkpoint.folder, self.checkpoint.layout
        if layout.vp > 1 or self.config.num_experts:
            what = "virtual pipeline stages" if layout.vp > 1 else "a mixture of experts"
            self.unread_optimizer = (f"{folder}: dp_reshardable states of {what} (a chained optimizer's) "
                                     "are not read yet")
            return
        slices, tp = our_slices(self.config, layout.tp), layout.tp
        domains: dict[tuple[int, int], list[tuple[str, int, bool]]] = {}
        pieces: dict[str, list[SavedPiece]] = {}
        for name, listed in self.by_name.items():
            for piece in listed:
                key, index = piece.where
                pp, local_key = self._stage_of(key, index)
                shape, dim, table = slices[name]
                shape, dim = self._split_of(key, shape, dim)
                if table:  # Megatron's padded rows, split evenly
                    shape = (piece.geometry.shape[0] // tp, *piece.geometry.shape[1:])
                shared = self.tied and layout.pp > 1 and name == "embedding.word_embeddings.weight"
                for rank in range(tp):
                    domains.setdefault((pp, rank), []).append((local_key, math.prod(shape), shared))
                    if shared:  # the last stage's copy, in a bucket of its own
                        domains.setdefault((layout.pp - 1, rank), []).append(
                            ("output_layer.weight", math.prod(shape), True))
                    if dim is not None or rank == 0:
                        rows = self.config.vocab_size if table else None
                        pieces.setdefault(name, []).append(SavedPiece(
                            name, SliceGeometry.of(shape, dim, rank, tp, rows), 0, math.prod(shape),
                            (pp, rank, local_key)))
        for (pp, rank), params in domains.items():
            params.sort(key=lambda entry: registration_order(entry[0], self.local_spec))
        try:
            buckets = BucketStates(self.folder, domains, self.checkpoint.args, tp)
        except CheckpointError as error:
            self.unread_optimizer = str(error)
            return
        for name, listed in pieces.items():
            whole = self.by_name[name][0]
            for piece in (piece for piece in listed if len(piece.geometry.shape) == 1):
                masters = buckets.values(piece.where, piece.length, "master")
                if not masters_are_weights(masters, self._band(whole, piece.geometry)):
                    self.unread_optimizer = (f"{folder}: its dp_reshardable fp32 masters of "
                                             f"{whole.where[0]} are not its weights (a parameter order or "
                                             "bucketing this reader does not re-derive); its optimizer "
                                             "states are refused")
                    return
        self.buckets, self.by_name = buckets, pieces

    def _stage_of(self, key: str, index: tuple) -> tuple[int, str]:
        """(pipeline rank, Megatron's key in that stage) of row ``index`` of torch_dist tensor ``key``."""
        layout = self.checkpoint.layout
        per_stage = layout.num_layers // layout.pp
        match = LAYER_KEY.match(key)
        if match or (key.startswith(STACKED_PREFIX) and index):
            layer, inner = (int(match.group(1)), match.group(2)) if match else (
                index[0], key[len(STACKED_PREFIX):])
            return layer // per_stage, f"{STACKED_PREFIX}{layer % per_stage}.{inner}"
        return (0 if key.startswith("embedding.") else layout.pp - 1), key

    def _band(self, piece: SavedPiece, geometry: SliceGeometry) -> torch.Tensor:
        """The elements of whole torch_dist ``piece`` that tp slice ``geometry`` holds, flat."""
        key, index = piece.where
        whole = self._first_axis(key, index[0])[index[1:]] if index else self.folder.read(key)
        width, first = geometry.width, geometry.tp_rank * geometry.width
        return whole.float().reshape(geometry.outer, -1)[:, first:first + width].reshape(-1)

    # reading ------------------------------------------------------------------------------------------
    def values(self, piece: SavedPiece, kind: str) -> torch.Tensor | None:
        if self.buckets is not None:
            return self.buckets.values(piece.where, piece.length, kind).float()
        if self.kinds and piece.where[0] in self.optimizers:
            path, chunk, key = piece.where
            found = self.optimizers[path].values(chunk, key, piece.length, kind)
            if found is not None or kind != "master":  # (the plain optimizer's master is the weight)
                return None if found is None else found.float()
        if kind != "master" and not self.kinds:
            return None
        if self._last is None or self._last[0] != (piece.where, kind):
            if self.checkpoint.format == "torch_dist":  # (fp32 masters where its states passed the check)
                key, index = piece.where
                key = f"{MODEL_SPACE_STATES}{KINDS[kind]}.{key}" if self.kinds else key
                tensor = self._first_axis(key, index[0])[index[1:]] if index else self._read_distributed(key)
            else:
                path, chunk, key = piece.where
                tensor = self.files[path][chunk][key]
                match = LAYER_KEY.match(key)
                if match:  # (a rank's mixer in_proj / conv rows are part-major over its own groups)
                    tensor = to_ours(match.group(2), tensor, self.config, self.checkpoint.layout.tp)
            self._last = ((piece.where, kind), tensor.float().reshape(-1))
        return self._last[1]

    def _first_axis(self, key: str, first: int) -> torch.Tensor:
        """Row ``first`` of a stacked torch_dist tensor (one layer: all its experts), kept for the next
        piece of it."""
        if self._row is None or self._row[0] != (key, first):
            self._row = ((key, first), self.folder.read(key, first, 1)[0])
        return self._row[1]

    def scalars(self, name: str) -> dict:
        return {"step": torch.tensor(self.step)} if self.kinds else {}


def megatron_pieces(manifest: dict) -> MegatronPieces:
    """The pieces of the Megatron-LM checkpoint a manifest of kind "megatron" describes."""
    fields = GPTConfig.__dataclass_fields__
    config = GPTConfig(**{key: value for key, value in manifest["config"].items() if key in fields})
    return MegatronPieces(reopen(manifest), config)
