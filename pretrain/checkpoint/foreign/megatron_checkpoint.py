"""A Megatron-LM checkpoint directory, recognised by its own markers and described as one of ours.

    DIR/latest_checkpointed_iteration.txt       the newest iteration (or "release")
    DIR/iter_0000100/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   legacy (--ckpt-format torch): one file
                                                per tp x pp (x ep) rank: args, iteration, the model chunk
                                                ("model", or "model0", "model1".. per virtual stage),
                                                optimizer, scheduler, rng; distrib_optim.pt beside it
    DIR/iter_0000100/metadata.json, common.pt,  torch_dist (megatron-core's default): a Distributed
        .metadata, __R_N.distcp                 Checkpoint of global tensors, layers stacked on a first
                                                axis, and common.pt with the args and the rest

``open_megatron`` reads the tracker and the args (never a weight) and gives a ``manifest`` as our
checkpoints have one (``"kind": "megatron"``): the model config, the run's position and schedule, the
layout it was saved at, which states it holds. Every pickle is read by ``safe_pickle``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from pretrain.checkpoint.errors import CheckpointError
from pretrain.checkpoint.foreign.megatron_args import (MegatronLayout, config_of, layout_of, position_of,
                                                       scheduler_of)
from pretrain.checkpoint.foreign.megatron_optimizer import DISTRIBUTED_OPTIMIZER_FILE
from pretrain.checkpoint.foreign.megatron_tokenizer import tokenizer_in
from pretrain.checkpoint.foreign.safe_pickle import load_torch_file

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
# run settings of the args a resumed run keeps (our names are Megatron's)
READ_OPTIMIZER_STATES = ("distributed", "plain")  # the optimizer states a whole resume reads
# a distributed optimizer's legacy rank files without the distrib_optim.pt beside them
MISSING_DISTRIBUTED = "distributed, its distrib_optim.pt missing"
READ_SHARDINGS = ("fully_reshardable", "dp_reshardable")  # torch_dist's distributed ones read here
RUN_ARGS = ("global_batch_size", "micro_batch_size", "rampup_batch_size", "seq_length")


def is_megatron(directory: str) -> bool:
    """Whether ``directory`` is a Megatron-LM checkpoint directory (its tracker file)."""
    return os.path.isfile(os.path.join(directory, TRACKER))


def is_megatron_iteration(folder: str) -> bool:
    """Whether ``folder`` is one iteration of a Megatron-LM checkpoint directory."""
    return os.path.isdir(folder) and (os.path.isfile(os.path.join(folder, "metadata.json")) or any(
        name.startswith("mp_rank_") for name in os.listdir(folder)))


def iteration_folder(iteration: int | None) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


def legacy_file(folder: str, layout: MegatronLayout, tp: int, pp: int, ep: int) -> str:
    """The legacy file of rank (tp, pp, ep), named as Megatron-LM's ``get_checkpoint_name`` names it."""
    name = (f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if layout.pp > 1 else "")
            + (f"_{ep:03d}" if layout.ep > 1 else ""))
    return os.path.join(folder, name, MODEL_FILE)


