"""DeepSeek-V3's ``config.json`` keys beside the shared decoder ones, both ways: multi-head latent attention
(``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
``rope_interleave``) and its routing (sigmoid scores with the score-correction bias, group-limited top-k,
the routed scaling factor, shared experts, the first ``first_k_dense_replace`` layers dense).

transformers' router is Megatron's sigmoid router exactly when the top-k weights are renormalised
(``norm_topk_prob``, DeepSeek-V3's setting) and a group is scored by its best ``topk / topk_group``
experts (transformers sums each group's best two: DeepSeek-V3's 8 / 4). The score-correction bias is
our expert-bias table (``--moe-router-enable-expert-bias``), a run state of the checkpoint rather than
a weight. Its multi-token-prediction layers (``num_nextn_predict_layers``) are our prediction depths
(``model.layers.{N + k}``: enorm, hnorm, eh_proj, a decoder layer of experts, ``shared_head.norm``).
"""

from __future__ import annotations

from models.config import GPTConfig
from pretrain.interop.hf_moe import MoEMappingError, unexpressed

KIND = "deepseek_v3"
LATENT_EPS = 1e-6  # transformers' latent norms keep their default epsilon whatever rms_norm_eps says


def latent_norm_fields(rms_norm_eps: float) -> dict:
    """Our latent norms' epsilon where transformers' (``LATENT_EPS``, whatever ``rms_norm_eps`` says) is not
    the model's."""
    return {} if rms_norm_eps == LATENT_EPS else {"latent_norm_epsilon": LATENT_EPS}


def latent_norm_misses(config: GPTConfig) -> list[str]:
    """The latent norms' epsilon where it is not transformers' ``LATENT_EPS``."""
    eps = config.latent_norm_epsilon or config.layernorm_epsilon
    return [] if eps == LATENT_EPS else [f"--latent-norm-epsilon {eps} (transformers' latent norms keep "
                                         f"{LATENT_EPS})"]


def deepseek_from_hf(hf: dict) -> dict:
    """Our fields for DeepSeek-V3's latent attention and routing (MoEMappingError naming a key that does not
    map)."""
    if hf.get("pretraining_tp", 1) != 1:
        raise MoEMappingError(f"{KIND} with pretraining_tp={hf['pretraining_tp']}: only 1 maps")
    layers = hf["num_hidden_layers"]
    fields = {"multi_latent_attention": True, "q_lora_rank": hf.get("q_lora_rank"),
              "kv_lora_rank": hf["kv_lora_rank"], "qk_head_dim": hf["qk_nope_head_dim"],
              "qk_pos_emb_head_dim": hf["qk_rope_head_dim"], "v_head_dim": hf["v_head_dim"],
              "rotary_interleaved": bool(hf.get("rope_interleave", True)), "kv_channels": None,
              "group_query_attention": False, "num_query_groups": None,
              "num_experts": hf["n_routed_experts"], "moe_ffn_hidden_size": hf["moe_intermediate_size"],
              "moe_layer_freq": str([int(i >= hf.get("first_k_dense_replace", 0)) for i in range(layers)]),
              **sigmoid_routing_from_hf(hf, KIND), **latent_norm_fields(hf.get("rms_norm_eps", LATENT_EPS)),
              # its MTP layers (transformers' default: one; ``HFModel`` drops them where the files hold none)
              "mtp_num_layers": hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or None}
    if hf.get("n_shared_experts"):
        fields["moe_shared_expert_intermediate_size"] = hf["moe_intermediate_size"] * hf["n_shared_experts"]
    return fields


