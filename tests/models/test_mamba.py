"""The Mamba-2 layer on its own: the chunked scan against the recurrence it computes, the convolution's
document resets, one mixer against transformers' NemotronH mixer (its PyTorch path), megatron-core's
initial laws, and a pattern of attention and MLP layers against the GPT of the same weights."""

import math

import pytest
import torch
import torch.nn.functional as F

from models.config import GPTConfig
from models.counting import num_parameters
from models.gpt import GPTModel
from models.linear_mixing.conv import causal_conv
from models.linear_mixing.layout import to_group_major, to_part_major
from models.mamba.layout import group_major_channels, group_major_rows
from models.mamba.mixer import MambaMixer
from models.mamba.ssd_scan import chunked_scan, recurrent_scan
from parallel.comm import AxisGroup, CommStats
from tests.models.exact import assert_near, with_gradients
from tests.parity import NO_DROPOUT


def _alone() -> AxisGroup:
    return AxisGroup("tp", (0,), None, CommStats())


def _scan_inputs(length: int, groups: int, dtype: torch.dtype, documents: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, heads, p, n = 2, 4, 3, 5
    x = torch.randn(b, length, heads, p, generator=g, dtype=dtype)
    dt = F.softplus(torch.randn(b, length, heads, generator=g, dtype=dtype))
    A = -(torch.rand(heads, generator=g, dtype=dtype) + 0.5)
    B, C = (torch.randn(b, length, groups, n, generator=g, dtype=dtype) for _ in range(2))
    D = torch.randn(heads, generator=g, dtype=dtype)
    docs = torch.sort(torch.randint(0, 4, (b, length), generator=g), dim=1).values if documents else None
    return [t.requires_grad_() for t in (x, dt, A, B, C, D)], docs


@pytest.mark.parametrize("length, chunk, groups, documents", [
    (1, 1, 1, False), (5, 64, 2, False), (17, 3, 2, True), (17, 8, 1, False), (130, 64, 2, True),
    (130, 8, 1, False)])
def test_chunked_scan_equals_the_recurrence_forward_and_backward(length, chunk, groups, documents):
    """Any chunk size, ragged lengths (not multiples of the chunk), documents: in fp64 the chunked scan
    is the recurrence to rounding (the same algebra); in fp32 the chunked scan is within 1e-6 of that
    value, output and every gradient (not of the fp32 recurrence: tests/models/exact.py)."""
    inputs, docs = _scan_inputs(length, groups, torch.float32, documents)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    upstream = torch.randn(2, length, 4, 3, generator=torch.Generator().manual_seed(9))

    def values(tensors, chunking=None):
        x, dt, A, B, C, D = tensors
        out = (recurrent_scan(x, dt, A, B, C, D, docs) if chunking is None
               else chunked_scan(x, dt, A, B, C, chunking, D, docs))
        return with_gradients(out, tensors, upstream)

    names = ("y", "dx", "ddt", "dA", "dB", "dC", "dD")
    truth = values(exact)
    assert_near(values(exact, chunk), truth, 1e-12, names, "chunked fp64")
    assert_near(values(inputs, chunk), truth, 1e-6, names, "chunked fp32")


def test_a_document_starts_from_a_zero_state_and_clean_convolution_taps():
    """Two documents packed in one row give what each gives alone (scan and convolution)."""
    (x, dt, A, B, C, D), _ = _scan_inputs(12, 2, torch.float64, False)
    documents = torch.tensor([[0] * 5 + [1] * 7] * 2)
    packed = chunked_scan(x, dt, A, B, C, 4, D, documents)
    alone = [chunked_scan(x[:, s], dt[:, s], A, B[:, s], C[:, s], 4, D) for s in (slice(0, 5), slice(5, 12))]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=0, atol=1e-12)
    channels = torch.randn(2, 12, 6, dtype=torch.float64)
    weight, bias = torch.randn(6, 1, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    packed = causal_conv(channels, weight, bias, documents)
    alone = [causal_conv(channels[:, s], weight, bias) for s in (slice(0, 5), slice(5, 12))]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=0, atol=1e-12)
    torch.testing.assert_close(causal_conv(channels, weight, bias, torch.zeros(2, 12)),
                               causal_conv(channels, weight, bias), rtol=0, atol=1e-12)


MAMBA = dict(hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100, mamba_head_dim=8,
             mamba_num_groups=2, mamba_state_dim=16, mamba_chunk_size=8, normalization="RMSNorm",
             position_embedding_type="rope", **NO_DROPOUT)


