"""Activation checkpointing: exact recomputation (dropout included) and the activation bytes it saves."""

import contextlib

import pytest
import torch

from models.config import GPTConfig
from models.gpt import GPTModel
from models.mtp.depth import depth_batch
from parallel.buffer_pool import BufferPool
from parallel.recompute import RecomputePolicy, apply_recompute
from parallel.process_groups import create_process_groups
from parallel.saved_activations import SavedActivationMeter
from parallel.topology import Topology
from tests.parity import NO_DROPOUT, ONE_STEP_RTOL, assert_within
from tests.world import run_world

POLICIES = [RecomputePolicy("full"), RecomputePolicy("full", 2, "uniform"),
            RecomputePolicy("full", 1, "block"),
            RecomputePolicy("selective"), RecomputePolicy("full", partition=True),
            RecomputePolicy("full", 1, "block", partition=True, offload=True),
            RecomputePolicy("selective", partition=True)]


# a model with two prediction depths: their layers recomputed as the model's (checkpointed per depth, or
# selectively); the exactness under dropout shows each depth's recompute replays its own random draws
MTP_POLICIES = [RecomputePolicy("full", 1, "uniform"), RecomputePolicy("selective")]
# DeepSeek-V3's parts at a small size: latent attention, a dense first layer, then routed experts with a
# shared one; its selective modules beside the dense ones'
MOE_LATENT = dict(num_layers=3, num_experts=4, moe_layer_freq="[0,1,1]", moe_ffn_hidden_size=32,
                  moe_shared_expert_intermediate_size=32, swiglu=True, multi_latent_attention=True,
                  q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12,
                  position_embedding_type="rope", normalization="RMSNorm")
MOE_LATENT_POLICIES = [*(RecomputePolicy("selective", modules=(name,))
                         for name in ("mla_up_proj", "moe_act", "shared_experts")),
                       RecomputePolicy("selective", modules=("mla_up_proj", "core_attn", "layernorm", "mlp",
                                                             "moe"))]


def _loss_and_grads(tp, policy, dropout, meter=None, depths_kept=False, **shape):
    """(loss, gradients) of a tiny GPT under ``policy``; ``depths_kept``: its prediction depths' layers
    then run without it."""
    config = GPTConfig(**{**dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                                 vocab_size=128, hidden_dropout=dropout, attention_dropout=dropout), **shape})
    model = GPTModel(config, tp, seed=0)
    apply_recompute(torch.nn.ModuleList([model]), policy, tp)
    for depth in model.mtp if depths_kept else ():
        depth.recompute_layers_with(None)
    torch.manual_seed(5)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    ahead = None
    if config.mtp_depths:
        depths = depth_batch({"tokens": tokens, "position_ids": positions, "labels": tokens,
                              "loss_mask": torch.ones(2, 16)}, config.mtp_depths)
        ahead = (depths["mtp_tokens"], depths["mtp_position_ids"], depths["mtp_labels"])
    with meter.recording() if meter is not None else contextlib.nullcontext():
        loss = model(tokens, positions, labels=tokens, ahead=ahead).mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _worst(tp, policies, dropout, **shape):
    """Per policy: the loss's and the gradients' largest relative errors against no recompute, and the
    activation bytes it kept for backward against no recompute's."""
    kept = SavedActivationMeter()
    reference_loss, reference = _loss_and_grads(tp, RecomputePolicy(), dropout, kept, **shape)
    worst = []
    for policy in policies:
        meter = SavedActivationMeter()
        loss, grads = _loss_and_grads(tp, policy, dropout, meter, **shape)
        error = max((g - r).abs().max().item() / max(r.abs().max().item(), 1e-12) for g,
                    r in zip(grads, reference))
        worst.append((abs(loss - reference_loss) / reference_loss, error, meter.peak_bytes / kept.peak_bytes))
    return worst


