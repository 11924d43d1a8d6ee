"""What a layout keeps for backward on a device: each layer's saved activations by our layer's own
accounting, the loss stage's logits, and with a split backward what the weight passes keep, held as the
pipeline schedule holds them (``schedule_price.held_bytes``). Nothing here searches or prints."""

from __future__ import annotations

from launch.tools.planning.layout import Layout
from launch.tools.planning.schedule_price import held_bytes
from models.config import GPTConfig
from models.counting import frozen_config
from parallel.pipeline.schedules import SPLIT_SCHEDULES


def activation_bytes(config: GPTConfig, layout: Layout, stage: int, micro_batches: int,
                     compute_bytes: int) -> float:
    """Peak bytes saved for backward on a rank of ``stage`` (see the module docstring), and with a split
    backward what its weight passes keep (``schedule_price.held_bytes``), chunk by chunk; a cp rank keeps
    those of its S / cp tokens (ring attention saves what fused attention saves: q, k, v, output, lse)."""
    return stage_activation_bytes(config, layout, micro_batches, compute_bytes)[stage]


def stage_activation_bytes(config: GPTConfig, layout: Layout, micro_batches: int,
                           compute_bytes: int) -> list[float]:
    """``activation_bytes`` of every stage (a layer's elements counted once for all of them), kept per
    model and what of the layout they depend on (its ZeRO stage and offload do not change them)."""
    key = (frozen_config(config), layout.tp, layout.pp, layout.cp, layout.micro_batch_size,
           layout.sequence_parallel, layout.recompute, layout.recompute_modules, layout.split,
           layout.schedule, layout.vp, layout.ep, layout.etp, micro_batches, compute_bytes)
    if key not in _PEAKS:
        if len(_PEAKS) > 65536:
            _PEAKS.clear()
        _PEAKS[key] = _stage_activation_bytes(config, layout, micro_batches, compute_bytes)
    return _PEAKS[key]


_PEAKS: dict[tuple, list[float]] = {}


def _stage_activation_bytes(config: GPTConfig, layout: Layout, micro_batches: int,
                            compute_bytes: int) -> list[float]:
    s, b, h, t = config.seq_length / layout.cp, layout.micro_batch_size, config.hidden_size, layout.tp
    sbh = s * b * h
    split = t if layout.sequence_parallel else 1
    vocabulary = config.padded_vocab_size(t) / t
    moe_layers = config.moe_layers(config.num_layers)
    if layout.recompute == "full":
        dense = moe_kept = sbh / split
    else:
        dense = layer_elements(config, layout)
        moe_kept = layer_elements(config, layout, moe=True) if config.num_experts else 0.0
    split_backward = layout.schedule in SPLIT_SCHEDULES
    dense_pass = weight_pass_elements(config, layout) if split_backward else 0.0
    moe_pass = (weight_pass_elements(config, layout, moe=True) if split_backward and config.num_experts
                else 0.0)
    peaks = []
    for stage in range(layout.pp):
        saved, pending = [], []
        for chunk, indices in enumerate(layout.chunk_layers(stage, config.num_layers)):
            layers, moe = len(indices), sum(moe_layers[i] for i in indices)
            embedding, loss = layout.holds(stage, chunk)
            kept = (dense * (layers - moe) + moe_kept * moe) * compute_bytes
            # final norm input and output; the loss's saved logits over this rank's vocabulary (16-bit
            # logits under bf16 / fp16, from which backward recomputes the softmax; the fp32 softmax in fp32)
            if loss:
                kept += 2 * sbh / split * compute_bytes + s * b * vocabulary * compute_bytes
            saved.append(kept)
            waiting = 0.0
            if split_backward:  # also the output layer's input and logits' gradient, the embedding's
                waiting = (dense_pass * (layers - moe) + moe_pass * moe
                           + (h / split + vocabulary if loss else 0) + (h if embedding else 0)) * s * b \
                    * compute_bytes
            pending.append(waiting)
        peaks.append(held_bytes(layout.schedule, layout.pp, stage, micro_batches, tuple(saved),
                                tuple(pending)))
    return peaks


def weight_pass_elements(config: GPTConfig, layout: Layout, moe: bool = False) -> float:
    """Elements per token one layer keeps from a split backward's B to its W: each deferred product's input
    and output gradient (q/k/v: h in, (a + 2G) d / t out; the projection: a d / t in, h out (its partial
    sum, whole); fc1: h in, f / t (2 f / t gated) out; fc2: f / t in, h out; the inputs split by t under
    sequence parallelism where they are saved split). A MoE layer's routed experts take k rows of each of
    this rank's tokens at width f' / etp, its shared expert is an MLP of its width. Latent attention is
    priced as the attention of its heads' widths. Norm and bias gradients are left out (vectors), and so are
    the output layer's and the embedding's (``activation_bytes`` adds them on their stages)."""
    t, h = layout.tp, config.hidden_size
    heads, groups, d = config.num_attention_heads / t, config.query_groups / t, config.head_dim
    split = t if layout.sequence_parallel else 1
    attention = h / split + (heads + 2 * groups) * d + heads * d + h
    gate = 2 if config.gated else 1

    def mlp(width: float, inputs: float = h / split) -> float:  # fc1's input and output, fc2's
        return inputs + gate * width + width + h

    if not moe:
        return attention + mlp(config.ffn_size / t)
    width = (config.moe_ffn_hidden_size or config.ffn_size) / layout.expert_tp
    shared = config.moe_shared_expert_intermediate_size or 0
    routed = config.moe_router_topk * mlp(width, h) / split  # the experts' rows are whole
    return attention + routed + (mlp(shared / t) if shared else 0.0)