def test_mixer_equals_transformers_nemotron_h_mixer():
    """Our mixer with transformers' weights (its part-major rows made group-major) gives its output and,
    back through the inverse order, its input projection's gradient."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    config = GPTConfig(hybrid_layer_pattern="M", **MAMBA)
    theirs_config = NemotronHConfig(hidden_size=32, mamba_num_heads=config.mamba_heads, mamba_head_dim=8,
                                    n_groups=2, ssm_state_size=16, chunk_size=8, layer_norm_epsilon=1e-5,
                                    layers_block_type=["mamba"], num_hidden_layers=1, vocab_size=100)
    torch.manual_seed(0)
    theirs = NemotronHMamba2Mixer(theirs_config, layer_idx=0)
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    ours = MambaMixer(config, 0, _alone(), seed=0, sequence_parallel=False)
    rows = group_major_rows(config.mamba_inner, 2, 16, config.mamba_heads)
    channels = group_major_channels(config.mamba_inner, 2, 16)
    with torch.no_grad():
        ours.in_proj.weight.copy_(to_group_major(theirs.in_proj.weight, rows))
        ours.conv1d.weight.copy_(to_group_major(theirs.conv1d.weight, channels))
        ours.conv1d.bias.copy_(to_group_major(theirs.conv1d.bias, channels))
        for name in ("A_log", "D", "dt_bias"):
            getattr(ours, name).copy_(getattr(theirs, name))
        ours.norm.weight.copy_(theirs.norm.weight)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
    x = torch.randn(2, 21, 32)  # [b, s, h]; 21 tokens: a ragged last chunk
    theirs.eval()
    want = theirs(x)
    got = ours(x.transpose(0, 1).contiguous()).transpose(0, 1)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    want.square().sum().backward()
    got.square().sum().backward()
    grad = to_part_major(ours.in_proj.weight.grad, rows)
    assert (grad - theirs.in_proj.weight.grad).abs().max() <= 1e-5 * theirs.in_proj.weight.grad.abs().max()


def test_initial_values_follow_megatrons_laws_and_the_parameter_count():
    config = GPTConfig(hybrid_layer_pattern="M*M-", **{**MAMBA, "hidden_size": 64})
    model = GPTModel(config, _alone(), seed=0)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)
    mixer = model.layers[0].mamba
    heads = config.mamba_heads
    A = torch.exp(mixer.A_log)
    dt = F.softplus(mixer.dt_bias)
    assert A.shape == (heads,) and 1 <= A.min() and A.max() <= 16
    assert 1e-3 * (1 - 1e-6) <= dt.min() and dt.max() <= 0.1 * (1 + 1e-6)
    assert torch.equal(mixer.D, torch.ones(heads))
    assert torch.equal(mixer.norm.weight, torch.ones(config.mamba_inner))
    assert mixer.conv1d.weight.abs().max() <= 0.5 and mixer.conv1d.bias.abs().max() <= 0.5  # 1/sqrt(4)
    # the output projections feed the residual stream: std / sqrt(the pattern's 4 layers), not of 2 x 4
    for weight, std in ((mixer.out_proj.weight, 0.02 / 2), (mixer.in_proj.weight, 0.02),
                        (model.layers[3].mlp.fc2.weight, 0.02 / 2)):
        assert abs(weight.std().item() / std - 1) < 0.1


def test_a_pattern_of_attention_and_mlp_layers_is_the_gpt_of_the_same_weights():
    """'*-*-' is two GPT blocks, one layer per sublayer: with the GPT's weights, its logits bit for bit."""
    gpt_config = GPTConfig(num_layers=2, **MAMBA)
    pattern_config = GPTConfig(hybrid_layer_pattern="*-*-", **MAMBA)
    assert pattern_config.num_layers == 4 and pattern_config.residual_branches == gpt_config.residual_branches
    gpt, hybrid = GPTModel(gpt_config, _alone(), seed=0), GPTModel(pattern_config, _alone(), seed=1)
    weights = {}
    for name, value in gpt.state_dict().items():
        parts = name.split(".")
        if parts[0] == "layers":
            parts[1] = str(2 * int(parts[1]) + parts[2].startswith("mlp"))
        weights[".".join(parts)] = value
    hybrid.load_state_dict(weights)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    assert torch.equal(hybrid(tokens, positions), gpt(tokens, positions))
    assert math.isclose(GPTConfig(hybrid_layer_pattern="M*M-", **MAMBA).residual_branches, 4)


