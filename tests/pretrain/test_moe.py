"""Mixture-of-experts training against one process: every expert layout (ep, etp, with tp + SP, pp, cp,
ZeRO 0-3 over the expert data-parallel group, both dispatchers, grouped product) follows the single-process
trajectory, dropless and with a capacity factor; DeepSeek-V3's design (latent attention, its routing) in
tp + SP, cp, pp and ZeRO-3 layouts."""

import json
import re

import pytest
from safetensors.torch import load_file

from pretrain.interop.convert import main as convert

from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate
from tests.parity import TRAJECTORY_RTOL, assert_trajectory_close, assert_within
from tests.pretrain.test_trainer import COMPILED, SHORT, TINY, _train
from tests.world import run_world

# top-2 of 4 SwiGLU experts, the first layer dense, a gated shared expert (Qwen2-MoE); routed by softmax
# with the Switch balancing loss and the z-loss, or as DeepSeek-V3 routes (sigmoid scores, group-limited
# top-k, scaled weights, the auxiliary-loss-free expert bias and the sequence balancing loss)
COMMON = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "([0]+[1]*3)", "--swiglu",
          "--moe-ffn-hidden-size", "64", "--moe-shared-expert-intermediate-size", "64",
          "--moe-shared-expert-gate", *SHORT]
MOE = COMMON + ["--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]
# DeepSeek-V3's multi-head latent attention: a query latent, the key/value latent, rotary parts of their own
# (interleaved pairs) under yarn scaling with DeepSeek's mscale, values wider than the query/key heads
LATENT = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
          "--qk-pos-emb-head-dim", "8", "--v-head-dim", "24", "--position-embedding-type", "rope",
          "--normalization", "RMSNorm", "--rotary-interleaved", "--rope-type", "yarn",
          "--rotary-scaling-factor", "4", "--mscale", "0.707", "--mscale-all-dim", "0.707",
          "--rope-original-max-position-embeddings", "16"]
DEEPSEEK = COMMON + LATENT + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                     "--moe-router-bias-update-rate", "1e-2", "--moe-router-load-balancing-type",
                     "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-router-num-groups", "2",
                     "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2 = ["--expert-model-parallel-size", "2"]
SAMPLE = ["--sample-prompt", "def", "--sample-tokens", "3"]  # generation runs every schedule's program
PP2, PP4 = (["--pipeline-model-parallel-size", str(pp)] + SAMPLE for pp in (2, 4))
ZERO1, ZERO3 = ["--zero-stage", "1"], ["--zero-stage", "3", "--zero-persistence-threshold", "0"]
DENSE_FIRST = MOE + ["--moe-layer-freq", "[0,0,1,1]"]
MOE_FIRST = MOE + ["--num-layers", "8", "--moe-layer-freq", "([1]+[0]*7)"]

