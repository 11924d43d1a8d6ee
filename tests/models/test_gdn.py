"""The gated delta net layer on its own: the chunked delta rule against the recurrence it computes (and
that recurrence against transformers' own), one mixer against transformers' Qwen3-Next gated delta net
(its PyTorch path), megatron-core's initial laws and the parameter count."""

import pytest
import torch
import torch.nn.functional as F

from models.config import GPTConfig
from models.counting import num_parameters
from models.gdn.delta_rule import chunked_delta_rule, recurrent_delta_rule
from models.gdn.mixer import GatedDeltaNet
from models.gpt import GPTModel
from parallel.comm import AxisGroup, CommStats
from tests.models.exact import assert_near, with_gradients

GDN = dict(hidden_size=32, num_attention_heads=4, vocab_size=100, linear_num_key_heads=2,
           linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
           normalization="RMSNorm", layernorm_epsilon=1e-6)

PARTS = ("o", "q", "k", "v", "g", "beta")


def _alone() -> AxisGroup:
    return AxisGroup("tp", (0,), None, CommStats())


def _rule_inputs(length: int, dtype: torch.dtype, documents: bool, decay: float, seed: int = 0,
                 channels: bool = False):
    """q, k L2-normalised, g as the layer makes it (-A softplus(a + dt_bias), A in [1, 16]; with
    ``channels`` one per key channel, as Kimi delta attention's), beta in (0, 1); ``decay`` shifts
    softplus's input (larger: faster forgetting)."""
    g = torch.Generator().manual_seed(seed)
    b, heads, dk, dv = 2, 3, 8, 6
    q, k = (F.normalize(torch.randn(b, length, heads, dk, generator=g, dtype=dtype), dim=-1) for _ in "qk")
    v = torch.randn(b, length, heads, dv, generator=g, dtype=dtype)
    gate_shape = (b, length, heads, dk) if channels else (b, length, heads)
    A = torch.empty(heads, *gate_shape[3:], dtype=dtype).uniform_(1, 16, generator=g)
    log_decay = -A * F.softplus(torch.randn(gate_shape, generator=g, dtype=dtype) + decay)
    beta = torch.sigmoid(torch.randn(b, length, heads, generator=g, dtype=dtype))
    docs = torch.sort(torch.randint(0, 4, (b, length), generator=g), dim=1).values if documents else None
    return [t.requires_grad_() for t in (q, k, v, log_decay, beta)], docs


@pytest.mark.parametrize("length, chunk, documents, decay, channels", [
    (1, 1, False, -2.0, False), (5, 64, False, -2.0, False), (17, 3, True, 1.0, False),
    (17, 16, False, -5.0, False), (130, 64, True, -2.0, False), (130, 16, False, 1.0, False),
    (1, 1, False, -2.0, True), (17, 3, True, 1.0, True), (40, 16, False, -5.0, True),
    (130, 16, True, -2.0, True)])
def test_the_chunked_rule_is_the_recurrence_forward_and_backward(length, chunk, documents, decay, channels):
    """Any chunk size, any length (a ragged last chunk), document resets, a decay per head (gated delta
    nets) or per key channel (Kimi delta attention): in fp64 the chunked rule's output and its gradients
    of q, k, v, g and beta are the recurrence's within 1e-12 of their scale; in fp32 the chunked rule is
    within 1e-6 of that exact value (not of the fp32 recurrence: tests/models/exact.py)."""
    inputs, docs = _rule_inputs(length, torch.float32, documents, decay, length + chunk, channels)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    grad = torch.randn(2, length, 3, 6, generator=torch.Generator().manual_seed(length * chunk))

    def values(rule, tensors, *chunking):
        return with_gradients(rule(*tensors, 8 ** -0.5, *chunking, docs), tensors, grad)

    truth = values(recurrent_delta_rule, exact)
    assert_near(values(chunked_delta_rule, exact, chunk), truth, 1e-12, PARTS, "chunked fp64")
    assert_near(values(chunked_delta_rule, inputs, chunk), truth, 1e-6, PARTS, "chunked fp32")


def test_the_recurrence_is_transformers_and_documents_reset_the_state():
    """Our recurrence is transformers' ``torch_recurrent_gated_delta_rule`` and, with a decay per channel,
    its Kimi Linear ``recurrent_kimi_delta_attention``: theirs, which compute in fp32, within 1e-6 of ours in
    fp64 on the same inputs; and a document's tokens come out as if it were alone."""
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    for channels, theirs_rule, name in ((False, torch_recurrent_gated_delta_rule, "Qwen3-Next"),
                                        (True, recurrent_kimi_delta_attention, "Kimi Linear")):
        inputs, _ = _rule_inputs(23, torch.float32, False, 0.0, channels=channels)
        with torch.no_grad():
            theirs, _ = theirs_rule(*inputs, initial_state=None, output_final_state=False)
            exact = recurrent_delta_rule(*(t.double() for t in inputs), 8 ** -0.5)
        assert_near([theirs], [exact], 1e-6, ["o"], name)
    (q, k, v, g, beta), _ = _rule_inputs(23, torch.float64, False, 0.0)
    documents = (torch.arange(23) >= 9).long()[None].expand(2, -1)
    reset = chunked_delta_rule(q, k, v, g, beta, 8 ** -0.5, 4, documents)
    alone = chunked_delta_rule(*(t[:, 9:] for t in (q, k, v, g, beta)), 8 ** -0.5, 4)
    assert (reset[:, 9:] - alone).abs().max() <= 1e-12 * alone.abs().max()