def test_muon_steps_the_output_projection_and_leaves_the_fused_input_and_the_taps_to_adamw():
    """As Megatron's Muon: in_proj (z, x, B, C and dt fused) and the convolution take AdamW, out_proj Muon."""
    from pretrain.config.schema import OptimizerConfig
    from pretrain.training.param_groups import parameter_groups

    model = GPTModel(GPTConfig(hybrid_layer_pattern="M-", **MAMBA), _alone(), seed=0)
    names = {id(param): name for name, param in model.named_parameters()}
    groups = parameter_groups(torch.nn.ModuleList([model]), OptimizerConfig(optimizer="muon"))
    muon = {names[id(p)] for group in groups if group["use_muon"] for p in group["params"]}
    assert muon == {"layers.0.mamba.out_proj.weight", "layers.1.mlp.fc1.weight", "layers.1.mlp.fc2.weight"}


def test_each_scan_backend_computes_the_recurrence(monkeypatch):
    """The GPU kernels' calls, made through stand-ins that compute what each library documents (mamba-ssm's
    combined scan with seq_idx; fla's simple GLA: S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t),
    give the recurrence: the argument mapping is right. The reference keeps only its inputs for backward."""
    import sys
    import types

    from models.mamba import kernels
    from parallel.saved_activations import SavedActivationMeter

    def simple_gla(q, k, v, g, scale):
        state = q.new_zeros(q.shape[0], q.shape[2], k.shape[-1], v.shape[-1])
        out = []
        for t in range(q.shape[1]):
            state = torch.exp(g[:, t])[..., None, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
            out.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
        return torch.stack(out, dim=1), None

    def combined(x, dt, A, B, C, chunk, D, seq_idx):
        return recurrent_scan(x, dt, A, B, C, D, seq_idx)

    for name, module, fn in (("mamba_ssm", "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
                             ("fla", "fla.ops.simple_gla", "chunk_simple_gla")):
        stand_in = types.ModuleType(module)
        setattr(stand_in, fn, combined if name == "mamba_ssm" else simple_gla)
        monkeypatch.setitem(sys.modules, module, stand_in)
    (x, dt, A, B, C, D), documents = _scan_inputs(19, 2, torch.float64, True)
    want = recurrent_scan(x, dt, A, B, C, D, documents)
    for backend, docs in (("mamba_ssm", documents), ("fla", None), ("reference", documents)):
        monkeypatch.setenv("SCAN_BACKEND", backend)
        got = kernels.ssd_scan(x, dt, A, B, C, 8, D, docs)
        expected = want if docs is not None else recurrent_scan(x, dt, A, B, C, D)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    meter = SavedActivationMeter()
    with meter.recording():
        y = kernels.ssd_scan(x, dt, A, B, C, 8, D, documents)
    y.sum().backward()
    assert meter.peak_bytes == sum(t.numel() for t in (x, dt, A, B, C, D)) * 8
    monkeypatch.setenv("SCAN_BACKEND", "cuda")
    with pytest.raises(ValueError, match="SCAN_BACKEND=cuda: choose from mamba_ssm, fla, reference"):
        kernels.ssd_scan(x, dt, A, B, C, 8, D)


def test_the_gated_norm_keeps_its_inputs_and_gives_autograds_gradients():
    from models.mamba.gated_norm import GatedRMSNorm

    g = torch.Generator().manual_seed(3)
    y, z = (torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight = torch.randn(12, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b, w: GatedRMSNorm.apply(a, b, w, 1e-5), (y, z, weight))
    gated = y * F.silu(z)
    plain = (gated * torch.rsqrt(gated.square().mean(-1, keepdim=True) + 1e-5)).flatten(-2) * weight
    torch.testing.assert_close(GatedRMSNorm.apply(y, z, weight, 1e-5), plain, rtol=0, atol=1e-14)


def test_flops_and_cache_are_each_layer_kinds():
    """A Mamba layer costs its projections and its convolution and scan (5 I N a token), whatever the
    sequence length, and leaves nothing per token in an inference cache; attention and MLP layers as a GPT
    block's halves."""
    from models.counting import forward_flops_parts, kv_cache_values_per_token

    config = GPTConfig(hybrid_layer_pattern="M*M-", **MAMBA)
    (mamba, attention, _, mlp), _ = forward_flops_parts(config)
    inner, state = config.mamba_inner, config.mamba_state_dim
    assert mamba == (2.0 * 32 * (config.mamba_projection_rows + inner), 2 * 4 * config.mamba_conv_channels
                     + 5 * inner * state)
    assert attention[1] == 2 * 16 * 4 * (8 + 8) and mlp[1] == 0
    assert kv_cache_values_per_token(config) == 2 * 4 * 8  # the one attention layer's keys and values
    longer = GPTConfig(hybrid_layer_pattern="M*M-", **{**MAMBA, "seq_length": 64})
    layers = forward_flops_parts(longer)[0]
    assert layers[0] == mamba and layers[1][1] == 4 * attention[1]  # 4x the sequence: 4x attention's
