"""megatron-core's HybridModel (0.16.1's ``MambaModel``) on the CPU, for the interop tests' oracle.

megatron-core's Mamba mixer imports mamba-ssm's and causal-conv1d's GPU kernels (and its own Triton
tensor ops, which import triton) at module top; without them it refuses to build. This module stands in
for the three that training uses, in PyTorch, as mamba-ssm computes them:
``mamba_split_conv1d_scan_combined`` (split [z | xBC | dt], SiLU of the causal convolution, the scan with
softplus(dt + dt_bias) and the skip D, gated by SiLU(z); no norm when ``rmsnorm_weight`` is None, as
megatron-core calls it), ``mamba_chunk_scan_combined`` and the gated RMSNorm; the scan and convolution
are this stack's kernels (``models.mamba``, tested against the recurrence). Decode kernels raise. The
rest (projections, the part-major splits, the grouped norm, the layers and their keys) is megatron-core's.
Its GatedDeltaNet runs with ``deterministic_mode`` (its own PyTorch delta rule and convolution) beside a
stand-in of flash-linear-attention's l2norm.
0.16.1 ships no hybrid spec without Transformer Engine: ``hybrid_spec`` is its local twin (the norms keyed
under TE's fused names in torch_dist, as the TE spec saves them), and the stack's final norm, a TE norm
whatever the spec, is swapped for megatron-core's torch norm.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

# megatron-core's MambaMixer fields (Megatron-LM's --mamba-* flags) and GatedDeltaNet's (--linear-*)
MAMBA_FIELDS = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")
GDN_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim")


def install_mamba_stand_ins() -> None:
    """``sys.modules`` entries for the kernel modules megatron-core's mixer imports."""
    if "mamba_ssm" in sys.modules:
        return
    from models.linear_mixing.conv import causal_conv
    from models.mamba.ssd_scan import chunked_scan

    def dt_of(dt, dt_bias, softplus, limit):
        dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
        dt = F.softplus(dt) if softplus else dt
        return dt if tuple(limit) == (0.0, float("inf")) else dt.clamp(min=limit[0], max=limit[1])

    def chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                   seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                   return_final_states=False, return_varlen_states=False, state_dtype=None):
        if (initial_states is not None or return_final_states or return_varlen_states
                or cu_seqlens is not None):
            raise NotImplementedError("stand-in: training and plain prefill only")
        y = chunked_scan(x, dt_of(dt, dt_bias, dt_softplus, dt_limit), A, B, C, chunk_size, D, seq_idx)
        return y if z is None else (y.float() * F.silu(z.float())).to(x.dtype)

    def split_conv_scan(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
                        seq_idx=None, dt_limit=(0.0, float("inf")), return_final_states=False,
                        activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None,
                        outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True, state_dtype=None):
        if (initial_states is not None or return_final_states or rmsnorm_weight is not None
                or outproj_weight is not None or activation not in ("silu", "swish")):
            raise NotImplementedError("stand-in: MambaMixer's training call only")
        heads = D.shape[0]
        headdim = D.shape[1] if D.dim() == 2 else headdim
        b, length, _ = zxbcdt.shape
        inner = heads * headdim
        state = (conv1d_weight.shape[0] - inner) // ngroups // 2
        z, xbc, dt = zxbcdt.split([inner, inner + 2 * ngroups * state, heads], dim=-1)
        xbc = causal_conv(xbc, conv1d_weight[:, None, :], conv1d_bias, seq_idx)  # (SiLU applied)
        x, B, C = xbc.split([inner, ngroups * state, ngroups * state], dim=-1)
        y = chunked_scan(x.reshape(b, length, heads, headdim), dt_of(dt, dt_bias, True, dt_limit), A,
                         B.reshape(b, length, ngroups, state), C.reshape(b, length, ngroups, state),
                         chunk_size, D, seq_idx).reshape(b, length, inner)
        return (y.float() * F.silu(z.float())).to(zxbcdt.dtype)

    class GatedRMSNorm(torch.nn.Module):
        """mamba-ssm's ``layernorm_gated.RMSNorm``: per group of ``group_size`` channels, gated by SiLU(z)
        before or after the norm."""

        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None,
                     dtype=None):
            super().__init__()
            self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
            self.register_parameter("bias", None)

        def forward(self, x, z=None):
            xf = x.float()
            if z is not None and not self.norm_before_gate:
                xf = xf * F.silu(z.float())
            grouped = xf.unflatten(-1, (-1, self.group_size or xf.shape[-1]))
            out = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + self.eps)).flatten(-2)
            out = out * self.weight.float()
            if z is not None and self.norm_before_gate:
                out = out * F.silu(z.float())
            return out.to(x.dtype)

    def conv_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                final_states_out=None, activation=None):
        if activation not in ("silu", "swish") or initial_states is not None or return_final_states:
            raise NotImplementedError("stand-in: SiLU, no states")
        return causal_conv(x.transpose(1, 2), weight[:, None, :], bias, seq_idx).transpose(1, 2)

    def decode_only(*args, **kwargs):
        raise NotImplementedError("stand-in: no decode kernels")

    def module(name, **attributes):
        made = types.ModuleType(name)
        made.__dict__.update(attributes)
        made.__path__ = []
        sys.modules[name] = made

    module("mamba_ssm", __version__="2.2.4")
    module("mamba_ssm.ops")
    module("mamba_ssm.ops.triton")
    module("mamba_ssm.ops.triton.selective_state_update", selective_state_update=decode_only)
    module("mamba_ssm.ops.triton.layernorm_gated", RMSNorm=GatedRMSNorm)
    module("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=chunk_scan,
           mamba_split_conv1d_scan_combined=split_conv_scan)
    module("causal_conv1d", causal_conv1d_fn=conv_fn, causal_conv1d_update=decode_only, __version__="1.5.0")
    module("causal_conv1d.causal_conv1d_varlen", causal_conv1d_varlen_states=decode_only)
    module("megatron.core.inference.contexts.attention_context.triton.tensor_ops",
           tensor_get_slice_after=decode_only, tensor_masked_update=decode_only, tensor_merge=decode_only)

    def l2norm(x, eps=1e-6):  # flash-linear-attention's: x / sqrt(sum x^2 + eps) over the last dim
        return (x.float() * torch.rsqrt(x.float().square().sum(-1, keepdim=True) + eps)).to(x.dtype)

    # (GatedDeltaNet imports both together; with deterministic_mode it runs its own PyTorch delta rule)
    module("fla")
    module("fla.modules")
    module("fla.modules.l2norm", l2norm=l2norm)
    module("fla.ops")
    module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=decode_only)