# name: (flags, the one-process run it follows)
LAYOUTS = {
    "DeepSeek routing: ep2 x tp2 + SP (etp 2), alltoall": (DEEPSEEK + TP2 + EP2 + ALLTOALL, "deepseek"),
    "DeepSeek routing: ep2 x cp2, allgather, attention cores recomputed": (
        DEEPSEEK + EP2 + ["--context-parallel-size", "2", "--recompute-granularity", "selective",
                          "--recompute-modules", "core_attn"], "deepseek"),
    "DeepSeek: ep2 x pp2 ZeRO-3 (latent attention's weights sharded), compiled, its up projections, "
    "experts' activation and shared expert recomputed": (
        DEEPSEEK + EP2 + ["--pipeline-model-parallel-size", "2", "--zero-stage", "3",
                          "--zero-persistence-threshold", "0", "--recompute-granularity", "selective",
                          "--recompute-modules", "mla_up_proj", "moe_act", "shared_experts"]
        + ALLTOALL + COMPILED, "deepseek"),
    "ep2 x tp2 + SP (etp 2), alltoall": (MOE + TP2 + EP2 + ALLTOALL, "dropless"),
    "tp2 + SP, etp 1 x ep2 (an expert grid unlike the dense one), allgather":
        (MOE + TP2 + ["--expert-tensor-parallel-size", "1"] + EP2, "dropless"),
    "ep4 ZeRO-3, grouped product": (MOE + ["--expert-model-parallel-size", "4", "--zero-stage", "3",
                                           "--moe-grouped-gemm"] + ALLTOALL, "dropless"),
    "ep2 x expert dp 2 ZeRO-2, compiled": (MOE + EP2 + ["--zero-stage", "2"] + ALLTOALL + COMPILED,
                                           "dropless"),
    "ep2 x expert dp 2 ZeRO-3, optimizer on the CPU, MoE layers recomputed": (
        MOE + EP2 + ["--zero-stage", "3", "--offload-optimizer", "cpu", "--recompute-granularity",
                     "selective", "--recompute-modules", "moe"], "dropless"),
    # stages without any MoE layer (dense first layers, as DeepSeek-V3 and Qwen2-MoE are built; or the
    # experts in the first layer only): the expert optimizer's collectives still span every stage
    "dense first: ep2 x pp2 1F1B, ZeRO-1": (DENSE_FIRST + EP2 + PP2 + ZERO1 + ALLTOALL, "dense first"),
    "dense first: ep2 x pp2 ZB-H1 (the experts' gradients in the weight pass), ZeRO-3": (
        DENSE_FIRST + EP2 + PP2 + ["--pipeline-schedule", "zb-h1"] + ZERO3 + ALLTOALL, "dense first"),
    "dense first: ep2 x pp2 ZBV, ZeRO-1": (DENSE_FIRST + EP2 + PP2 + ["--pipeline-schedule", "zbv"] + ZERO1,
                                           "dense first"),
    "dense first: ep2 x pp2 interleaved, ZeRO-3": (
        DENSE_FIRST + EP2 + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"] + ZERO3 + ALLTOALL,
        "dense first"),
    "experts in layer 0 only: pp4 1F1B, ZeRO-3": (MOE_FIRST + PP4 + ZERO3, "MoE first"),
    "experts in layer 0 only: pp4 interleaved, ZeRO-1": (
        MOE_FIRST + PP4 + ["--num-layers-per-virtual-pipeline-stage", "1"] + ZERO1, "MoE first"),
    "ep2 x cp2": (MOE + EP2 + ["--context-parallel-size", "2"] + ALLTOALL, "dropless"),
    "capacity: ep2 x tp2 + SP": (MOE + CAPACITY + TP2 + EP2 + ALLTOALL, "dropping"),
    "capacity: ep2 x cp2, full recompute": (MOE + CAPACITY + EP2 + ["--context-parallel-size", "2",
                                                                    "--recompute-granularity", "full"],
                                            "dropping"),
}


@pytest.mark.parity
def test_expert_layouts_reproduce_one_process_and_a_checkpoint_recuts_across_ep(stdlib_corpus, tmp_path):
    """Each layout within the fp32 bound of one process at every iteration; a checkpoint saved after 3
    iterations at ep2 x tp2 + SP (etp 2, ZeRO-1, DeepSeek routing) resumes at ep1 (dp4, ZeRO-3) and at ep4
    (ZeRO-2) on the straight run's trajectory (the experts re-cut by name and expert tp slice, the expert
    biases restored)."""
    single = str(tmp_path / "single")
    saving = DEEPSEEK + ["--save", single, "--save-interval", "3"]
    deepseek, dropless, dropping, dense_first, moe_first = run_world(
        1, _train, [saving, MOE, MOE + CAPACITY, DENSE_FIRST, MOE_FIRST], stdlib_corpus)[0]
    references = {"deepseek": deepseek, "dropless": dropless, "dropping": dropping,
                  "dense first": dense_first, "MoE first": moe_first}
    assert dropless[0] != dropping[0]  # the capacity drops tokens: another trajectory
    saved = str(tmp_path / "ep2tp2")
    original = DEEPSEEK + TP2 + EP2 + ["--zero-stage", "1"] + ALLTOALL
    resumes = [original + ["--train-iters", "3", "--save", saved],
               DEEPSEEK + ["--zero-stage", "3", "--load", saved],
               DEEPSEEK + ["--expert-model-parallel-size", "4", "--zero-stage", "2", "--load", saved]
               + ALLTOALL]
    results = run_world(4, _train, [flags for flags, _ in LAYOUTS.values()] + resumes, stdlib_corpus,
                        timeout_s=600)[-1]
    for (name, (_, reference)), result in zip(LAYOUTS.items(), results):
        for what, got, want in zip(("loss", "grad norm"), result[:2], references[reference][:2]):
            assert_trajectory_close(got, want, f"{name}: {what}")
        assert not result[5], (name, result[5])  # --compile: graph breaks at communication only
        if "dense first" in name or "layer 0 only" in name:  # every schedule ends with its sample
            assert result[6].startswith("def") and len(result[6]) > 3, (name, result[6])
    straight = results[0]  # ep2 x tp2 + SP, alltoall, ZeRO-0, DeepSeek routing: the saved run's layout
    for name, resumed in zip(("ep1 ZeRO-3", "ep4 ZeRO-2"), results[-2:]):
        for what, got, want in zip(("loss", "grad norm"), resumed[:2], straight[:2]):
            assert_trajectory_close(got, want[3:], f"resumed at {name}: {what}")
    biases = json.loads((tmp_path / "ep2tp2" / "iter_0000003" / "manifest.json").read_text())
    table = biases["states"]["load_balancing"]["expert_bias"]
    assert table[0] == [0.0] * 4 and all(abs(b) > 0 for row in table[1:] for b in row)  # layer 0 is dense
    # the ep2 x etp2 checkpoint as one file, in safetensors shards: every expert whole under its name, the
    # one-process run's weights at the same iteration up to another summation order
    convert(["--load", single, "--ckpt-step", "3", "--output", str(tmp_path / "single.safetensors")])
    (tmp_path / "shards").mkdir()
    convert(["--load", saved, "--output", str(tmp_path / "shards" / "model.safetensors"), "--max-shard-size",
             "64KB"])
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    cut = {}
    for name in set(index["weight_map"].values()):
        cut.update(load_file(str(tmp_path / "shards" / name)))
    whole = load_file(str(tmp_path / "single.safetensors"))
    assert {n: t.shape for n, t in cut.items()} == {n: t.shape for n, t in whole.items()}
    assert "layers.3.mlp.experts.3.fc1.weight" in whole and "layers.0.mlp.fc1.weight" in whole
    difference = sum((cut[name] - value).pow(2).sum() for name, value in whole.items()).sqrt()
    scale = sum(value.pow(2).sum() for value in whole.values()).sqrt()
    assert_within((difference / scale).item(), "ep2 x etp2 consolidated weights", TRAJECTORY_RTOL)


