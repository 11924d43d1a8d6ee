"""A Megatron-LM checkpoint's optimizer states (fp32 masters, Adam's moments and step) as ours read them.
The plain optimizer's are torch's own state dict in each legacy rank file (``PlainOptimizerStates``). The
distributed optimizer's, in torch_dist with its ``fully_reshardable`` sharding, are tensors of the model's
keys and shapes (``MODEL_SPACE_STATES``), read beside the weights; in a legacy checkpoint,
``distrib_optim.pt`` beside each rank file (what megatron-core's ``DistributedOptimizer.save_parameter_state``
gathers on dp rank 0: per buffer of each model chunk, the fp32 masters ``param`` and Adam's ``exp_avg`` /
``exp_avg_sq`` as flat tensors), and Adam's step from the rank file's param groups; in torch_dist with its
default ``dp_reshardable`` sharding, the same flat tensors one bucket at a time (``BucketStates``), the
step in ``common.pt``.

Where a tensor lies in those flat tensors is not saved: it is megatron-core's buffer layout
(``_ParamAndGradBuffer``), re-derived here from the chunk's parameters in their saved order and the args.
Parameters go in reverse order, each start aligned to 64 elements; a bucket closes past
``--ddp-bucket-size`` elements (by default the larger of 40M and 1M x dp; one bucket without
``--overlap-grad-reduce``, past the first pipeline stage and in later virtual stages), and a tied
embedding's copy between the first and last stage sits in a bucket of its own. Each bucket's end is
padded to a multiple of lcm(dp, 128) (and 2^16 with ``--ddp-pad-buckets-for-high-nccl-busbw``), a padding
the gathered tensors drop. A buffer whose length differs from the one this layout gives is refused by
name rather than read at the wrong places.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import re

import torch

from pretrain.checkpoint.errors import CheckpointError
from pretrain.checkpoint.foreign.dcp_folder import DCPFolder
from pretrain.checkpoint.foreign.safe_pickle import load_torch_file

DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"
KINDS = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # ours: Megatron's
MODEL_SPACE_STATES = "optimizer.state."  # torch_dist's fully_reshardable: + {kind}.{the tensor's key}
# torch_dist's dp_reshardable: one flat tensor per kind of each bucket of each tp x pp rank's buffer
BUCKET_KEY = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                        r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
_ALIGN, _BUCKET_ALIGN, _BUSBW = 64, 128, 2 ** 16


def buffer_offsets(params: list[tuple[str, int, bool]], dp: int, bucket_size: int | None,
                   busbw: bool = False) -> tuple[dict[str, int], int]:
    """(each parameter's offset in the gathered flat tensors of its buffer, their length). ``params``:
    (key, number of elements, whether it is the tied embedding's copy shared between the first and last
    pipeline stage) in the chunk's parameter order; ``dp`` the size of the group the buffer is sharded
    over."""
    divisor = math.lcm(dp, _BUCKET_ALIGN, _BUSBW if busbw else 1)
    offsets: dict[str, int] = {}
    gathered = start = index = 0  # elements kept of closed buckets; this bucket's first; the next free
    holding = False

    def close(end: int) -> int:
        nonlocal gathered, start, holding
        gathered += end - start
        start, holding = math.ceil(end / divisor) * divisor, False
        return start

    for key, numel, shared in reversed(params):
        index = math.ceil(index / _ALIGN) * _ALIGN
        if shared and holding:
            index = close(index)
        offsets[key] = gathered + index - start
        end, holding = index + numel, True
        if shared or (bucket_size is not None and end - start >= bucket_size):
            index = close(end)
        else:
            index = end
    if holding:
        close(index)
    return offsets, gathered


def bucket_size_of(args, pp_rank: int, vp_stage: int) -> int | None:
    """The bucket size megatron-core's DDP used for this chunk (None: one bucket)."""
    if not getattr(args, "overlap_grad_reduce", False) or pp_rank > 0 or vp_stage > 0:
        return None
    return getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * sharding_size(args))


