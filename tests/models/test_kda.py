"""The Kimi delta attention layer on its own: one mixer against transformers' Kimi Linear
``KimiLinearDeltaAttention`` (its PyTorch path), its parameter count and initial values, and what cannot be
written refused in one line. (Its rule, the delta rule with a decay per channel, is tested against the
recurrence in tests/models/test_gdn.py.)"""

import pytest
import torch

from models.config import GPTConfig
from models.counting import num_parameters
from models.gpt import GPTModel
from models.kda.mixer import KimiDeltaAttention
from models.linear_mixing.layout import group_major
from parallel.comm import AxisGroup, CommStats

HEADS, WIDTH = 4, 8
KDA = dict(hidden_size=32, num_attention_heads=4, vocab_size=100, linear_num_value_heads=HEADS,
           linear_value_head_dim=WIDTH, normalization="RMSNorm", layernorm_epsilon=1e-6)


def _alone() -> AxisGroup:
    return AxisGroup("tp", (0,), None, CommStats())


def test_mixer_equals_transformers_kimi_delta_attention():
    """Our mixer with transformers' weights (its q, k, v and b projections joined head by head into our
    in_proj, its convolution's part-major channels made head-major) gives its output and the gradients of
    its projections, the low-rank decay's included."""
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    theirs_config = KimiLinearConfig(
        hidden_size=32, num_attention_heads=4, vocab_size=100, num_hidden_layers=1, rms_norm_eps=1e-6,
        pad_token_id=0, bos_token_id=0, eos_token_id=1,
        linear_attn_config={"num_heads": HEADS, "head_dim": WIDTH, "short_conv_kernel_size": 4,
                            "kda_layers": [1], "full_attn_layers": []})
    torch.manual_seed(0)
    theirs = KimiLinearDeltaAttention(theirs_config, 0)
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    ours = KimiDeltaAttention(GPTConfig(hybrid_layer_pattern="K", **KDA), 0, _alone(), 0, False)
    rows = [t.view(HEADS, -1, 32) for t in (theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight,
                                            theirs.b_proj.weight)]
    pairs = {ours.f_down.weight: theirs.forget_gate.f_a_proj.weight,
             ours.f_up.weight: theirs.forget_gate.f_b_proj.weight, ours.g_down.weight: theirs.g_a_proj.weight,
             ours.g_up.weight: theirs.g_b_proj.weight, ours.dt_bias: theirs.forget_gate.dt_bias,
             ours.out_norm.weight: theirs.o_norm.weight, ours.out_proj.weight: theirs.o_proj.weight}
    with torch.no_grad():
        ours.in_proj.weight.copy_(torch.cat(rows, dim=1).flatten(0, 1))
        ours.conv1d.weight.copy_(theirs.conv1d.weight[group_major([HEADS * WIDTH] * 3, HEADS)])
        ours.A_log.copy_(theirs.forget_gate.A_log.flatten())
        for mine, wanted in pairs.items():
            mine.copy_(wanted)
    x = torch.randn(2, 21, 32)  # [b, s, h]
    want = theirs(x)
    got = ours(x.transpose(0, 1).contiguous()).transpose(0, 1)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    want.square().sum().backward()
    got.square().sum().backward()
    grad = ours.in_proj.weight.grad.view(HEADS, -1, 32)
    checked = {grad[:, :WIDTH].flatten(0, 1): theirs.q_proj.weight.grad,
               grad[:, -1]: theirs.b_proj.weight.grad,
               ours.f_down.weight.grad: theirs.forget_gate.f_a_proj.weight.grad,
               ours.g_up.weight.grad: theirs.g_b_proj.weight.grad}
    for mine, wanted in checked.items():
        assert (mine - wanted).abs().max() <= 1e-5 * wanted.abs().max()


def test_parameter_count_initial_values_and_what_megatron_cannot_hold(tmp_path):
    from pretrain.checkpoint.foreign.megatron_export import write_megatron

    config = GPTConfig(hybrid_layer_pattern="K*K-", **{**KDA, "hidden_size": 64})
    with pytest.raises(ValueError, match="Megatron-LM has no Kimi delta attention layer"):
        write_megatron(None, config, {}, str(tmp_path), "torch")
    model = GPTModel(config, _alone(), seed=0)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)
    mixer = model.layers[0].kda
    A = torch.exp(mixer.A_log)
    assert A.shape == (HEADS,) and 1 <= A.min() and A.max() <= 16
    assert torch.equal(mixer.dt_bias, torch.ones(HEADS * WIDTH))
    assert mixer.conv1d.weight.shape == (3 * HEADS * WIDTH, 1, 4) and mixer.conv1d.weight.abs().max() <= 0.5
    for weight, std in ((mixer.out_proj.weight, 0.02 / 2), (mixer.in_proj.weight, 0.02)):
        assert abs(weight.std().item() / std - 1) < 0.15