def sigmoid_routing_from_hf(hf: dict, kind: str) -> dict:
    """Our router for transformers' sigmoid routing (DeepSeek-V3's, Nemotron-H's): sigmoid scores with the
    score-correction bias, group-limited top-k, renormalised top-k weights times the routed scaling factor."""
    if not hf.get("norm_topk_prob", True):
        raise MoEMappingError(f"{kind} with norm_topk_prob=false: sigmoid routing maps with the top-k "
                              "weights renormalised only")
    topk, groups, group_topk = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
    fields = {"moe_router_topk": topk, "moe_router_score_function": "sigmoid",
              "moe_router_enable_expert_bias": True, "moe_aux_loss_coeff": 0.0,
              "moe_router_topk_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0)}
    if groups > 1:
        if topk % group_topk or topk // group_topk != 2:
            raise MoEMappingError(f"{kind} with num_experts_per_tok={topk} and topk_group={group_topk}: "
                                  "transformers scores a group by its best two experts, Megatron by its best "
                                  "topk / topk_group; they agree at 2 only")
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    return fields


def sigmoid_routing_to_hf(config: GPTConfig) -> dict:
    """transformers' keys of the sigmoid routing of ``config``."""
    return {"num_experts_per_tok": config.moe_router_topk,
            "routed_scaling_factor": config.moe_router_topk_scaling_factor or 1.0,
            "n_group": config.moe_router_num_groups or 1, "topk_group": config.moe_router_group_topk or 1,
            "norm_topk_prob": True}


def sigmoid_routing_misses(config: GPTConfig) -> list[str]:
    """What of ``config``'s routing transformers' sigmoid routing cannot express."""
    wanted = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
              "moe_expert_capacity_factor": None, "moe_z_loss_coeff": None}
    misses = unexpressed(config, wanted)
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if groups and groups > 1 and config.moe_router_topk != 2 * group_topk:
        misses.append(f"--moe-router-group-topk {group_topk} (transformers scores a group by its best two "
                      f"experts: --moe-router-topk must be twice it)")
    if config.moe_aux_loss_coeff:
        misses.append(f"--moe-aux-loss-coeff {config.moe_aux_loss_coeff} (the config has no key)")
    return misses


def deepseek_to_hf(config: GPTConfig) -> dict:
    """DeepSeek-V3's own keys of ``config.json`` for ``config``."""
    width = config.moe_ffn_hidden_size or config.ffn_size
    pattern = config.moe_layers(config.num_layers)
    return {"q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
            "qk_nope_head_dim": config.qk_head_dim, "qk_rope_head_dim": config.qk_pos_emb_head_dim,
            "v_head_dim": config.v_head_dim, "head_dim": config.qk_pos_emb_head_dim,
            "rope_interleave": config.rotary_interleaved, "n_routed_experts": config.num_experts,
            "moe_intermediate_size": width,
            "n_shared_experts": (config.moe_shared_expert_intermediate_size or 0) // width,
            "first_k_dense_replace": pattern.index(True) if any(pattern) else 0,
            "num_nextn_predict_layers": config.mtp_depths, **sigmoid_routing_to_hf(config)}


def deepseek_misses(config: GPTConfig) -> list[str]:
    """The flags of ``config`` DeepSeek-V3 cannot express (beside the shared decoder ones)."""
    misses = []
    if not config.multi_latent_attention:
        misses.append("--multi-latent-attention (DeepSeek-V3's attention is latent)")
    misses += latent_norm_misses(config)
    if not config.num_experts:
        return misses + ["--num-experts (DeepSeek-V3 is a mixture of experts)"]
    pattern = config.moe_layers(config.num_layers)
    first = pattern.index(True) if any(pattern) else len(pattern)
    if not all(pattern[first:]):
        misses.append(f"--moe-layer-freq {config.moe_layer_freq} (DeepSeek-V3's dense layers come first)")
    width = config.moe_ffn_hidden_size or config.ffn_size
    shared = config.moe_shared_expert_intermediate_size
    if shared and (shared % width or config.moe_shared_expert_gate):
        misses.append(f"--moe-shared-expert-intermediate-size {shared} (whole experts of {width}, ungated)")
    return misses + unexpressed(config, {"disable_bias_linear": True}) + sigmoid_routing_misses(config)
