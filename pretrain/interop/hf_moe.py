"""The mixture-of-experts part of the Hugging Face families that map exactly (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE): their config keys both ways, what a family cannot express, and where its router, experts and
shared expert sit (``hf_names`` writes the tensor rules from it).

Routing, as transformers computes it: softmax over every expert in fp32, the top k, renormalised over
them with ``norm_topk_prob`` (Mixtral always) = Megatron's softmax over the top-k logits; without it
(Qwen2-MoE's and OLMoE's default) = ``--moe-router-pre-softmax``. Qwen's ``decoder_sparse_step`` and
``mlp_only_layers`` say which layers are MoE (``--moe-layer-freq`` as a list); its shared expert's output
is scaled by sigmoid(x w) (``--moe-shared-expert-gate``). Training-time options with no counterpart in
inference (the auxiliary loss's coefficient) map where the family has a key; router noise does not map.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import GPTConfig


class MoEMappingError(ValueError):
    """A mixture-of-experts setting one side cannot express; names why."""


@dataclass(frozen=True)
class MoEFamily:
    """Where one family keeps its experts: the config keys of their count and width, the module holding
    the router (``prefix``.``router``) and the experts (``prefix``.experts.E.{gate, up, down}), the module
    of its shared expert (``prefix``.``shared``; Qwen's gated, DeepSeek's not), whether it has Qwen's
    sparse-layer keys, and its default for renormalised top-k weights; ``stacked``: the layer's experts as
    one [E, in, out] tensor per matrix (gpt-oss)."""

    experts_key: str
    width_key: str
    prefix: str
    projections: tuple[str, str, str]
    shared: str | None = None
    router: str = "gate"  # the module of the router's weight (and bias)
    stacked: bool = False
    sparse_layers: bool = False
    normalised: bool | None = None  # norm_topk_prob's default (None: no such key, always renormalised)


GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
MOE_FAMILIES = {
    "mixtral": MoEFamily("num_local_experts", "intermediate_size", "block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": MoEFamily("num_experts", "moe_intermediate_size", "mlp", GATE_UP_DOWN,
                           shared="shared_expert",
                           sparse_layers=True, normalised=False),
    "qwen3_moe": MoEFamily("num_experts", "moe_intermediate_size", "mlp", GATE_UP_DOWN, sparse_layers=True,
                           normalised=False),
    "olmoe": MoEFamily("num_experts", "intermediate_size", "mlp", GATE_UP_DOWN, normalised=False),
    # its routing and latent attention keys: ``hf_deepseek``
    "deepseek_v3": MoEFamily("n_routed_experts", "moe_intermediate_size", "mlp", GATE_UP_DOWN,
                             shared="shared_experts"),
    # its sinks, activation and biases: ``hf_gpt_oss``
    "gpt_oss": MoEFamily("num_local_experts", "intermediate_size", "mlp", ("gate_up_proj", "", "down_proj"),
                         router="router", stacked=True),
    # Qwen3-Next's: Qwen2-MoE's gated shared expert, renormalised top-k by default (its layers:
    # ``hf_qwen3_next``)
    "qwen3_next": MoEFamily("num_experts", "moe_intermediate_size", "mlp", GATE_UP_DOWN,
                            shared="shared_expert", sparse_layers=True, normalised=True),
    # Kimi Linear's: Mixtral's names, DeepSeek-V3's routing and shared experts (``hf_kimi_linear``)
    "kimi_linear": MoEFamily("num_experts", "moe_intermediate_size", "block_sparse_moe", ("w1", "w3", "w2"),
                             shared="shared_experts"),
}


def moe_layers_of(hf: dict, layers: int) -> list[int]:
    """Qwen's MoE layers (1) and dense ones (0), by ``decoder_sparse_step`` and ``mlp_only_layers``."""
    step, dense = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def moe_from_hf(hf: dict, kind: str) -> dict:
    """Our MoE fields for a ``kind`` config.json (MoEMappingError naming a key without a counterpart)."""
    family = MOE_FAMILIES[kind]
    if hf.get("router_jitter_noise"):
        raise MoEMappingError(f"{kind} with router_jitter_noise={hf['router_jitter_noise']}: router noise "
                              "does not map")
    normalised = True if family.normalised is None else hf.get("norm_topk_prob", family.normalised)
    experts = hf.get(family.experts_key) or hf.get("num_local_experts") or hf.get("num_experts")
    fields = {"num_experts": experts, "moe_router_topk": hf["num_experts_per_tok"],
              "moe_ffn_hidden_size": hf[family.width_key], "moe_router_pre_softmax": not normalised,
              "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef") or 0.0)
              if hf.get("output_router_logits") else 0.0}
    if family.sparse_layers:
        fields["moe_layer_freq"] = str(moe_layers_of(hf, hf["num_hidden_layers"]))
    if family.shared and hf.get("shared_expert_intermediate_size"):
        fields.update(moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                      moe_shared_expert_gate=True)
    return fields