def sharding_size(args) -> int:
    """The size of the data-parallel group the distributed optimizer shards over."""
    def size(name: str) -> int:
        return int(getattr(args, name, 1) or 1)

    instances = size("num_distributed_optimizer_instances")
    return size("data_parallel_size") * size("context_parallel_size") // instances


def param_groups(state: dict) -> list[dict]:
    """The param groups of the distributed optimizer's ``state_dict`` in a rank file or ``common.pt``."""
    return (state.get("optimizer") or {}).get("optimizer", {}).get("param_groups", [])


def adam_step(groups: list[dict], where: str) -> float:
    """Adam's step count, as the distributed optimizer's ``state_dict`` keeps it in each param group."""
    steps = {float(group["step"]) for group in groups if "step" in group}
    if len(steps) != 1:
        raise CheckpointError(f"{where}: its optimizer's param groups record {sorted(steps) or 'no'} Adam "
                              "steps; one was expected (a distributed optimizer's state_dict)")
    return steps.pop()


class DistributedOptimizerStates:
    """One rank file's ``distrib_optim.pt``: the flat states of each chunk's buffer, and where each saved
    tensor of the chunk lies in them. Holds the memory-mapped file; reads a tensor's range on request."""

    def __init__(self, folder: str, chunks: dict[str, list[tuple[str, int, bool]]], args, pp_rank: int):
        self.path = os.path.join(folder, DISTRIBUTED_OPTIMIZER_FILE)
        state = load_torch_file(self.path, "the distributed optimizer's states")
        if not isinstance(state, dict) or not state.get("buckets_coalesced"):
            raise CheckpointError(f"{self.path}: not the gathered (buckets_coalesced) states of "
                                  "megatron-core's save_parameter_state; refused")
        self.buffers: list[dict[str, torch.Tensor]] = []
        self.places: dict[tuple[str, str], tuple[int, int]] = {}
        for vp, (chunk, params) in enumerate(chunks.items()):
            buffers = state.get(vp)
            if not isinstance(buffers, dict) or len(buffers) != 1:
                raise CheckpointError(f"{self.path}: holds {len(buffers or {})} buffers for model chunk "
                                      f"{vp}; one (a single parameter dtype, no experts) is what this reader "
                                      "takes")
            flat = next(iter(buffers.values()))
            busbw = bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False))
            offsets, length = buffer_offsets(params, sharding_size(args), bucket_size_of(args, pp_rank, vp),
                                             busbw)
            if int(flat.get("numel_unpadded", -1)) != length or any(
                    flat.get(name) is None or flat[name].numel() != length for name in KINDS.values()):
                raise CheckpointError(f"{self.path}: chunk {vp}'s buffer holds {flat.get('numel_unpadded')} "
                                      f"elements; the model its args describe lays out {length} (bucketing "
                                      "flags this reader does not re-derive?); refused")
            self.buffers.append(flat)
            self.places.update({(chunk, key): (vp, offset) for key, offset in offsets.items()})

    def values(self, chunk: str, key: str, numel: int, kind: str) -> torch.Tensor:
        """The flat ``kind`` ("master", "exp_avg", "exp_avg_sq") of saved tensor ``key`` of ``chunk``."""
        vp, offset = self.places[(chunk, key)]
        return self.buffers[vp][KINDS[kind]][offset:offset + numel]


