"""The optimizer a run steps with, over parameter groups as Megatron-LM makes them: AdamW (--optimizer adam),
SGD (sgd) or Muon (muon: the transformer layers' matrices orthogonalized, AdamW with the --adam-* flags on
embeddings, the output layer, norms and biases).

Groups: weight decay on matrices, none on norms and biases (1-D parameters; the query/key norms too
unless --apply-wd-to-qk-layernorm); with --decoupled-lr, the input embedding and the output layer in
groups of their own, whose learning rate follows the same warm-up and decay between --decoupled-lr
and --decoupled-min-lr; under Muon, its matrices in groups of their own; under muP, the parameters whose
rate it scales (``lr_scale``: AdamW's hidden matrices / m, with their epsilon). Each group records which
schedule it follows (``decoupled``, ``lr_scale``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from parallel.muon import Muon
from parallel.param_meta import meta
from pretrain.config.schema import OptimizerConfig

# (``mtp_embedding``: a last stage's copy of the embedding for the prediction depths, stepped as it is)
EMBEDDING_OR_OUTPUT = ("word_embedding.weight", "output_layer.weight", "mtp_embedding.weight")
NOT_MUON = (*EMBEDDING_OR_OUTPUT, "position_embedding.weight")  # matrices that take AdamW under Muon


class OptimizerChoice:
    """The --optimizer a checkpoint was trained with (its manifest's "optimizer" state). Owns the name only;
    loading another's states is refused (startup refuses it first, naming --no-load-optim)."""

    def __init__(self, name: str):
        self.name = name

    def state_dict(self) -> dict:
        return {"name": self.name}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(switch_refusal(state.get("name"), self.name))


def switch_refusal(saved: str, wanted: str) -> str:
    return (f"--optimizer {wanted}: the checkpoint's states are {saved}'s; resume with --optimizer {saved}, "
            "or add --no-load-optim to start a fresh optimizer at the checkpoint's iteration")


def takes_muon(name: str, param: nn.Parameter) -> bool:
    """Whether ``param`` (named ``name`` in its chunk) is one Muon steps: what its layer declared, else a
    matrix of the layers (the embeddings and the output layer take AdamW, as Megatron's
    ``is_embedding_or_output_parameter``)."""
    declared = meta(param).muon
    return declared if declared is not None else hidden_matrix(name, param)


def hidden_matrix(name: str, param: nn.Parameter) -> bool:
    """A matrix (or a convolution's taps) of the layers: neither an embedding nor the output layer."""
    return param.ndim >= 2 and not name.endswith(NOT_MUON)


def muon_options(opt: OptimizerConfig) -> dict:
    """Muon's settings from the --muon-* flags (its AdamW groups take the --adam-* ones)."""
    return {"momentum": opt.muon_momentum, "nesterov": opt.muon_use_nesterov,
            "ns_steps": opt.muon_num_ns_steps,
            "coefficient_type": opt.muon_coefficient_type, "scale_mode": opt.muon_scale_mode,
            "extra_scale_factor": opt.muon_extra_scale_factor, "precision": opt.muon_fp32_matmul_prec,
            "split_qkv": not opt.muon_no_split_qkv, "tp_mode": opt.muon_tp_mode,
            "betas": (opt.adam_beta1, opt.adam_beta2), "eps": opt.adam_eps}


def optimizer_factory(opt: OptimizerConfig):
    """Makes the --optimizer over torch-style groups (a group's own ``weight_decay`` and ``use_muon`` win)."""
    def make(param_groups: list[dict]) -> torch.optim.Optimizer:
        if opt.optimizer == "muon":
            return Muon(param_groups, lr=opt.lr, weight_decay=opt.weight_decay, **muon_options(opt))
        if opt.optimizer == "sgd":
            return torch.optim.SGD(param_groups, lr=opt.lr, weight_decay=opt.weight_decay,
                                   momentum=opt.sgd_momentum, foreach=True)
        # torch's fused kernel (one pass over each master, as Megatron's fused Adam) where the masters' device
        # has one, the CPU included (4-5x faster there than the multi-tensor loop: 0.9 vs 4.7 ms a step for
        # 870K fp32 masters, one thread); otherwise the multi-tensor loop
        devices = {p.device.type for group in param_groups for p in group["params"]}
        fused = len(devices) == 1 and devices <= set(_get_fused_kernels_supported_devices())
        return torch.optim.AdamW(param_groups, lr=opt.lr,
                                 betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                                 weight_decay=opt.weight_decay,
                                 **({"fused": True} if fused else {"foreach": True}))
    return make


def state_moments(chunks: nn.ModuleList, opt: OptimizerConfig) -> Callable[[nn.Parameter], int]:
    """The fp32 optimizer states each parameter keeps per element: AdamW's two moments; SGD's momentum (none
    without); under Muon one momentum for its matrices, AdamW's two for the rest."""
    if opt.optimizer == "sgd":
        return lambda param: 1 if opt.sgd_momentum else 0
    if opt.optimizer == "adam":
        return lambda param: 2
    muon = {id(p) for group in parameter_groups(chunks, opt) if group["use_muon"] for p in group["params"]}
    return lambda param: 1 if id(param) in muon else 2


def mup_lr_scale(name: str, param: nn.Parameter, opt: OptimizerConfig, width_mult: float) -> float:
    """muP's factor on ``param``'s learning rate (Megatron's rule): AdamW's hidden matrices / m, SGD's
    vector-like parameters (embeddings, the output layer, norms, biases) x m; none under Muon (its own
    matrices are scaled by its scale mode; the rest are vector-like) or at m = 1."""
    matrix = hidden_matrix(name, param)
    if width_mult == 1.0 or opt.optimizer == "muon":
        return 1.0
    if opt.optimizer == "sgd":
        return 1.0 if matrix else width_mult
    return 1.0 / width_mult if matrix else 1.0


def parameter_groups(chunks: nn.ModuleList, opt: OptimizerConfig, width_mult: float = 1.0) -> list[dict]:
    """The groups of the trainable parameters of ``chunks`` (empty groups dropped); ``width_mult``: muP's m
    (its groups' ``lr_scale``, and AdamW's epsilon / m with their rate)."""
    groups: dict[tuple[bool, bool, bool, float], list[nn.Parameter]] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            qk_norm = name.endswith(("q_norm.weight", "k_norm.weight", "q_norm.bias", "k_norm.bias"))
            decays = param.ndim >= 2 or (qk_norm and opt.apply_wd_to_qk_layernorm)
            decoupled = opt.decoupled_lr is not None and name in EMBEDDING_OR_OUTPUT
            muon = opt.optimizer == "muon" and takes_muon(name, param)
            scale = 1.0 if decoupled else mup_lr_scale(name, param, opt, width_mult)
            groups.setdefault((decays, decoupled, muon, scale), []).append(param)
    return [{"params": params, "weight_decay": opt.weight_decay if decays else 0.0,
             "wd_mult": 1.0 if decays else 0.0, "decoupled": decoupled,
             **({"use_muon": muon} if opt.optimizer == "muon" else {}),
             **({"lr_scale": scale} if scale != 1.0 else {}),
             **({"eps": opt.adam_eps * scale} if scale != 1.0 and opt.optimizer == "adam" else {})}
            for (decays, decoupled, muon, scale), params in sorted(
                groups.items(), key=lambda item: (not item[0][0], item[0][1], not item[0][2], item[0][3]))]
