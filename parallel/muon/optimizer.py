"""Muon with AdamW beside it, as one torch optimizer: Muon's orthogonalized momentum on the parameter groups
marked ``use_muon`` (the transformer layers' matrices), AdamW on the others (embeddings, the output layer,
norms, biases), as Megatron-LM pairs them.

A step runs in three phases so that the orthogonalization, the one part that is not element-wise, can be
done elsewhere: ``prepare`` (per element: AdamW's whole step; Muon's momentum and the update to
orthogonalize), ``exchange`` (the orthogonalization, by ``matrices``: here, each parameter as it is; under
ZeRO, whole matrices gathered from their shards on one owner each) and ``finish`` (per element: weight decay
and the orthogonalized update). ``step()`` runs the three.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from torch.optim.adam import adam
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from parallel.muon.matrices import MuonSettings, orthogonalized_and_scale
from parallel.param_meta import meta

# (parameter, the update to orthogonalize, its settings) -> each orthogonalized update and a factor still
# to apply to it (folded into the learning rate), in order
Orthogonalizer = Callable[[list[tuple[nn.Parameter, torch.Tensor, MuonSettings]]],
                          list[tuple[torch.Tensor, float]]]

MUON_STATE, ADAM_STATES = ("momentum_buffer",), ("exp_avg", "exp_avg_sq")


def local_matrices(updates: list[tuple[nn.Parameter, torch.Tensor, MuonSettings]]
                   ) -> list[tuple[torch.Tensor, float]]:
    """Each parameter's update orthogonalized as it is: the parameters are whole (one process, or data
    parallelism without sharding)."""
    return [orthogonalized_and_scale(update.view(param.shape), meta(param).fused_rows, settings)
            for param, update, settings in updates]


def _undistributed(updates):
    raise RuntimeError("Muon over flat shards steps only after distribute() named their matrices' owners")


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon`` (default), AdamW on the others (``betas``, ``eps``).

    Owns the per-element states (Muon's ``momentum_buffer``; AdamW's ``exp_avg``, ``exp_avg_sq``, and its
    ``step``) and the updates between phases. Defaults are Megatron-LM's (--muon-momentum 0.95, no Nesterov,
    5 quintic steps, spectral scale, "medium" precision, q, k and v apart), except ``tp_mode``: whole
    matrices ("duplicated") rather than Megatron's blockwise. ``lr`` and ``weight_decay`` are the scheduled
    ones of both kinds of group (decoupled: ``p -= lr wd p``). It never communicates: ``matrices`` does.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = False, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 use_muon: bool = True, *, shards: bool = False, **settings):
        """``shards``: the parameters are flat shards of matrices (ZeRO's masters), orthogonalized only once
        ``distribute`` names who gathers them."""
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "betas": betas, "eps": eps, "use_muon": use_muon,
                    **vars(MuonSettings(**settings))}
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"]:
                MuonSettings.of(group).check()
                # (an empty one is a stage-3 parameter freed between its gathers: its shape is not here)
                flat = [tuple(p.shape) for p in group["params"] if p.ndim < 2 and p.numel()]
                if flat and not shards:
                    raise ValueError(f"Muon orthogonalizes matrices; parameters of shape {flat[0]} take "
                                     "AdamW (a group with use_muon False)")
            else:
                devices = {p.device.type for p in group["params"]}
                group.setdefault("fused", len(devices) == 1
                                 and devices <= set(_get_fused_kernels_supported_devices()))
        self.matrices: Orthogonalizer = _undistributed if shards else local_matrices
        # prepared updates, then (after ``exchange``) the orthogonalized ones with their factor still to apply
        self._updates: dict[nn.Parameter, torch.Tensor | tuple[torch.Tensor, float]] = {}

    def distribute(self, matrices: Orthogonalizer) -> None:
        """Orthogonalize through ``matrices`` from now on (ZeRO's whole-matrix owners)."""
        self.matrices = matrices

    def kinds(self, param: nn.Parameter) -> tuple[str, ...]:
        """The per-element states ``param`` keeps here."""
        group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
        return MUON_STATE if group["use_muon"] else ADAM_STATES

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.prepare()
        self.exchange()
        self.finish()
        return loss

    def waiting(self, param: nn.Parameter) -> bool:
        """Whether ``param`` has an update prepared and not yet applied."""
        return param in self._updates

    @torch.no_grad()
    def prepare(self, keep: bool = False) -> None:
        """Every parameter with a gradient: AdamW's step; Muon's momentum (EMA ``m <- mu m + (1 - mu) g``)
        and the update to orthogonalize (``m``, or with Nesterov ``(1 - mu) g + mu m``; ``keep``: a copy
        even of ``m``, whose memory the caller reuses before the exchange, as NVMe offload does)."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not group["use_muon"]:
                self._adamw(group, params)
                continue
            for param in params:
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                buffer = state["momentum_buffer"]
                buffer.lerp_(param.grad, 1 - group["momentum"])
                self._updates[param] = param.grad.lerp(buffer, group["momentum"]) if group["nesterov"] \
                    else (buffer.clone() if keep else buffer)

    @torch.no_grad()
    def exchange(self) -> None:
        """The prepared updates orthogonalized (a collective where ``matrices`` is one: every rank of its
        groups calls it, with or without updates)."""
        settings = {}
        for group in self.param_groups:
            if group["use_muon"]:
                settings.update(dict.fromkeys(map(id, group["params"]), MuonSettings.of(group)))
        pending = [(param, update, settings[id(param)]) for param, update in self._updates.items()]
        self._updates = dict(zip((param for param, _, _ in pending), self.matrices(pending)))

    @torch.no_grad()
    def finish(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Apply the orthogonalized updates of ``params`` (default: all): ``p <- p (1 - lr wd) - lr O``."""
        wanted = None if params is None else {id(p) for p in params}
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for param in group["params"]:
                if param not in self._updates or (wanted is not None and id(param) not in wanted):
                    continue
                update, scale = self._updates.pop(param)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update.view(param.shape).to(param.device), alpha=-(group["lr"] * scale))

    def _adamw(self, group: dict, params: list[nn.Parameter]) -> None:
        if not params:
            return
        for param in params:
            state = self.state[param]
            if "step" not in state:
                state["step"] = (torch.zeros((), dtype=torch.float32, device=param.device) if group["fused"]
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], [s["exp_avg"] for s in states],
             [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
             foreach=not group["fused"], fused=group["fused"] or None, decoupled_weight_decay=True,
             amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=False)


def settings_of_torch_muon(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The group options of a ``torch.optim.Muon`` as this Muon's, so that it steps exactly as torch's:
    its coefficients (one set, repeated), its bf16 precision, its learning-rate rule ("original": shape
    scaling; "match_rms_adamw": 0.2 x spectral), q, k and v not split."""
    groups = []
    for group in optimizer.param_groups:
        rule = group["adjust_lr_fn"]
        if rule not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"torch.optim.Muon's adjust_lr_fn {rule!r} is not one this stack knows")
        groups.append({"lr": group["lr"], "weight_decay": group["weight_decay"],
                       "momentum": group["momentum"],
                       "nesterov": group["nesterov"], "ns_steps": group["ns_steps"],
                       "coefficient_type": (tuple(group["ns_coefficients"]),), "precision": "torch",
                       "ns_eps": group["eps"], "split_qkv": False,
                       "scale_mode": "spectral" if rule == "match_rms_adamw" else "shape_scaling",
                       "extra_scale_factor": 0.2 if rule == "match_rms_adamw" else 1.0, "use_muon": True})
    return groups