class BucketStates:
    """torch_dist's ``dp_reshardable`` states: per tensor- x pipeline-parallel rank (megatron-core's model
    parallel rank, ``pp_rank x tp + tp_rank``, numbers its keys), each bucket of its buffer as a flat
    tensor per kind, the bucket's end padding left out, so that the buckets in turn are the gathered
    tensors ``distrib_optim.pt`` holds; Adam's ``step`` in each rank's saved param groups. ``domains``:
    each (pp rank, tp rank)'s parameters as ``buffer_offsets`` takes them. Reads a tensor's range from
    its bucket on request; keeps none."""

    def __init__(self, folder: DCPFolder, domains: dict[tuple[int, int], list[tuple[str, int, bool]]], args,
                 tp: int):
        self.folder = folder
        buckets: dict[int, dict[tuple, tuple[str, int]]] = {}  # rank -> (buffer, dtype, bucket) -> key, size
        for key in folder.tensors:
            match = BUCKET_KEY.match(key)
            if match and match.group(5) == "param":
                group, buffer, dtype, bucket = match.group(1, 2, 3, 4)
                buckets.setdefault(int(group), {})[(int(buffer), dtype, int(bucket))] = (
                    key[:match.start(5)], folder.shape(key)[0])
        self.places: dict[tuple[int, int, str], tuple[str, int]] = {}
        groups = []  # each rank's optimizer state_dict (its param groups), a saved object
        for key in folder.metadata.state_dict_metadata:
            if re.match(r"^optimizer\.distributed\.dp_group_idx_\d+\.optimizer/", key):
                saved = folder.read_object(key)
                groups += [group for entry in (saved if isinstance(saved, list) else [saved])
                           for group in entry.get("param_groups", [])]
        self.step = adam_step(groups, folder.folder)
        busbw = bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False))
        for (pp, tp_rank), params in domains.items():
            held = buckets.get(pp * tp + tp_rank, {})
            if len({(buffer, dtype) for buffer, dtype, _ in held}) != 1:
                raise CheckpointError(f"{folder.folder}: holds {len(held)} dp_reshardable buckets for "
                                      f"pipeline rank {pp}, tensor rank {tp_rank}, in other than the one "
                                      "buffer (one parameter dtype, no experts) this reader takes; refused")
            names, sizes = zip(*(held[entry] for entry in sorted(held)))
            offsets, length = buffer_offsets(params, sharding_size(args), bucket_size_of(args, pp, 0), busbw)
            if sum(sizes) != length:
                raise CheckpointError(f"{folder.folder}: pipeline rank {pp}, tensor rank {tp_rank}'s "
                                      f"dp_reshardable buckets hold {sum(sizes)} elements; the model its "
                                      f"args describe lays out {length} (bucketing flags this reader does "
                                      "not re-derive?); refused")
            starts = [0, *itertools.accumulate(sizes)][:-1]
            for key, offset in offsets.items():
                bucket = bisect.bisect_right(starts, offset) - 1
                self.places[(pp, tp_rank, key)] = (names[bucket], offset - starts[bucket])

    def values(self, where: tuple[int, int, str], numel: int, kind: str) -> torch.Tensor:
        """The flat ``kind`` of tensor ``where`` (pp rank, tp rank, Megatron's key in that stage)."""
        name, offset = self.places[where]
        return self.folder.read(f"{name}{KINDS[kind]}", offset, numel)


