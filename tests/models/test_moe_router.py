"""The router's mathematics against megatron-core's own functions (its routing, aux-loss scores, Switch and
z losses, and its sequence-level loss as its router computes it), and the expert-bias rule on a hand-made
case (DeepSeek-V3's)."""

import warnings

import pytest
import torch

from models.moe.router import (RouterOptions, aux_scores, drop_tokens, route, sequence_aux_loss,
                               switch_aux_loss, updated_expert_bias, z_loss)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe import moe_utils

CASES = [  # Megatron's flags: Mixtral / Qwen (softmax after top-k), pre-softmax, DeepSeek-V3 (sigmoid,
    # group-limited, bias, scaling), a top-1
    dict(num_experts=8, topk=2),
    dict(num_experts=8, topk=2, pre_softmax=True, topk_scaling_factor=2.0),
    dict(num_experts=16, topk=4, score_function="sigmoid", num_groups=4, group_topk=2,
         topk_scaling_factor=2.5),
    dict(num_experts=16, topk=4, num_groups=8, group_topk=4),
    dict(num_experts=6, topk=1, score_function="sigmoid"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_routing_and_losses_equal_megatron_cores(case):
    torch.manual_seed(0)
    options = RouterOptions(**case)
    logits = torch.randn(64, options.num_experts, dtype=torch.float32)
    bias = torch.randn(options.num_experts) * 0.1 if options.score_function == "sigmoid" else None
    weights, chosen = route(logits, options, bias)
    theirs_weights, theirs_map = moe_utils.topk_routing_with_score_function(
        logits, options.topk, use_pre_softmax=options.pre_softmax, num_groups=options.num_groups,
        group_topk=options.group_topk, scaling_factor=options.topk_scaling_factor,
        score_function=options.score_function, expert_bias=bias)
    assert torch.equal(chosen, theirs_map) and chosen.sum(dim=1).eq(options.topk).all()
    torch.testing.assert_close(weights, theirs_weights, rtol=1e-6, atol=0)
    scores, aux_map = aux_scores(logits, options)
    theirs_aux_map, theirs_scores = moe_utils.compute_routing_scores_for_aux_loss(
        logits, options.topk, options.score_function)
    assert torch.equal(aux_map, theirs_aux_map)
    torch.testing.assert_close(scores, theirs_scores, rtol=1e-6, atol=0)
    tokens = aux_map.sum(dim=0)
    torch.testing.assert_close(
        switch_aux_loss(scores, tokens, 64, options.topk, 1e-2),
        moe_utils.switch_load_balancing_loss_func(scores, tokens, 64, options.topk, options.num_experts,
                                                  1e-2), rtol=1e-6, atol=0)
    torch.testing.assert_close(z_loss(logits, 1e-3), moe_utils.z_loss_func(logits, 1e-3), rtol=1e-6, atol=0)
    # Megatron's sequence-level loss: tokens [s, b] flattened, each sequence's experts made experts of
    # their own (reshape to [s, b * E]), the Switch loss of that over the batch size
    sequence, batch = 16, 4
    flat_scores, flat_map = scores.reshape(sequence, -1), aux_map.reshape(sequence, -1)
    theirs = moe_utils.switch_load_balancing_loss_func(flat_scores, flat_map.sum(dim=0), sequence,
                                                       options.topk, options.num_experts, 1e-2) / batch
    torch.testing.assert_close(sequence_aux_loss(scores, aux_map, sequence, options.topk, 1e-2), theirs,
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("pad", [False, True])
def test_token_dropping_by_weight_equals_megatron_cores_and_by_position_keeps_the_earliest(pad):
    torch.manual_seed(1)
    options = RouterOptions(num_experts=4, topk=2)
    weights, chosen = route(torch.randn(32, 4), options)
    for factor in (0.5, 1.0, 4.0):
        ours = drop_tokens(weights, chosen, 2, factor, "probs", pad)
        theirs = moe_utils.apply_router_token_dropping(weights, chosen, 2, factor, "probs", pad)
        assert torch.equal(ours[1], theirs[1]) and torch.equal(ours[0], theirs[0]), factor
    # capacity ceil(8 x 1 / 2 x 0.5) = 2 a expert: expert 0 keeps tokens 1 and 2 (of 1, 2, 5), expert 1
    # tokens 0 and 3 (of 0, 3, 6, 7); with padding expert 1 is full and expert 0 too
    hand = torch.zeros(8, 2, dtype=torch.bool)
    hand[[1, 2, 5], 0] = True
    hand[[0, 3, 4, 6, 7], 1] = True
    hand[4, 1] = False
    weights, kept = drop_tokens(hand.float() * 0.5, hand, 1, 0.5, "position", pad)
    assert kept[:, 0].nonzero().flatten().tolist() == [1, 2]
    assert kept[:, 1].nonzero().flatten().tolist() == [0, 3]
    assert torch.equal(weights, kept.float() * 0.5)


def test_the_expert_bias_follows_deepseek_v3s_rule_and_bad_options_are_refused():
    """Four experts got 10, 2, 6, 6 tokens (mean 6): the overloaded one's bias goes down by the rate, the
    underloaded one's up, the two at the mean stay."""
    bias = torch.tensor([0.5, -0.25, 0.0, 1.0])
    updated = updated_expert_bias(torch.tensor([10.0, 2.0, 6.0, 6.0]), bias, 1e-3)
    assert torch.equal(updated, torch.tensor([0.5 - 1e-3, -0.25 + 1e-3, 0.0, 1.0]))
    for options, message in ((dict(num_experts=4, topk=5), "--moe-router-topk 5 must be between"),
                             (dict(num_experts=8, num_groups=3, group_topk=1), "must divide --num-experts"),
                             (dict(num_experts=8, num_groups=4), "go together"),
                             (dict(num_experts=8, score_function="relu"), "choose softmax or sigmoid")):
        with pytest.raises(ValueError, match=message):
            RouterOptions(**options)