def moe_to_hf(config: GPTConfig, kind: str) -> dict:
    """The MoE keys of ``kind``'s config.json for ``config``."""
    family = MOE_FAMILIES[kind]
    hf = {family.experts_key: config.num_experts, "num_experts_per_tok": config.moe_router_topk,
          family.width_key: config.moe_ffn_hidden_size or config.ffn_size,
          "router_aux_loss_coef": config.moe_aux_loss_coeff,
          "output_router_logits": config.moe_aux_loss_coeff > 0}
    if family.normalised is not None:
        hf["norm_topk_prob"] = not config.moe_router_pre_softmax
    if family.sparse_layers:
        pattern = config.moe_layers(config.num_layers)
        hf.update(decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
    if family.shared:
        hf["shared_expert_intermediate_size"] = config.moe_shared_expert_intermediate_size or 0
    return hf


def moe_misses(config: GPTConfig, kind: str) -> list[str]:
    """The MoE flags of ``config`` that ``kind`` cannot express (a dense family: any experts at all)."""
    family = MOE_FAMILIES.get(kind)
    if family is None:
        return [f"--num-experts {config.num_experts}"] if config.num_experts else []
    if not config.num_experts:
        return ["--num-experts (the model has no experts)"]
    misses = []
    if not family.sparse_layers and not all(config.moe_layers(config.num_layers)):
        misses.append(f"--moe-layer-freq {config.moe_layer_freq} (every layer is MoE in {kind})")
    if family.normalised is None and config.moe_router_pre_softmax:
        misses.append("--moe-router-pre-softmax (Mixtral renormalises the top-k weights)")
    shared = config.moe_shared_expert_intermediate_size
    if shared and not (family.shared is not None and config.moe_shared_expert_gate):
        misses.append(f"--moe-shared-expert-intermediate-size {shared}"
                      + ("" if family.shared else f" ({kind} has no shared expert)") + " without its gate")
    wanted = {"moe_router_score_function": "softmax", "moe_router_num_groups": None,
              "moe_router_topk_scaling_factor": None, "moe_expert_capacity_factor": None,
              "moe_router_enable_expert_bias": False, "moe_z_loss_coeff": None,
              "disable_bias_linear": True}
    return misses + unexpressed(config, wanted) + sequence_loss_miss(config)


def unexpressed(config: GPTConfig, wanted: dict) -> list[str]:
    """``--flag value`` for each of ``config``'s fields that differs from the value a family fixes (None:
    off, which a zero also is: a z-loss of 0 is none)."""
    return [f"--{name.replace('_', '-')} {getattr(config, name)}" for name, value in wanted.items()
            if getattr(config, name) != value and not (value is None and not getattr(config, name))]


def sequence_loss_miss(config: GPTConfig) -> list[str]:
    """The per-sequence balancing loss, which no family's config has a key for (none when it is off)."""
    if config.moe_router_load_balancing_type == "seq_aux_loss" and config.moe_aux_loss_coeff:
        return ["--moe-router-load-balancing-type seq_aux_loss"]
    return []