class PlainOptimizerStates:
    """The plain (not distributed) optimizer's Adam states in one legacy rank file's ``optimizer``: torch's
    own state dict, its states numbered through its param groups, each group's parameters in the model's
    order. Megatron groups a model's parameters by weight decay (none on biases and 1-D ones): each saved
    group is matched to its parameters by its ``wd_mult``, and every state's shape is checked against the
    tensor it is taken for. fp32 parameters only (their masters are the weights)."""

    def __init__(self, path: str, state: dict, chunks: dict[str, list[tuple[str, tuple[int, ...]]]]):
        saved = state.get("optimizer") or {}
        if "fp32_from_fp16_params" in saved:
            raise CheckpointError(f"{path}: the plain optimizer of a bf16 / fp16 run (its fp32 masters "
                                  "beside the weights): not read yet")
        groups, states = saved.get("param_groups", []), saved.get("state", {})
        params = [(chunk, key, shape) for chunk, entries in chunks.items() for key, shape in entries]
        decays = [float(group.get("wd_mult", 1.0)) != 0.0 for group in groups]
        self.places: dict[tuple[str, str], dict] = {}
        for group, decay in zip(groups, decays):
            members = [entry for entry in params if decayed(entry[1], entry[2]) == decay]
            if decays.count(decay) > 1 or len(members) != len(group.get("params", [])):
                raise CheckpointError(f"{path}: its optimizer's param groups are not the two of weight "
                                      "decay on and off this reader takes (another grouping flag); refused")
            for index, (chunk, key, shape) in zip(group["params"], members):
                held = states.get(index, {})
                if any(tuple(held[kind].shape) != shape for kind in ("exp_avg", "exp_avg_sq")
                       if kind in held):
                    raise CheckpointError(f"{path}: optimizer state {index} is not of {key}'s shape "
                                          f"{list(shape)}; refused")
                self.places[(chunk, key)] = held
        if len(self.places) != len(params):
            raise CheckpointError(f"{path}: its optimizer's param groups hold {len(self.places)} of the "
                                  f"{len(params)} parameters; refused")

    def values(self, chunk: str, key: str, numel: int, kind: str) -> torch.Tensor | None:
        """The flat ``kind`` ("exp_avg", "exp_avg_sq") of saved tensor ``key`` of ``chunk``, None where
        Adam never made it, and for "master" (the weight is the master)."""
        held = self.places[(chunk, key)].get(KINDS[kind]) if kind != "master" else None
        return None if held is None else held.reshape(-1)

    def step(self) -> float:
        steps = {float(held["step"]) for held in self.places.values() if "step" in held}
        return steps.pop() if len(steps) == 1 else 0.0


def gathered_states(params: list[tuple[str, dict[str, torch.Tensor], bool]], args, pp_rank: int) -> dict:
    """``distrib_optim.pt`` of one rank's model chunk, as ``save_parameter_state`` gathers it (the
    inverse of ``DistributedOptimizerStates``): ``params`` in megatron-core's parameter order, each (key,
    its flat states by our kind, whether it is a tied embedding's copy between the first and last stage),
    laid out for the buckets ``args`` name."""
    busbw = bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False))
    sizes = [(key, states["master"].numel(), shared) for key, states, shared in params]
    offsets, length = buffer_offsets(sizes, sharding_size(args), bucket_size_of(args, pp_rank, 0), busbw)
    flat: dict = {theirs: torch.zeros(length, dtype=torch.float32) for theirs in KINDS.values()}
    for key, states, _ in params:
        for kind, tensor in states.items():
            flat[KINDS[kind]][offsets[key]:offsets[key] + tensor.numel()] = tensor.reshape(-1)
    flat["numel_unpadded"] = length
    return {"buckets_coalesced": True, 0: {(torch.float32, torch.float32): flat}}


def distributed_state_dict(settings: dict, step: float) -> dict:
    """The distributed optimizer's ``state_dict`` beside its parameter states: Megatron's two param
    groups (weight decay on, and off for biases and 1-D parameters) with Adam's hyper-parameters from
    our run's ``settings`` and its ``step``."""
    def group(decay: bool) -> dict:
        return {"is_expert_parallel": False, "default_config": True, "wd_mult": 1.0 if decay else 0.0,
                "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": settings["lr"],
                "min_lr": settings.get("min_lr", 0.0), "lr": settings["lr"],
                "betas": (settings["adam_beta1"], settings["adam_beta2"]), "eps": settings["adam_eps"],
                "weight_decay": settings["weight_decay"] if decay else 0.0, "amsgrad": False,
                "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                "fused": None, "decoupled_weight_decay": True, "step": step}

    return {"optimizer": {"param_groups": [group(True), group(False)]}}


def decayed(key: str, shape: tuple[int, ...]) -> bool:
    """Megatron's default weight-decay rule: none on biases and 1-D parameters."""
    return not (key.endswith(".bias") or len(shape) == 1)