def test_mixer_equals_transformers_qwen3_next_gated_delta_net():
    """Our mixer with transformers' weights (its q k v z and b a projections per key head are our
    group-major rows; its convolution's part-major channels made group-major) gives its output and its
    input projections' gradients."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = GPTConfig(hybrid_layer_pattern="G", **GDN)
    theirs_config = Qwen3NextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                    linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                    rms_norm_eps=1e-6, num_hidden_layers=1, vocab_size=100,
                                    hidden_act="silu")
    torch.manual_seed(0)
    theirs = Qwen3NextGatedDeltaNet(theirs_config, layer_idx=0)
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    ours = GatedDeltaNet(config, 0, _alone(), seed=0, sequence_parallel=False)
    keys, share, dk, dv = 2, 2, 8, 6
    qkvz = theirs.in_proj_qkvz.weight.unflatten(0, (keys, -1))
    ba = theirs.in_proj_ba.weight.unflatten(0, (keys, -1))
    channels = _group_major_channels(keys, dk, share * dv)
    with torch.no_grad():
        ours.in_proj.weight.copy_(torch.cat([qkvz, ba], dim=1).flatten(0, 1))
        ours.conv1d.weight.copy_(theirs.conv1d.weight[channels])
        ours.A_log.copy_(theirs.A_log)
        ours.dt_bias.copy_(theirs.dt_bias)
        ours.out_norm.weight.copy_(theirs.norm.weight)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
    x = torch.randn(2, 21, 32)  # [b, s, h]
    theirs.eval()
    want = theirs(x)
    got = ours(x.transpose(0, 1).contiguous()).transpose(0, 1)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    want.square().sum().backward()
    got.square().sum().backward()
    grad = ours.in_proj.weight.grad.unflatten(0, (keys, -1))
    width = qkvz.shape[1]
    for mine, wanted in ((grad[:, :width].flatten(0, 1), theirs.in_proj_qkvz.weight.grad),
                         (grad[:, width:].flatten(0, 1), theirs.in_proj_ba.weight.grad)):
        assert (mine - wanted).abs().max() <= 1e-5 * wanted.abs().max()


def _group_major_channels(keys: int, key_dim: int, values: int) -> torch.Tensor:
    """Transformers' (and megatron-core's) convolution channels [q | k | v] -> ours, key head by key head
    [q_j, k_j, v_j]: the part-major channel of each of ours."""
    order = []
    for j in range(keys):
        order += list(range(j * key_dim, (j + 1) * key_dim))
        order += list(range(keys * key_dim + j * key_dim, keys * key_dim + (j + 1) * key_dim))
        order += list(range(2 * keys * key_dim + j * values, 2 * keys * key_dim + (j + 1) * values))
    return torch.tensor(order)


def test_initial_values_follow_megatrons_laws_and_the_parameter_count(tmp_path):
    """And what Megatron has no layer of is refused in one line: a Megatron checkpoint of OLMo hybrid's gated
    delta nets (beta up to 2) and post-norm layers."""
    from pretrain.checkpoint.foreign.megatron_export import write_megatron

    config = GPTConfig(hybrid_layer_pattern="G*G-", **{**GDN, "hidden_size": 64})
    olmo = GPTConfig(hybrid_layer_pattern="G*G-", post_norm_layers=[1], linear_allow_neg_eigval=True,
                     **{**GDN, "hidden_size": 64})
    with pytest.raises(ValueError, match="--to megatron: this model has --post-norm-layers, "
                                         r"--linear-allow-neg-eigval, which megatron-core builds no layer "
                                         "with"):
        write_megatron(None, olmo, {}, str(tmp_path), "torch")
    model = GPTModel(config, _alone(), seed=0)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)
    mixer = model.layers[0].gdn
    A = torch.exp(mixer.A_log)
    assert A.shape == (4,) and 1 <= A.min() and A.max() <= 16
    assert torch.equal(mixer.dt_bias, torch.ones(4)) and torch.equal(mixer.out_norm.weight, torch.ones(6))
    assert mixer.conv1d.weight.shape == (2 * 16 + 24, 1, 4) and mixer.conv1d.weight.abs().max() <= 0.5
    for weight, std in ((mixer.out_proj.weight, 0.02 / 2), (mixer.in_proj.weight, 0.02)):
        assert abs(weight.std().item() / std - 1) < 0.15
