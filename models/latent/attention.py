"""Multi-head latent attention (DeepSeek-V2/V3; Megatron's ``--multi-latent-attention``): every head's keys
and values made from one compressed latent per token, split across the tensor-parallel group by head.

    queries: x -> q_down [q_lora_rank] -> RMSNorm -> q_up [heads x (qk + rope)]   (or x -> q_proj)
    keys, values: x -> kv_down [kv_lora_rank | rope] ; latent -> RMSNorm -> kv_up [heads x (qk + v)]
    key = [its head's qk part | the rotary part shared by the heads], query = [qk part | rotary part]

The down projections are replicated over tp (each rank makes the whole latent; under sequence parallelism
from its own tokens, its gradient then partial); the latents are gathered over the sequence (or enter the
tp region) once, both together, and the up projections are column-parallel by head from them, the output
projection row-parallel. The rotary parts turn by --qk-pos-emb-head-dim channels (interleaved pairs with
--rotary-interleaved, as DeepSeek's checkpoints are laid out).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from models.attention import AttentionCore, LayerInputs
from models.config import GPTConfig
from models.norms import build_norm
from models.rotary import apply_rotary
from parallel.comm import AxisGroup
from parallel.tensor.layers import (LinearWeights, RowParallelLinear, deferring_linear, replicated_linear,
                                    shard_parameter)
from parallel.tensor.mappings import copy_to_tensor_parallel, gather_from_sequence_parallel
from parallel.tensor.random import RNGTracker
from parallel.tensor.weight_grad import WeightGradStore
from parallel.tensor.weight_init import WeightInit


class LatentAttention(AttentionCore):
    """Causal multi-head latent attention over this rank's heads (``heads / tp``).

    Owns the down projections (``q_down`` [q_lora_rank, h] or none, ``kv_down`` [kv_lora_rank + rope, h],
    replicated over tp, declared partial under sequence parallelism), the latent norms (partial over tp:
    a rank's heads see only their share), this rank's slices of ``q_up`` (or ``q_proj``) and ``kv_up``
    (whole heads, each head's rows [qk | rope] and [qk | v]) and of the output projection ``proj``. Under
    context parallelism the query/key and value widths are padded with zeros to one width (the scores
    and the output are unchanged) so every cp attention kind can carry them. It never holds other
    ranks' heads. ``weight_grads`` (``parallel.tensor.layers.defer_weight_gradients``), when set, lets a split
    backward defer the projections' weight products.
    """

    weight_grads: WeightGradStore | None = None

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 rng: RNGTracker):
        super().__init__(config, layer, rng)
        h, std = config.hidden_size, config.init_method_std
        heads = config.num_attention_heads
        self.tp, self.split = tp, sequence_parallel and tp.size > 1
        self.heads_per_rank = heads // tp.size
        self.nope, self.rope, self.value = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_rank, self.q_rank = config.kv_lora_rank, config.q_lora_rank
        self.rotary_interleaved = config.rotary_interleaved
        bias = not config.disable_bias_linear
        name = f"layers.{layer}.attention"

        def replicated(part: str, rows: int) -> LinearWeights:
            init = WeightInit(seed, f"{name}.{part}.weight", std)
            return replicated_linear(init, rows, h, self.split, bias)

        def by_head(part: str, rows: int, columns: int) -> LinearWeights:
            init = WeightInit(seed, f"{name}.{part}.weight", std)
            return LinearWeights(shard_parameter(lambda: init.full((rows, columns)), 0, tp),
                                 shard_parameter(lambda: torch.zeros(rows), 0, tp) if bias else None)

        query_rows = heads * (self.nope + self.rope)
        latent_norms = replace(config, layernorm_epsilon=config.latent_norm_epsilon
                               or config.layernorm_epsilon)  # (--latent-norm-epsilon, else the model's)
        if self.q_rank is None:
            self.q_down = self.q_latent_norm = None
            self.q_proj = by_head("q_proj", query_rows, h)
        else:
            self.q_down = replicated("q_down", self.q_rank)
            self.q_latent_norm = build_norm(latent_norms, self.q_rank, partial_gradient=tp.size > 1)
            self.q_up = by_head("q_up", query_rows, self.q_rank)
        self.kv_down = replicated("kv_down", self.kv_rank + self.rope)
        self.kv_latent_norm = build_norm(latent_norms, self.kv_rank, partial_gradient=tp.size > 1)
        self.kv_up = by_head("kv_up", heads * (self.nope + self.value), self.kv_rank)
        self.up_runner = None  # how the part after the latents runs when it is recomputed
        self.proj = RowParallelLinear(heads * self.value, h, tp,
                                      WeightInit(seed, f"{name}.proj.weight", std)
                                      .scaled_for_residual(config.residual_branches), bias=bias,
                                      sequence_parallel=sequence_parallel)

    def clip_factors(self, max_logits: torch.Tensor, threshold: float, alpha: float) -> dict:
        """Kimi K2's QK-clip per head: eta = min(threshold / the head's largest logit, 1); the query's
        compressed rows x eta^alpha and rotary rows x eta, the key's compressed rows (in ``kv_up``)
        x eta^(1 - alpha); the shared rotary key and the values untouched. {weight: a factor per row}, or {}
        when no head is over ``threshold``."""
        if not bool((max_logits > threshold).any()):
            return {}
        eta = torch.clamp(threshold / max_logits, max=1.0).view(-1, 1).cpu()
        query = torch.cat([eta.pow(alpha).expand(-1, self.nope), eta.expand(-1, self.rope)], dim=1)
        keys = torch.cat([eta.pow(1 - alpha).expand(-1, self.nope), torch.ones(len(eta), self.value)], dim=1)
        query_weight = (self.q_proj if self.q_down is None else self.q_up).weight
        return {query_weight: query.reshape(-1), self.kv_up.weight: keys.reshape(-1)}

    def _linear(self, x: torch.Tensor, linear: LinearWeights) -> torch.Tensor:
        return deferring_linear(x, linear.weight, linear.bias, self.weight_grads)

    def deferred_weights(self) -> list[torch.nn.Parameter]:
        """The projections' weights but ``proj``'s (a layer of its own), whose gradients a split backward
        defers (``weight_grads``)."""
        projections = (getattr(self, name, None) for name in ("q_down", "q_proj", "q_up", "kv_down", "kv_up"))
        return [linear.weight for linear in projections if linear is not None]

    def _entered(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as every tp rank's heads read it: gathered over the sequence under sequence parallelism
        (gradients reduce-scattered back), else as is (gradients summed over tp)."""
        if self.split:
            return gather_from_sequence_parallel(x, self.tp)
        return copy_to_tensor_parallel(x, self.tp)

    def _turned(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        return x if inputs.rotary is None else apply_rotary(x, *inputs.rotary, self.rotary_interleaved)

    def recompute_up_with(self, runner) -> None:
        """Run everything after the latents through ``runner(compute, q_source, kv_latent, inputs)``
        (--recompute-modules mla_up_proj: the up projections, rotary and the core, from the latents)."""
        self.up_runner = runner

    def forward(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        kv_latent = self._linear(x, self.kv_down)
        if self.q_down is None:
            kv_latent = self._entered(kv_latent)
            q_source = self._entered(x)
        else:
            latents = self._entered(torch.cat([self._linear(x, self.q_down), kv_latent], dim=-1))
            q_source, kv_latent = latents.split([self.q_rank, self.kv_rank + self.rope], dim=-1)
        if self.up_runner is not None:
            context = self.up_runner(self._from_latents, q_source, kv_latent, inputs)
        else:
            context = self._from_latents(q_source, kv_latent, inputs)
        s, b = context.shape[2], context.shape[0]
        return self.proj(context.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.value))

    def _from_latents(self, q_source: torch.Tensor, kv_latent: torch.Tensor,
                      inputs: LayerInputs) -> torch.Tensor:
        """The attention core's output [b, heads, s, v] from the query's source (its latent, or the layer
        input without one) and the key/value latent with the shared rotary key: what mla_up_proj redoes."""
        if self.q_down is None:
            query = self._linear(q_source, self.q_proj)
        else:
            query = self._linear(self.q_latent_norm(q_source), self.q_up)
        s, b = query.shape[:2]
        query = query.view(s, b, self.heads_per_rank, self.nope + self.rope)
        q_nope, q_rope = query.split([self.nope, self.rope], dim=-1)
        latent, k_rope = kv_latent.split([self.kv_rank, self.rope], dim=-1)
        keys_values = self._linear(self.kv_latent_norm(latent), self.kv_up)
        k_nope, v = keys_values.view(s, b, self.heads_per_rank, self.nope + self.value).split(
            [self.nope, self.value], dim=-1)
        k_rope = self._turned(k_rope.unsqueeze(2), inputs).expand(-1, -1, self.heads_per_rank, -1)
        q = torch.cat([q_nope, self._turned(q_rope, inputs)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        width = self.nope + self.rope
        if inputs.context is not None and width != self.value:  # one width for the cp exchanges
            widest = max(width, self.value)
            q, k, v = (F.pad(t, (0, widest - t.shape[-1])) for t in (q, k, v))
        return self.attended(q, k, v, inputs)[..., :self.value]
