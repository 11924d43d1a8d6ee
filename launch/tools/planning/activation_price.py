"""What a layout keeps for backward on a device: each layer's saved activations by our layer's own
accounting, the loss stage's logits, and with a split backward what the weight passes keep, held as the
pipeline schedule holds them (``schedule_price.held_bytes``). Nothing here searches or prints."""

from __future__ import annotations

from launch.tools.planning.layer_parts import RECOMPUTED_WHOLE, SUBLAYERS
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
    entries = config.layer_types()
    split_backward = layout.schedule in SPLIT_SCHEDULES
    kept_of = {entry: (sbh / split if layout.recompute == "full" else layer_elements(config, layout, entry))
               for entry in set(entries + config.mtp_layer_types())}
    depth_layers = sum(kept_of[entry] for entry in config.mtp_layer_types())
    pass_of = {entry: weight_pass_elements(config, layout, entry) if split_backward else 0.0
               for entry in set(entries)}
    peaks = []
    for stage in range(layout.pp):
        saved, pending = [], []
        for chunk, indices in enumerate(layout.chunk_layers(stage, config.num_layers)):
            embedding, loss = layout.holds(stage, chunk)
            kept = sum(kept_of[entries[i]] for i in indices) * compute_bytes
            # final norm input and output; the loss's saved logits over this rank's vocabulary (16-bit
            # logits under bf16 / fp16, from which backward recomputes the softmax; the fp32 softmax in fp32)
            if loss:
                kept += 2 * sbh / split * compute_bytes + s * b * vocabulary * compute_bytes
                # each prediction depth: its norms' inputs (the embedding's, the hidden state's), eh_proj's
                # joined input (2h), its layers, its final norm and logits
                kept += config.mtp_depths * ((6 * sbh / split + depth_layers) * compute_bytes
                                             + s * b * vocabulary * compute_bytes)
            saved.append(kept)
            waiting = 0.0
            if split_backward:  # also the output layer's input and logits' gradient, the embedding's
                waiting = (sum(pass_of[entries[i]] for i in indices)
                           + (h / split + vocabulary if loss else 0) + (h if embedding else 0)) * s * b \
                    * compute_bytes
            pending.append(waiting)
        peaks.append(held_bytes(layout.schedule, layout.pp, stage, micro_batches, tuple(saved),
                                tuple(pending)))
    return peaks


def weight_pass_elements(config: GPTConfig, layout: Layout, entry: str = "*-") -> float:
    """Elements per token one layer (of registry entry ``entry``) keeps from a split backward's B to its W:
    each deferred product's input and output gradient (q/k/v: h in, (a + 2G) d / t out; the projection:
    a d / t in, h out (its partial sum, whole); fc1: h in, f / t (2 f / t gated) out; fc2: f / t in, h out;
    a Mamba mixer's in_proj: h in, its rows / t out, out_proj: I / t in, h out; the inputs split by t under
    sequence parallelism where they are saved split). A MoE layer's routed experts take k rows of each of
    this rank's tokens at width f' / etp, its shared expert is an MLP of its width. Latent attention is
    priced as the attention of its heads' widths. Norm and bias gradients are left out (vectors), and so are
    the output layer's and the embedding's (``activation_bytes`` adds them on their stages)."""
    t, h = layout.tp, config.hidden_size
    heads, d = config.num_attention_heads / t, config.head_dim
    split = t if layout.sequence_parallel else 1
    gate = 2 if config.gated else 1

    def mlp(width: float, inputs: float = h / split) -> float:  # fc1's input and output, fc2's
        return inputs + gate * width + width + h

    def moe() -> float:
        width = (config.moe_ffn_hidden_size or config.ffn_size) / layout.expert_tp
        shared = config.moe_shared_expert_intermediate_size or 0
        routed = config.moe_router_topk * mlp(width, h) / split  # the experts' rows are whole
        return routed + (mlp(shared / t) if shared else 0.0)

    parts = {"attention": lambda: h / split + config.attention_projection_rows / t + heads * d + h,
             "mlp": lambda: mlp(config.ffn_size / t), "moe": moe,
             "mamba": lambda: h / split + (config.mamba_projection_rows + config.mamba_inner) / t + h,
             "gdn": lambda: h / split + (config.gdn_projection_rows + config.gdn_value_width) / t + h,
             "kda": lambda: h / split + (config.kda_projection_rows + config.gdn_value_width) / t + h}
    return sum(parts[part]() for part in SUBLAYERS[entry])


