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


# a dense layer, then a MoE layer (top-2 of 4 experts and a shared expert) under latent attention
MOE_LATENT = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1], moe_ffn_hidden_size=24,
                  moe_shared_expert_intermediate_size=24, moe_aux_loss_coeff=1e-2,
                  multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
                  qk_pos_emb_head_dim=4, v_head_dim=8)


def _model(recompute: RecomputePolicy | None, first: bool, **features) -> GPTModel:
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                       hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                       normalization="RMSNorm", swiglu=True, ffn_hidden_size=48, **features)
    tp = AxisGroup("tp", (0,), None, CommStats())
    model = GPTModel(config, tp, seed=3, pre_process=first)  # reads tokens (first) or a hidden input
    if recompute is not None:
        apply_recompute(torch.nn.ModuleList([model]), recompute, tp, BufferPool())
    return model


POLICIES = {"no recompute": None, "full": RecomputePolicy("full"),
            "selective": RecomputePolicy("selective", modules=("core_attn", "mlp", "layernorm"))}
# model: (features, the chunk reads tokens, products deferred: GPT: q/k/v, projection, fc1, fc2 per layer
# and the output layer (and the embedding's table); MoE under latent attention: per layer q_down, q_up,
# kv_down, kv_up and proj, the dense layer's fc1 and fc2, the 4 experts' and the shared expert's fc1 and fc2,
# the output layer)
MODELS = {"GPT": ({}, False, 9),
          "GPT with the embedding, untied": ({"untie_embeddings_and_output_weights": True}, True, 10),
          "MoE under latent attention": (MOE_LATENT, False, 2 * 5 + 2 + 5 * 2 + 1)}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", MODELS)
def test_the_split_backward_gives_a_whole_backwards_gradients_and_accumulates_only_in_w(model, policy,
                                                                                         monkeypatch):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(16, 2, 32, generator=generator)
    labels = torch.randint(0, 64, (2, 16), generator=generator)
    positions = torch.arange(16).expand(2, 16)

    features, first, deferred = MODELS[model]
    tokens = torch.randint(0, 64, (2, 16), generator=generator) if first else None
    whole = _model(POLICIES[policy], first, **features)
    x = None if first else hidden.clone().requires_grad_()
    whole(tokens, positions, labels=labels, hidden=x).sum().backward()
    want = {name: p.grad for name, p in whole.named_parameters()}

    split = _model(POLICIES[policy], first, **features)
    store = WeightGradStore()
    store.deferring |= defer_weight_gradients(split, store)
    products = []
    original = store.defer
    monkeypatch.setattr(store, "defer", lambda param, *rest: products.append(param) or original(param, *rest))
    arrived = []
    for name, param in split.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: arrived.append(name))
    y = None if first else hidden.clone().requires_grad_()
    parameters = list(split.parameters())[::-1]
    input_grad = store.input_pass((0, 0), split(tokens, positions, labels=labels, hidden=y).sum(), None, y,
                                  parameters)
    if not first:
        assert_tensors_close([input_grad], [x.grad], f"{policy}: the input's gradient", ONE_STEP_RTOL)
    assert not arrived and all(p.grad is None for p in split.parameters())
    assert store.held_storages((0, 0))  # the products' operands wait for W
    # every product's weight deferred but the router's (its product is small, computed in B)
    linear = {id(p) for name, p in split.named_parameters()
              if name.endswith("weight") and not any(part in name for part in ("norm", "router"))}
    assert {id(p) for p in products} == linear and len(products) == deferred

    store.weight_pass((0, 0))
    assert store.pending() == 0
    assert sorted(arrived) == sorted(want) and len(arrived) == len(want)  # once each, all in W
    assert_tensors_close([p.grad for _, p in split.named_parameters()], list(want.values()),
                         f"{policy}: the weights' gradients", ONE_STEP_RTOL)
