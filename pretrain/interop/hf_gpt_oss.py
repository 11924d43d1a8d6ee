"""gpt-oss's ``config.json`` keys beside the shared decoder ones, both ways: attention sinks (a learned logit
per head: ``--softmax-type learnable``), biases on every projection and on the router (our default linear
biases), its clamped SwiGLU (Megatron's ``--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value
swiglu_limit``), every layer a mixture of experts routed by a softmax over the top-k logits.

Its experts are stored stacked, one tensor per matrix for the layer's experts, [E, in, out], the gate and up
columns interleaved (``hf_names`` cuts them into ours and stacks them back). OpenAI's checkpoints store them
quantized as MXFP4 (``*_blocks`` / ``*_scales``), dequantized on import (``mxfp4``).
"""

from __future__ import annotations

from models.config import GPTConfig
from pretrain.interop.hf_moe import MoEMappingError, sequence_loss_miss, unexpressed

KIND = "gpt_oss"
ALPHA = 1.702  # quick GELU's sigmoid slope: transformers' swiglu_alpha, fixed in Megatron's quick_gelu


def gpt_oss_from_hf(hf: dict) -> dict:
    """Our fields for gpt-oss's sinks, activation, biases and experts (MoEMappingError naming a key that does
    not map)."""
    if hf.get("swiglu_alpha", ALPHA) != ALPHA:
        raise MoEMappingError(f"{KIND} with swiglu_alpha={hf['swiglu_alpha']}: quick GELU's slope is {ALPHA}")
    if not hf.get("attention_bias", True):
        raise MoEMappingError(f"{KIND} with attention_bias=false: its experts and router keep biases, so the "
                              "attention must too (one --disable-bias-linear for all)")
    return {"num_experts": hf["num_local_experts"], "moe_router_topk": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf["intermediate_size"], "moe_router_pre_softmax": False,
            "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef") or 0.0)
            if hf.get("output_router_logits") else 0.0,
            "softmax_type": "learnable", "swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0,
            "activation_func_clamp_value": float(hf.get("swiglu_limit", 7.0)), "disable_bias_linear": False}


def gpt_oss_to_hf(config: GPTConfig) -> dict:
    """gpt-oss's own keys of ``config.json`` for ``config``."""
    return {"num_local_experts": config.num_experts, "num_experts_per_tok": config.moe_router_topk,
            "intermediate_size": config.moe_ffn_hidden_size or config.ffn_size, "swiglu_alpha": ALPHA,
            "swiglu_limit": config.activation_func_clamp_value, "attention_bias": True,
            "router_aux_loss_coef": config.moe_aux_loss_coeff,
            "output_router_logits": config.moe_aux_loss_coeff > 0}


def gpt_oss_misses(config: GPTConfig) -> list[str]:
    """The flags of ``config`` gpt-oss cannot express (beside the shared decoder ones)."""
    if not config.num_experts:
        return ["--num-experts (gpt-oss is a mixture of experts)"]
    misses = []
    if not all(config.moe_layers(config.num_layers)):
        misses.append(f"--moe-layer-freq {config.moe_layer_freq} (every layer is MoE in gpt-oss)")
    if config.activation_func_clamp_value is None:
        misses.append("--activation-func-clamp-value (gpt-oss clamps its SwiGLU: give swiglu_limit)")
    wanted = {"moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
              "moe_router_num_groups": None, "moe_router_topk_scaling_factor": None,
              "moe_expert_capacity_factor": None, "moe_router_enable_expert_bias": False,
              "moe_z_loss_coeff": None, "moe_shared_expert_intermediate_size": None}
    return misses + unexpressed(config, wanted) + sequence_loss_miss(config)
