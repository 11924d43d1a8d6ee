"""gpt-oss's model features with Megatron's flags: attention sinks (--softmax-type), the gated quick-GELU
(--quick-geglu, --glu-linear-offset, --activation-func-clamp-value) and the MoE router's bias."""

import pytest
import torch

from models.attention import SelfAttention
from models.config import GPTConfig
from models.gpt import GPTModel
from models.mlp import activate
from parallel.comm import AxisGroup, CommStats, DetachedGroup
from parallel.context import ScoreOptions, attend, sequence_mask
from parallel.tensor.random import RNGTracker
from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate
from tests.models.exact import assert_near, with_gradients
from tests.parity import NO_DROPOUT


def _alone() -> AxisGroup:
    return AxisGroup("tp", (0,), None, CommStats())


def _eager_with_sinks(q, k, v, scale, mask, sinks):
    """transformers' eager gpt-oss attention: keys and values repeated per query head, the fp32 scores
    masked, each head's sink appended as one more column, softmaxed, the column dropped (fp64 inputs: all
    in fp64)."""
    b, heads, s, _ = q.shape
    repeat = heads // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.transpose(-1, -2) * scale).to(wide).masked_fill(~mask, float("-inf"))
    column = sinks.to(wide).view(1, heads, 1, 1).expand(b, heads, s, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


@pytest.mark.parametrize("window, documents", [(None, False), (3, False), (4, True)])
@pytest.mark.parametrize("value_width", [8, 6])
def test_sinks_equal_the_eager_reference_forward_and_backward(window, documents, value_width):
    generator = torch.Generator().manual_seed(0)
    b, heads, groups, s, d = 2, 6, 2, 9, 8
    q = torch.randn(b, heads, s, d, generator=generator).requires_grad_()
    k = torch.randn(b, groups, s, d, generator=generator).requires_grad_()
    v = torch.randn(b, groups, s, value_width, generator=generator).requires_grad_()
    sinks = (2 * torch.randn(heads, generator=generator)).requires_grad_()
    ids = torch.tensor([[0] * 4 + [1] * 5, [0] * 7 + [1] * 2]) if documents else None
    mask = sequence_mask(s, window, ids, q.device)
    scale = d ** -0.5
    out = attend(q, k, v, ScoreOptions(scale, window), mask, sinks=sinks)
    causal = torch.ones(s, s, dtype=torch.bool).tril().view(1, 1, s, s)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    reference = _eager_with_sinks(*exact[:3], scale, causal if mask is None else mask, exact[3])
    assert out.shape == (b, heads, s, value_width)
    weights = torch.randn(out.shape, generator=generator)
    assert_near(with_gradients(out, (q, k, v, sinks), weights), with_gradients(reference, exact, weights),
                1e-6, ("out", "q", "k", "v", "sinks"), "sinks")


def test_a_sink_far_below_every_score_is_vanilla_attention():
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 7, 8, generator=generator) for _ in range(3))
    options = ScoreOptions(8 ** -0.5)
    vanilla = attend(q, k, v, options, None)
    torch.testing.assert_close(attend(q, k, v, options, None, sinks=torch.full((4,), -1e4)), vanilla,
                               rtol=0, atol=1e-6)


CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True,
              num_query_groups=2, seq_length=16, vocab_size=64, position_embedding_type="rope",
              normalization="RMSNorm", window_size=[4, 0], window_attn_skip_freq=[2])


def test_off_by_one_is_a_learnable_sink_at_zero():
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(16).expand(2, 16)
    documents = torch.tensor([[0] * 10 + [1] * 6, [0] * 16])
    learnable = GPTModel(GPTConfig(**CONFIG, softmax_type="learnable", **NO_DROPOUT), _alone(), seed=0)
    off_by_one = GPTModel(GPTConfig(**CONFIG, softmax_type="off-by-one", **NO_DROPOUT), _alone(), seed=0)
    vanilla = GPTModel(GPTConfig(**CONFIG, **NO_DROPOUT), _alone(), seed=0)
    with torch.no_grad():
        for layer in learnable.layers:
            assert layer.attention.sinks.shape == (4,)
            layer.attention.sinks.zero_()
    out = off_by_one(tokens, positions, documents=documents)
    torch.testing.assert_close(learnable(tokens, positions, documents=documents), out, rtol=0, atol=1e-6)
    assert not torch.allclose(vanilla(tokens, positions, documents=documents), out)
    assert not [name for name, _ in off_by_one.named_parameters() if "sinks" in name]


