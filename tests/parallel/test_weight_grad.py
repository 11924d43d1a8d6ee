"""The split backward of the zero-bubble schedules (``parallel.tensor.weight_grad``): B gives the input's
gradient and accumulates nothing; W gives every parameter the gradient a whole backward gives, through
autograd's accumulation (its hooks run then, once per parameter), with the linear layers' products
computed only in W."""

import pytest
import torch

from models.config import GPTConfig
from models.gpt import GPTModel
from parallel.buffer_pool import BufferPool
from parallel.comm import AxisGroup, CommStats
from parallel.recompute import RecomputePolicy, apply_recompute
from parallel.tensor.layers import defer_weight_gradients
from parallel.tensor.weight_grad import WeightGradStore
from tests.parity import ONE_STEP_RTOL, assert_tensors_close


def _model(recompute: RecomputePolicy | None) -> GPTModel:
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                       hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                       normalization="RMSNorm", swiglu=True, ffn_hidden_size=48)
    tp = AxisGroup("tp", (0,), None, CommStats())
    model = GPTModel(config, tp, seed=3, pre_process=False)  # takes a hidden input, ends in the loss
    if recompute is not None:
        apply_recompute(torch.nn.ModuleList([model]), recompute, tp, BufferPool())
    return model


POLICIES = {"no recompute": None, "full": RecomputePolicy("full"),
            "selective": RecomputePolicy("selective", modules=("core_attn", "mlp", "layernorm"))}


@pytest.mark.parametrize("policy", POLICIES)
def test_the_split_backward_gives_a_whole_backwards_gradients_and_accumulates_only_in_w(policy, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(16, 2, 32, generator=generator)
    labels = torch.randint(0, 64, (2, 16), generator=generator)
    positions = torch.arange(16).expand(2, 16)

    whole = _model(POLICIES[policy])
    x = hidden.clone().requires_grad_()
    whole(None, positions, labels=labels, hidden=x).sum().backward()
    want = {name: p.grad for name, p in whole.named_parameters()}

    split = _model(POLICIES[policy])
    store = WeightGradStore()
    store.deferring |= defer_weight_gradients(split, store)
    products = []
    original = store.defer
    monkeypatch.setattr(store, "defer", lambda param, compute: products.append(param) or original(param,
                                                                                               compute))
    arrived = []
    for name, param in split.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: arrived.append(name))
    y = hidden.clone().requires_grad_()
    parameters = list(split.parameters())[::-1]
    input_grad = store.input_pass((0, 0), split(None, positions, labels=labels, hidden=y).sum(), None, y,
                                  parameters)
    assert_tensors_close([input_grad], [x.grad], f"{policy}: the input's gradient", ONE_STEP_RTOL)
    assert not arrived and all(p.grad is None for p in split.parameters())
    # every linear layer's weight (q/k/v, projection, fc1, fc2 per layer and the output layer) deferred
    linear = {id(p) for name, p in split.named_parameters() if name.endswith("weight") and "norm" not in name}
    assert {id(p) for p in products} == linear and len(products) == 9

    store.weight_pass((0, 0))
    assert store.pending() == 0
    assert sorted(arrived) == sorted(want) and len(arrived) == len(want)  # once each, all in W
    assert_tensors_close([p.grad for _, p in split.named_parameters()], list(want.values()),
                         f"{policy}: the weights' gradients", ONE_STEP_RTOL)