def layer_elements(config: GPTConfig, layout: Layout, entry: str | None = None) -> float:
    """Elements one layer of registry entry ``entry`` (None: the model's largest) keeps for backward per
    micro-batch without full recompute, as our layers save them, per token, t = tp, a query heads and G
    key/value groups of d channels; each sublayer's pre-norm keeps its input and its output (which the next
    linear keeps), 2h (split by t under sequence parallelism), and:

    - attention: the QKV output, (a + 2G) d / t (attention reads keys and values as views of it), and the
      attention output, a d / t; queries and keys made anew on the way: the queries' copy when groups
      share keys (a d / t, kept unless rotary positions consume it), the query/key norms' outputs and the
      rotary outputs, (a + G) d / t each, and the rotary cos and sin tables (2 x rotated channels);
    - the MLP: fc1's output and the activation's (2 f / t); SwiGLU keeps gate and up, silu(gate) and
      the product, 4 f / t;
    - a Mamba-2 mixer (``_mamba_elements``).
    GPT-3's layer (LayerNorm, GELU, learned positions): 4 + 12 / t (x sbh). Selective recompute
    (``layout.recompute_modules``): ``core_attn`` gains nothing (the fused attention keeps no s^2 matrix,
    the checkpoint keeps q, k, v instead); ``mlp`` (``moe``, ``mamba``) keeps its input instead of its
    activations (its norm's output is the kept input); ``layernorm`` drops each pre-norm's output that a
    linear keeps (h, or h / t under sequence parallelism) unless ``layer_parts.RECOMPUTED_WHOLE`` says the
    recompute keeps it. A MoE
    layer keeps instead of the MLP's, per token of this rank (1 / t of them under sequence parallelism), on
    average: the k rows each routed token becomes at its experts, etp copies of each (h each), their
    activations as the MLP's of width f' (4 f' or 2 f' a row, split over etp), the k returned rows the
    routing weights multiply (h each), the router's and balancing's scores (2 E); and the shared expert as
    an MLP of its width, with its gate's output (h and 1)."""
    if entry is None:
        return max(layer_elements(config, layout, kind) for kind in set(config.layer_types()))
    t, h, f = layout.tp, config.hidden_size, config.ffn_size
    split = t if layout.sequence_parallel else 1
    modules = layout.recompute_modules if layout.recompute == "selective" else ()
    parts = {"attention": lambda: _attention_elements(config, t),
             "mlp": lambda: 0 if "mlp" in modules else (4 if config.gated else 2) * f / t,
             "moe": lambda: 0 if "moe" in modules else _moe_elements(config, layout, split),
             "mamba": lambda: 0 if "mamba" in modules else _mamba_elements(config, layout),
             "gdn": lambda: _gated_delta_elements(config, layout.tp),
             "kda": lambda: _kimi_delta_elements(config, layout.tp)}
    elements = 0.0
    for part in SUBLAYERS[entry]:
        norm = 2 * h / split if config.norm_placement != "post" else 0.0
        if "layernorm" in modules and norm and RECOMPUTED_WHOLE.get(part) not in modules:
            norm -= h / split
        elements += norm + parts[part]()
    return config.seq_length / layout.cp * layout.micro_batch_size * elements


def _attention_elements(config: GPTConfig, t: int) -> float:
    """``layer_elements``' attention part per token (see there)."""
    heads, groups, d = config.num_attention_heads / t, config.query_groups / t, config.head_dim
    if config.multi_latent_attention:
        return _latent_elements(config, t)
    attention = config.attention_projection_rows / t + heads * d
    if config.attention_output_gate:  # the gate's sigmoid and the gated output (the projection's input)
        attention += 2 * heads * d
    rotary, normed = config.position_embedding == "rope", config.qk_layernorm
    query_copy = heads * d if groups < heads else 0
    if normed:  # the norms keep their inputs (the query copy; keys are views) and make new queries, keys
        attention += query_copy + (0 if rotary else (heads + groups) * d)
    elif not rotary:
        attention += query_copy  # attention itself keeps the copied queries
    if rotary:  # rotation keeps its tables; attention the rotated q, k
        attention += (heads + groups) * d + 2 * config.rotary_channels
    return attention


def _mamba_elements(config: GPTConfig, layout: Layout) -> float:
    """``layer_elements``' Mamba-2 mixer per token of this rank (t = tp; its inner width I, heads H, groups G
    of N states per tp rank), as ``models.mamba.mixer`` keeps them: z (I, for the gated norm), the
    convolution's input (x, B and C: I + 2 G N; its SiLU is remade in backward), x, B and C made contiguous
    for the scan (I + 2 G N), dt before and after softplus (2 H, fp32), the scan's output (I: the scan keeps
    only its inputs and redoes its chunks in backward), the gated norm's output (I) and 1 / rms per group
    (G). Under context parallelism each rank convolves and scans whole sequences for 1 / cp of the heads:
    per token of its own the same counts, B and C repeated where cp exceeds the groups."""
    t, cp = layout.tp, layout.cp
    groups = config.mamba_num_groups / t
    copies = max(1.0, cp / groups)  # B and C sent to every cp rank that takes a share of a group's heads
    inner, heads = config.mamba_inner / t, config.mamba_heads / t
    shared = 2 * groups * config.mamba_state_dim * copies
    return 5 * inner + 2 * shared + 2 * heads + groups


def _gated_delta_elements(config: GPTConfig, t: int) -> float:
    """``layer_elements``' gated delta net per token of this rank (t = tp; its convolution's channels C = 2
    Hk dk + Hv dv, value width V = Hv dv and Hv value heads per tp rank), as ``models.gdn.mixer`` keeps
    them: the convolution's input and output (2 C: the delta rule keeps q, k, v as the convolution gave
    them, and the gates' inputs a and b, 2 Hv, and redoes the norms, the repeat, the gates and its chunks
    in backward), v made contiguous (V), the rule's output, z and 1 / rms per head for the gated norm (2 V
    + Hv), and its output, out_proj's input (V). Under context parallelism each rank runs whole sequences of
    1 / cp of the heads: per token of its own the same counts."""
    channels, width = config.gdn_conv_channels / t, config.gdn_value_width / t
    return 2 * channels + 4 * width + 3 * config.linear_num_value_heads / t


def _kimi_delta_elements(config: GPTConfig, t: int) -> float:
    """``layer_elements``' Kimi delta attention per token of this rank (t = tp; H heads of d channels, C =
    3 H d, V = H d), as ``models.kda.mixer`` keeps them: the decay's and the gate's latents (2 d, whole on
    every rank), q, k, v, b and the decay's input joined per head (the exchanged width), the convolution's
    input and output (2 C), and as for gated delta nets the rule's output, the gate and 1 / rms per head,
    and out_proj's input (3 V + H)."""
    heads = config.linear_num_value_heads / t
    return (2 * config.linear_value_head_dim + config.kda_exchanged_width / t
            + 2 * config.kda_conv_channels / t + 3 * config.gdn_value_width / t + heads)


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