def hybrid_spec(num_experts: int | None):
    """The hybrid stack's spec with megatron-core's local modules (0.16.1 ships only Transformer Engine's
    and ModelOpt's, both needing TE)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    attention = ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                           submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                              core_attention=DotProductAttention,
                                                              linear_proj=RowParallelLinear))
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                          linear_fc2=RowParallelLinear))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm, mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"})),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"})),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm, mlp=mlp, mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"})),
        moe_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=get_moe_module_spec(use_te=False, num_experts=num_experts or 1, moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add))))


def _layer_norm_linear():
    """Transformer Engine's ``LayerNormColumnParallelLinear`` (RMSNorm) on megatron-core's local linear:
    the norm's weight is the linear's parameter ``layer_norm_weight`` (so keyed in both formats), applied
    to its input first."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        def __init__(self, input_size, output_size, *, config, **kwargs):
            if config.normalization != "RMSNorm":
                raise NotImplementedError("stand-in: RMSNorm only")
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size))
            self.eps, self.centred = config.layernorm_epsilon, config.layernorm_zero_centered_gamma

        def forward(self, x, *args, **kwargs):
            scale = self.layer_norm_weight + 1 if self.centred else self.layer_norm_weight
            normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * scale
            return super().forward(normed, *args, **kwargs)

    return LayerNormColumnParallelLinear


def gdn_layer_spec():
    """Megatron-LM main's ``G`` layer (its hybrid stack's ``gdn_layer``): a TransformerLayer whose
    self_attention is megatron-core's GatedDeltaNet, its pre-norm fused into in_proj, no MLP."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=_layer_norm_linear(), out_norm=WrappedTorchNorm, out_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))


def hybrid_chunk(config, arch: dict, vocab: int, sequence: int, pre_process: bool, post_process: bool):
    """megatron-core's MambaModel of ``config`` (a TransformerConfig with the Mamba fields) and the
    pattern ``arch`` names (its hybrid_override_pattern), this pipeline rank's stage of it. 0.16.1's stack
    knows no ``G``: it is built as attention there, and that layer replaced by Megatron-LM main's
    ``gdn_layer`` (which its stack calls as it calls attention layers)."""
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.ssm import mamba_block
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    mamba_block.TENorm = WrappedTorchNorm  # (the stack's final norm is TE's whatever the spec)
    pattern = arch["hybrid_override_pattern"]
    model = MambaModel(config, hybrid_spec(arch.get("num_experts")), vocab_size=vocab,
                       max_sequence_length=sequence, hybrid_override_pattern=pattern.replace("G", "*"),
                       pre_process=pre_process, post_process=post_process,
                       position_embedding_type=arch["position_embedding_type"],
                       share_embeddings_and_output_weights=not arch["untie_embeddings_and_output_weights"])
    layers = model.decoder.layers
    for index, layer in enumerate(layers):
        if pattern[layer.layer_number - 1] == "G":  # (layer_number: global, from 1; a TransformerLayer
            layers[index] = build_module(gdn_layer_spec(), config=config, layer_number=index + 1)  # adds
    return model  # its stage's offset itself)