def layer_elements(config: GPTConfig, layout: Layout, moe: bool = False) -> float:
    """Elements one transformer layer keeps for backward per micro-batch without full recompute, as our
    layer saves them, per token, t = tp, a query heads and G key/value groups of d channels:

    - each of the two norms: its input and its output (which the next linear keeps), 2h (split by t
      under sequence parallelism);
    - the QKV output, (a + 2G) d / t (attention reads keys and values as views of it), and the
      attention output, a d / t;
    - queries and keys made anew on the way: the queries' copy when groups share keys (a d / t, kept
      unless rotary positions consume it), the query/key norms' outputs and the rotary outputs,
      (a + G) d / t each, and the rotary cos and sin tables (2 x rotated channels, not split);
    - the MLP: fc1's output and the activation's (2 f / t); SwiGLU keeps gate and up, silu(gate) and
      the product, 4 f / t.
    GPT-3's layer (LayerNorm, GELU, learned positions): 4 + 12 / t (x sbh). Selective recompute
    (``layout.recompute_modules``): ``core_attn`` gains nothing (the fused attention keeps no s^2 matrix,
    the checkpoint keeps q, k, v instead); ``mlp`` keeps its input instead of its activations (0 for the
    MLP; its norm's output is the kept input); ``layernorm`` drops each pre-norm's output that a linear
    keeps (h, or h / t under sequence parallelism: the attention norm's, and the MLP norm's unless the MLP
    is recomputed). A MoE layer (``moe``) keeps instead of the MLP's, per token of this rank (1 / t of them
    under sequence parallelism), on average: the k rows each routed token becomes at its experts, etp copies
    of each (h each), their activations as the MLP's of width f' (4 f' or 2 f' a row, split over etp), the
    k returned rows the routing weights multiply (h each), the router's and balancing's scores (2 E); and
    the shared expert as an MLP of its width, with its gate's output (h and 1)."""
    t, h, f = layout.tp, config.hidden_size, config.ffn_size
    heads, groups, d = config.num_attention_heads / t, config.query_groups / t, config.head_dim
    split = t if layout.sequence_parallel else 1
    norms = 2 * 2 * h / split
    attention = (heads + 2 * groups) * d + heads * d
    if config.multi_latent_attention:
        attention = _latent_elements(config, t)
    rotary, normed = config.position_embedding == "rope", config.qk_layernorm
    query_copy = heads * d if groups < heads else 0
    if config.multi_latent_attention:
        pass
    elif normed:  # the norms keep their inputs (the query copy; keys are views) and make new queries, keys
        attention += query_copy + (0 if rotary else (heads + groups) * d)
    elif not rotary:
        attention += query_copy  # attention itself keeps the copied queries
    if rotary and not config.multi_latent_attention:  # rotation keeps its tables; attention the rotated q, k
        attention += (heads + groups) * d + 2 * config.rotary_channels
    modules = layout.recompute_modules if layout.recompute == "selective" else ()
    mlp = 0 if "mlp" in modules else (4 if config.gated else 2) * f / t
    if moe:
        mlp = 0 if "moe" in modules else _moe_elements(config, layout, split)
    if "layernorm" in modules and config.norm_placement != "post":
        norms -= (1 if "mlp" in modules else 2) * h / split
    return config.seq_length / layout.cp * layout.micro_batch_size * (norms + attention + mlp)


def _latent_elements(config: GPTConfig, t: int) -> float:
    """``layer_elements``' latent attention per token: the latents as the down projections made them and
    as their norms gave them (whole on every tp rank: they are gathered before the heads read them), the
    queries and keys made whole from their two parts, the up projection's keys and values, the attention
    output, and the rotary tables."""
    heads = config.num_attention_heads / t
    query_key, value = config.query_key_channels, config.value_channels
    latents = 2 * config.kv_lora_rank + config.qk_pos_emb_head_dim + 2 * (config.q_lora_rank or 0)
    return (latents + 2 * heads * query_key + heads * (config.qk_head_dim + value) + heads * value
            + 2 * config.qk_pos_emb_head_dim)


def _moe_elements(config: GPTConfig, layout: Layout, split: int) -> float:
    """``layer_elements``' MoE part per token of the sequence (see there)."""
    h, k, width = config.hidden_size, config.moe_router_topk, config.moe_ffn_hidden_size or config.ffn_size
    activation = (4 if config.gated else 2) * width
    routed = k * (layout.expert_tp * h + activation + h) + 2 * config.num_experts
    shared = config.moe_shared_expert_intermediate_size or 0
    kept = (4 if config.gated else 2) * shared / layout.tp
    if shared and config.moe_shared_expert_gate:
        kept += (h + 1) / split
    return routed / split + kept