@pytest.mark.parametrize("flags, world, message", [
    (["--expert-model-parallel-size", "2"], 2, "lay out experts: add --num-experts"),
    (["--moe-router-topk", "1", "--moe-aux-loss-coeff", "0.1"], 1, "--moe-aux-loss-coeff, --moe-router-topk "
     "set up mixture-of-experts layers, which this model has none of: add --num-experts (or drop them)"),
    (MOE + ["--moe-layer-freq", "[0,0,0,0]"], 1, "--moe-layer-freq [0,0,0,0] makes none of the 4 layers a "
     "mixture of experts: put a 1 where one should be, or drop --num-experts to train a dense model"),
    (MOE + TP2 + ["--moe-ffn-hidden-size", "33"], 2, "--expert-tensor-parallel-size 2 (not given: it "
     "defaults to --tensor-model-parallel-size; give it, e.g. 1) does not divide --moe-ffn-hidden-size 33"),
    (MOE + LATENT + ["--moe-layer-freq", "1", "--recompute-granularity", "selective", "--recompute-modules",
                     "mlp", "mla_up_proj"], 1,
     "--recompute-modules mlp: this model has no such part; its modules are core_attn, layernorm, moe, "
     "moe_act, shared_experts, mla_up_proj"),
    (MOE + TP2[:2], 2, "MoE layers with --tensor-model-parallel-size > 1 need --sequence-parallel"),
    (MOE + ["--expert-model-parallel-size", "3"], 3, "--expert-model-parallel-size 3 does not divide "
                                                     "--num-experts 4"),
    (MOE + ["--moe-layer-freq", "__import__('os').system('true')"], 1, "--moe-layer-freq"),
    (MOE + ["--expert-model-parallel-size", "2", "--zero-stage", "2", "--zero-hpz-partition-size", "2"], 2,
     "--zero-hpz-partition-size with --num-experts"),
    (LATENT[:11] + ["--position-embedding-type", "learned_absolute"], 1,
     "--multi-latent-attention turns its --qk-pos-emb-head-dim channels by rotary positions"),
    (LATENT + ["--group-query-attention", "--num-query-groups", "2"], 1,
     "--group-query-attention with --multi-latent-attention"),
    (["--q-lora-rank", "32"], 1,
     "--q-lora-rank shapes multi-head latent attention: add --multi-latent-attention"),
    (LATENT + ["--tensor-model-parallel-size", "8"], 8, "--tensor-model-parallel-size 8 does not divide"),
])
def test_bad_expert_settings_name_the_flag(flags, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(parse_config(TINY + flags), world)


def _train_and_count(rank, world_size, layouts, corpus):
    """Each layout's last step: the bytes sent per "operation/axis", the tokens each MoE layer's experts
    received from this rank's tokens, this rank's place in the expert grid; its model-state bytes predicted
    and measured, and how many masters it steps."""
    import torch

    from pretrain.training.trainer import Trainer

    prefix, tokenizer = corpus
    results = []
    for flags in layouts:
        config = parse_config(TINY + flags + ["--data-path", prefix, "--tokenizer-model", tokenizer,
                                              "--data-cache-dir", f"{prefix}-cache"])
        trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
        trainer.train()
        (chunk,) = trainer.model
        counts = {layer: tokens.tolist() for layer, tokens in chunk.balancing.tokens_per_expert.items()}
        masters = sum(len(part.masters) for part in trainer.optimizer.parts)
        results.append((trainer.groups.stats.snapshot()["bytes"], counts, trainer.groups.etp.rank,
                        trainer.groups.ep.rank, trainer.expected_state_bytes,
                        trainer.optimizer.model_state_bytes(), masters))
    return results


def _alltoall_bytes(everyone, rank, etp, ep, experts, row_bytes, micro_batches, layers):
    """The all-to-all dispatcher's bytes of one step on ``rank``: per layer and micro-batch, forward and
    backward, twice the rows it sends to other ranks plus the rows others send it (each routed row goes to
    every etp rank of its expert's ep rank, none to itself), times a row's bytes; plus the forward's count
    exchange, (etp x ep - 1) x E / ep int64s."""
    _, counts, my_etp, my_ep, *_ = everyone[rank]
    local = experts // ep
    rows = 0
    for layer in counts:
        mine = [sum(counts[layer][r * local:(r + 1) * local]) for r in range(ep)]
        rows += sum(n * (etp - (r == my_ep)) for r, n in enumerate(mine))  # sent
        for _, theirs, their_etp, their_ep, *_ in everyone:  # received: what the others routed to my experts
            if (their_etp, their_ep) != (my_etp, my_ep):
                rows += sum(theirs[layer][my_ep * local:(my_ep + 1) * local])
    return 2 * rows * row_bytes + layers * micro_batches * (etp * ep - 1) * local * 8


def test_dispatcher_and_model_state_bytes_equal_the_formulas(stdlib_corpus):
    """Every rank's bytes of a step over the dispatch group equal the formula: the all-to-all dispatcher's
    at ep2 x etp2 (tp2 + SP), from the routing each rank recorded; the allgather dispatcher's at ep4, which
    the routing does not change ((G - 1) / G of the gathered tokens, weights and choices each way). At ep2 x
    expert dp 2, ZeRO stages 0-3, every rank's model-state bytes are the formula's (the dense parameters'
    states over dp 4, the experts' over expert dp 2) plus Adam's step counter, 4 bytes per master."""
    two = ["--train-iters", "2", "--global-batch-size", "8"]
    layouts = [MOE + two + TP2 + ["--expert-model-parallel-size", "2"] + ALLTOALL,  # dp 2: 2 micro-batches
               MOE + two + ["--expert-model-parallel-size", "4"]]  # dp 4: 1 micro-batch
    layouts += [MOE + two + ["--expert-model-parallel-size", "2", "--zero-stage", str(stage),
                             "--zero-persistence-threshold", "0"] for stage in (0, 1, 2, 3)]
    results = run_world(4, _train_and_count, layouts, stdlib_corpus)
    for rank_results in results:
        sizes = [(expected, measured, masters) for *_, expected, measured, masters in rank_results[2:]]
        for stage, (expected, measured, masters) in enumerate(sizes):
            assert measured == expected + 4 * masters, (stage, expected, measured, masters)
        assert sizes[3][0] < sizes[2][0] < sizes[1][0] < sizes[0][0]  # each stage shards more
    hidden, layers, experts = 64, 3, 4  # TINY's width; MOE's three MoE layers of 4 experts
    alltoall = [rank_results[0] for rank_results in results]
    for rank in range(4):
        want = _alltoall_bytes(alltoall, rank, 2, 2, experts, hidden * 4, 2, layers)
        assert alltoall[rank][0]["all_to_all/etp-ep"] == want, rank
    others, tokens = 3, 32 * 2  # G - 1; a rank's tokens in its micro-batch (2 sequences of 32)
    x, weights, choices = tokens * hidden * 4, tokens * experts * 4, tokens * experts  # fp32, fp32, bytes
    for sent, *_ in (rank_results[1] for rank_results in results):
        assert sent["all_gather/etp-ep"] == layers * others * (2 * x + weights + choices)
        assert sent["reduce_scatter/etp-ep"] == layers * others * (2 * x + weights)
