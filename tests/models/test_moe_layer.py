"""The MoE layer in one process: its output is the routed experts' weighted sum computed token by token,
the grouped product equals the loop, and --moe-layer-freq is read without executing anything."""

import pytest
import torch
import torch.nn.functional as F

from models.config import GPTConfig
from models.mlp import activate
from models.moe.config import parse_layer_freq
from models.moe.layer import MoELayer
from models.moe.balancing import LoadBalancing
from models.moe.router import route
from parallel.comm import DetachedGroup
from parallel.experts import ExpertGroups

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
              num_experts=4, moe_router_topk=2, swiglu=True, ffn_hidden_size=32, moe_ffn_hidden_size=16,
              moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True, moe_aux_loss_coeff=1e-2,
              moe_z_loss_coeff=1e-3)


def _layer(**changes) -> MoELayer:
    config = GPTConfig(**{**CONFIG, **changes})
    return MoELayer(config, 0, DetachedGroup("tp", 1), 7, False, ExpertGroups.detached(), LoadBalancing())


def _by_token(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Each token through each of its chosen experts alone, weighted and summed, plus the gated shared
    expert: the layer's meaning, with no grouping, permutation or dispatch."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, chosen = route(F.linear(tokens, layer.router.weight), layer.options)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for e in chosen[t].nonzero().flatten().tolist():
            expert = layer.experts.get_submodule(str(e))
            fc1 = F.linear(tokens[t], expert.fc1.weight.flatten(0, -2), expert.fc1.bias.flatten())
            hidden = activate(fc1, "swiglu")
            out[t] += weights[t, e] * F.linear(hidden, expert.fc2.weight, expert.fc2.bias)
    shared = layer.shared_experts(x) * torch.sigmoid(F.linear(x, layer.shared_gate.weight))
    return out.view_as(x) + shared


@pytest.mark.parametrize("grouped", [False, True])
def test_the_layer_is_the_routed_experts_weighted_sum_token_by_token(grouped):
    torch.manual_seed(0)
    layer = _layer(moe_grouped_gemm=grouped)
    for expert in layer.experts.children():  # biases that are not zero, so that each one counts
        for linear in (expert.fc1, expert.fc2):
            torch.nn.init.normal_(linear.bias)
    x = torch.randn(8, 2, 32)
    torch.testing.assert_close(layer(x), _by_token(layer, x), rtol=1e-5, atol=1e-6)


def test_the_grouped_product_equals_the_loop_forward_and_backward():
    torch.manual_seed(1)
    loop, grouped = _layer(), _layer(moe_grouped_gemm=True)
    x = torch.randn(8, 2, 32)
    outs = []
    for layer in (loop, grouped):
        leaf = x.clone().requires_grad_()
        layer.balancing.gradient_scale = 0.5
        (layer(leaf) ** 2).sum().backward()
        outs.append([leaf.grad] + [p.grad for p in layer.parameters()])
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert set(loop.balancing.losses) == {"aux_loss", "z_loss"}


def test_the_balancing_losses_reach_the_router_at_the_gradient_scale():
    """The router's gradient from the layer with its balancing losses attached at scale s equals the output's
    gradient plus s times the losses' own gradient."""
    torch.manual_seed(2)
    layer = _layer()
    x = torch.randn(8, 2, 32)
    layer.balancing.gradient_scale = 0.25
    layer(x).sum().backward()
    attached = layer.router.weight.grad.clone()
    layer.router.weight.grad = None
    plain = _layer(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    plain.load_state_dict(layer.state_dict())
    plain(x).sum().backward()
    losses = layer._balancing_loss(F.linear(x.reshape(-1, 32), layer.router.weight), local_length=8)
    (0.25 * losses).backward()
    torch.testing.assert_close(attached, plain.router.weight.grad + layer.router.weight.grad,
                               rtol=1e-5, atol=1e-8)


def test_layer_freq_reads_megatrons_lists_and_executes_nothing():
    assert parse_layer_freq("2") == 2
    assert parse_layer_freq("([0]+[1]*3)*2") == [0, 1, 1, 1, 0, 1, 1, 1]
    assert parse_layer_freq("[1,0]") == [1, 0]
    assert GPTConfig(**{**CONFIG, "num_layers": 4, "moe_layer_freq": "2"}).moe_layers(4) == [True, False,
                                                                                             True, False]
    for bad in ("__import__('os').system('true')", "[1]*10**9", "[1]*1000000", "[0.5, 1]", "x"):
        with pytest.raises(ValueError, match="--moe-layer-freq"):
            parse_layer_freq(bad)
    with pytest.raises(ValueError, match="one 0/1 per layer"):
        GPTConfig(**{**CONFIG, "moe_layer_freq": "[1,1,1]"}).validate()