def _recompute_is_exact(rank, world_size):
    tp = create_process_groups(Topology(world_size, tp=2)).tp
    alone = create_process_groups(Topology(world_size)).tp  # a MoE layer at tp > 1 takes sequence parallelism
    worst = {}
    for dropout in (0.0, 0.2):
        worst.update({(dropout, str(policy)): errors
                      for policy, errors in zip(POLICIES, _worst(tp, POLICIES, dropout))})
        worst.update({(dropout, f"MoE + latent: {policy}"): errors for policy, errors in
                      zip(MOE_LATENT_POLICIES, _worst(alone, MOE_LATENT_POLICIES, dropout, **MOE_LATENT))})
        worst.update({(dropout, f"MTP depths: {policy}"): errors for policy, errors in
                      zip(MTP_POLICIES, _worst(tp, MTP_POLICIES, dropout, mtp_num_layers=2))})
    meters = [SavedActivationMeter(), SavedActivationMeter()]  # full recompute, and it less the depths'
    for meter, kept in zip(meters, (False, True)):
        _loss_and_grads(tp, MTP_POLICIES[0], 0.0, meter, depths_kept=kept, mtp_num_layers=2)
    worst[0.0, "depths' layers recomputed"] = (0.0, 0.0, meters[0].peak_bytes / meters[1].peak_bytes)
    return worst


@pytest.mark.parity
def test_every_policy_reproduces_the_run_without_recompute_dropout_included():
    """Every policy (and every module Megatron's --recompute-modules names, on a model that has them all;
    and on a model with prediction depths) gives the loss and gradients of the run without recompute;
    mla_up_proj, moe_act and shared_experts each keep fewer activation bytes, and full recompute keeps fewer
    with the depths' layers recomputed than without."""
    for worst in run_world(2, _recompute_is_exact):
        for (dropout, policy), (loss_error, grad_error, kept) in worst.items():
            assert_within(loss_error, f"recompute loss, dropout {dropout}, {policy}", ONE_STEP_RTOL)
            assert_within(grad_error, f"recompute gradients, dropout {dropout}, {policy}", ONE_STEP_RTOL)
            if policy.startswith(("MoE", "depths' layers")):  # (MoE: 0.79, 0.87, 0.93, 0.57 measured)
                assert kept < 1, (policy, kept)


def _saved_bytes(rank, world_size):
    tp = create_process_groups(Topology(world_size, tp=2)).tp
    config = GPTConfig(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=256,
                       **NO_DROPOUT)
    measured = {}
    for name, policy in (("none", RecomputePolicy()), ("selective", RecomputePolicy("selective")),
                         ("full", RecomputePolicy("full", 1, "uniform")),
                         ("full+partitioned", RecomputePolicy("full", 1, "uniform", partition=True))):
        model = GPTModel(config, tp, seed=0, pre_process=False, post_process=False)
        apply_recompute(torch.nn.ModuleList([model]), policy, tp)
        hidden = torch.randn(64, 2, 64, requires_grad=True)
        meter = SavedActivationMeter()
        with meter.recording():
            out = model(None, torch.arange(64).expand(2, 64), hidden=hidden)
        out.sum().backward()
        measured[name] = meter.peak_bytes
    pool = BufferPool()  # partitioned checkpoints in the pool's slots, over three iterations
    model = GPTModel(config, tp, seed=0, pre_process=False, post_process=False)
    apply_recompute(torch.nn.ModuleList([model]), RecomputePolicy("full", 1, partition=True), tp, pool)
    allocations = []
    for _ in range(3):
        model(None, torch.arange(64).expand(2, 64),
              hidden=torch.randn(64, 2, 64, requires_grad=True)).sum().backward()
        allocations.append(pool.allocations)
    measured["pool"] = (allocations, dict(pool.high_water), dict(pool.in_use))
    return measured


def test_full_recompute_and_partitioning_cut_saved_activations_on_8_layers_at_tp2():
    for measured in run_world(2, _saved_bytes):
        sbh = 64 * 2 * 64
        assert measured["full"] == 8 * sbh * 4  # one fp32 layer input per layer
        assert measured["none"] / measured["full"] >= 3
        assert measured["full"] / measured["full+partitioned"] >= 1.8
        assert measured["selective"] < measured["none"]
        allocations, high_water, in_use = measured["pool"]
        assert allocations == [allocations[0]] * 3  # the slots of iteration 1 serve every later one
        assert high_water == {"activation-checkpoints": 8 * sbh // 2, "activation-gathers": sbh}
        assert in_use == {"activation-checkpoints": 0, "activation-gathers": 0}  # all given back