@dataclass
class MegatronCheckpoint:
    """One iteration of a Megatron-LM checkpoint: its folder, format, layout and common state (args,
    iteration, scheduler). Keeps no weight."""

    folder: str
    format: str
    iteration: int
    common: dict
    layout: MegatronLayout

    @property
    def args(self):
        return self.common["args"]

    @property
    def sharding(self) -> str | None:
        """torch_dist's distributed optimizer sharding (None: no distributed optimizer's states)."""
        optimizer = self.common.get("optimizer")
        return optimizer.get("param_state_sharding_type") if isinstance(optimizer, dict) else None

    def optimizer_states(self) -> str | None:
        """Which optimizer states it holds: "distributed" (the distributed optimizer's, gathered in a
        legacy distrib_optim.pt or in torch_dist's ``READ_SHARDINGS``) or "plain" (the plain optimizer's
        in a legacy rank file): these load here; "torch_dist distributed (SHARDING)" (its other
        shardings), "torch_dist plain", or None."""
        if self.format == "torch_dist":
            from pretrain.checkpoint.foreign.safe_pickle import load_dcp_metadata

            keys = load_dcp_metadata(os.path.join(self.folder, ".metadata")).state_dict_metadata
            if not any(key.startswith("optimizer.") for key in keys):
                return None
            if self.sharding is None:
                return "torch_dist plain"
            return ("distributed" if self.sharding in READ_SHARDINGS
                    else f"torch_dist distributed ({self.sharding})")
        if os.path.isfile(os.path.join(os.path.dirname(legacy_file(self.folder, self.layout, 0, 0, 0)),
                                       DISTRIBUTED_OPTIMIZER_FILE)):
            return "distributed"
        if getattr(self.args, "use_distributed_optimizer", False) and "optimizer" in self.common:
            return MISSING_DISTRIBUTED  # (its rank files hold the param groups alone)
        return "plain" if "optimizer" in self.common else None

    def manifest(self) -> dict:
        where = self.folder
        config = config_of(self.args, where)
        config.update({name: getattr(self.args, name) for name in RUN_ARGS if hasattr(self.args, name)})
        states = {"progress": position_of(self.args, self.iteration)}
        scheduler = scheduler_of(self.args, self.common.get("opt_param_scheduler"))
        if scheduler is not None:
            states["opt_param_scheduler"] = scheduler
        layout = self.layout
        return {"kind": "megatron", "format": self.format, "iteration": self.iteration,
                "tokenizer": tokenizer_in(self.args, self.folder),
                "consumed_samples": states["progress"]["consumed_samples"], "files": {}, "config": config,
                "states": states,
                "layout": {"tp": layout.tp, "pp": layout.pp, "vp": layout.vp, "ep": layout.ep,
                           "dp": int(getattr(self.args, "data_parallel_size", 0) or 0)},
                "megatron": {"folder": self.folder, "layout": dataclasses.asdict(layout),
                             "optimizer": self.optimizer_states()},
                "source": f"Megatron-LM ({self.format}, {layout.describe()})"}


def tracked_iteration(directory: str) -> int | None:
    """The iteration ``directory``'s tracker names (None: "release"); CheckpointError for other text."""
    path = os.path.join(directory, TRACKER)
    with open(path) as handle:
        text = handle.read().strip()
    if text == "release":
        return None
    if not text.isdigit():
        raise CheckpointError(f"{path}: holds {text[:40]!r}, neither an iteration nor 'release'")
    return int(text)


def open_megatron(directory: str, step: int | None = None) -> MegatronCheckpoint:
    """The checkpoint of iteration ``step`` (default: the tracker's) under Megatron-LM's ``directory``;
    CheckpointError naming what is missing or refused."""
    iteration = step if step is not None else tracked_iteration(directory)
    folder = os.path.join(directory, iteration_folder(iteration))
    if not os.path.isdir(folder):
        raise CheckpointError(f"--load {directory}: no {iteration_folder(iteration)} folder (its tracker or "
                              "--ckpt-step names one that is not there)")
    if os.path.isfile(os.path.join(folder, "metadata.json")):
        with open(os.path.join(folder, "metadata.json")) as handle:
            try:
                backend = json.load(handle).get("sharded_backend")
            except ValueError as error:
                raise CheckpointError(f"{folder}/metadata.json: not JSON ({error})") from None
        if backend != "torch_dist":
            raise CheckpointError(f"{folder}: a Megatron checkpoint in format {backend!r}; this reader takes "
                                  "torch_dist and the legacy torch format")
        common, format_name = load_torch_file(os.path.join(folder, "common.pt"), "common.pt"), "torch_dist"
    else:
        first = sorted(name for name in os.listdir(folder) if name.startswith("mp_rank_"))
        if not first:
            raise CheckpointError(f"{folder}: neither a torch_dist checkpoint (metadata.json) nor legacy "
                                  "mp_rank_* folders")
        common = load_torch_file(os.path.join(folder, first[0], MODEL_FILE), MODEL_FILE)
        format_name = "torch"
    if not isinstance(common, dict) or "args" not in common:
        raise CheckpointError(f"{folder}: its common state records no args (saved with --no-save-args?); "
                              "the model's shape cannot be known")
    layout = layout_of(common["args"], folder)
    saved_iteration = int(common.get("iteration", iteration or 0))
    return MegatronCheckpoint(folder, format_name, saved_iteration, common, layout)


def reopen(manifest: dict) -> MegatronCheckpoint:
    """The checkpoint a manifest of kind "megatron" describes."""
    folder = manifest["megatron"]["folder"]
    name = os.path.basename(folder)
    return open_megatron(os.path.dirname(folder), None if name == "release" else int(name[len("iter_"):]))