def test_sinks_are_split_across_tensor_parallel_ranks_by_head():
    config = GPTConfig(**CONFIG, softmax_type="learnable")
    whole = SelfAttention(config, 1, DetachedGroup("tp", 1), 5, False, RNGTracker()).sinks
    for rank in range(2):
        tp = type("Rank", (DetachedGroup,), {"rank": rank})("tp", 2)  # rank ``rank`` of 2
        part = SelfAttention(config, 1, tp, 5, False, RNGTracker()).sinks
        assert torch.equal(part, whole[2 * rank:2 * rank + 2])


def _megatron_quick_geglu(y, offset, clamp):
    from megatron.core.fusions.fused_bias_geglu import weighted_bias_quick_geglu_impl
    with torch.compiler.set_stance("force_eager"):  # Megatron fuses it with torch.compile
        return weighted_bias_quick_geglu_impl(y, None, torch.ones(y.shape[0], 1), linear_offset=offset,
                                              clamp_value=clamp)


@pytest.mark.parametrize("offset, clamp", [(0.0, None), (1.0, 7.0), (0.5, 2.0)])
def test_quick_geglu_is_megatrons_forward_and_backward(offset, clamp):
    y = (10 * torch.randn(12, 2 * 16, generator=torch.Generator().manual_seed(3))).requires_grad_()
    if clamp is not None:
        assert (y.abs() > clamp).any()
    ours = activate(y, "quick_geglu", "none", offset, clamp)
    theirs = _megatron_quick_geglu(y, offset, clamp)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(4))
    mine, = torch.autograd.grad((ours * weights).sum(), y)
    with torch.compiler.set_stance("force_eager"):  # its backward is compiled too, when it runs
        wanted, = torch.autograd.grad((theirs * weights).sum(), y)
    torch.testing.assert_close(mine, wanted, rtol=1e-6, atol=1e-6)


GPT_OSS_LIKE = dict(CONFIG, softmax_type="learnable", quick_geglu=True, glu_linear_offset=1.0,
                    activation_func_clamp_value=7.0, num_experts=4, moe_router_topk=2, ffn_hidden_size=32,
                    moe_ffn_hidden_size=16, moe_aux_loss_coeff=1e-2, hidden_dropout=0.0,
                    attention_dropout=0.1)


def test_a_gpt_oss_like_model_trains_every_parameter():
    config = GPTConfig(**GPT_OSS_LIKE)
    assert config.activation == "quick_geglu" and config.gated and config.ffn_size == 32
    model = GPTModel(config, _alone(), seed=0)
    names = dict(model.named_parameters())
    assert names["layers.0.mlp.router.bias"].shape == (4,)
    assert names["layers.1.attention.sinks"].shape == (4,)
    assert names["layers.0.mlp.experts.3.fc1.bias"].shape == (2, 16)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(6))
    documents = torch.tensor([[0] * 9 + [1] * 7] * 4)
    loss = model(tokens, torch.arange(16).expand(4, 16), labels=labels, documents=documents)
    loss.mean().backward()
    missing = [name for name, p in names.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_without_linear_biases_the_router_has_none():
    config = GPTConfig(**{**GPT_OSS_LIKE, "disable_bias_linear": True})
    model = GPTModel(config, _alone(), seed=0)
    assert model.layers[0].mlp.router.bias is None


TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32"]


def test_megatrons_flags_set_the_fields():
    model = parse_config(TINY + ["--softmax-type", "off-by-one", "--quick-geglu", "--glu-linear-offset", "1",
                                 "--activation-func-clamp-value", "7"]).model
    assert (model.softmax_type, model.activation, model.glu_linear_offset,
            model.activation_func_clamp_value) == ("off-by-one", "quick_geglu", 1.0, 7.0)


@pytest.mark.parametrize("fields, message", [
    (dict(glu_linear_offset=1.0), "--glu-linear-offset acts on a gated MLP"),
    (dict(activation_func_clamp_value=7.0, squared_relu=True), "--activation-func-clamp-value acts on"),
    (dict(activation_func_clamp_value=-1.0, quick_geglu=True), "--activation-func-clamp-value must be > 0"),
    (dict(quick_geglu=True, swiglu=True), "--swiglu, --geglu, --quick-geglu and --squared-relu"),
    (dict(softmax_type="learnable", multi_latent_attention=True), "--softmax-type learnable: latent"),
])
def test_bad_combinations_name_the_flag(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
                  **fields).validate()


def test_sinks_under_context_parallelism_are_refused():
    config = parse_config(TINY + ["--softmax-type", "learnable", "--context-parallel-size", "2"])
    with pytest.raises(ConfigError, match="--softmax-type learnable with --context-parallel-size 2"):
        validate(config, 2)
    validate(parse_config(TINY + ["--softmax-type", "learnable"]), 2)
