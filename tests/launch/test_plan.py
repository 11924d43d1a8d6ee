"""The memory planner predicts what runs measure: model states within 5%, saved activations within 10%."""

import json

import pytest

from launch.tools.planning.link_model import Links, ZeroCommOptions
from launch.tools.planning.activation_price import activation_bytes, layer_elements
from launch.tools.planning.layout import Layout
from launch.tools.planning.layout_price import model_state_bytes, sent_by_axis, transfers
from launch.tools.planning.plan import balanced_split, plan, plan_layout
from launch.tools.planning.schedule_price import pipeline_time
from launch.tools.planning.plan_command import main as plan_main, parse_bytes
from models.counting import num_parameters
from pretrain.config.arguments import parse_config
from tests.pretrain.test_architectures import LLAMA
from tests.pretrain.test_trainer import TINY, _pp, _tp, _train
from tests.world import run_world

LAYOUTS = {  # flags -> the planner's layout (world of 4)
    "dp4 stage 0": ([], Layout(1, 1, 4, 0)),
    "dp2 x tp2 + SP stage 2": ([*_tp(2, "--sequence-parallel"), "--zero-stage", "2"],
                               Layout(2, 1, 2, 2, sequence_parallel=True)),
    "pp2 x dp2 stage 3": ([*_pp(2), "--zero-stage", "3", "--zero-persistence-threshold", "0"],
                          Layout(1, 2, 2, 3)),
    "tp2 x pp2 stage 1 full recompute": ([*_tp(2), *_pp(2), "--zero-stage", "1",
                                          "--recompute-granularity", "full",
                                          "--recompute-num-layers", "1"],
                                         Layout(2, 2, 1, 1, recompute="full")),
    "dp4 stage 3 bf16": (["--zero-stage", "3", "--zero-persistence-threshold", "0", "--bf16"],
                         Layout(1, 1, 4, 3)),
    "pp2 (1 + 3 layers) x dp2 stage 2": ([*_pp(2), "--pipeline-layers-per-stage", "1", "3",
                                          "--zero-stage", "2"],
                                         Layout(1, 2, 2, 2, split=(1, 3))),
    # an uneven pp4 cut (Megatron's first / last stage counts), each stage's bytes checked on its own
    "pp4 (1 + 2 + 2 + 1 of 6 layers) stage 1": (["--num-layers", "6", *_pp(4), "--zero-stage", "1",
                                                  "--decoder-first-pipeline-num-layers", "1",
                                                  "--decoder-last-pipeline-num-layers", "1"],
                                                 Layout(1, 4, 1, 1, split=(1, 2, 2, 1))),
    # two nodes of 2: ZeRO++ and shard groups
    "dp4 stage 3 bf16 hpZ + qwZ + qgZ": (["--zero-stage", "3", "--zero-persistence-threshold", "0", "--bf16",
                                          "--gpus-per-node", "2", "--zero-hpz-partition-size", "2",
                                          "--zero-quantized-weights", "--zero-quantized-gradients"],
                                         Layout(1, 1, 4, 3, zero=ZeroCommOptions(2, True, True))),
    "dp4 stage 3 bf16 shard groups of 2": (["--zero-stage", "3",
                                            "--zero-persistence-threshold", "0", "--bf16",
                                            "--gpus-per-node", "2", "--zero-shard-size", "2"],
                                           Layout(1, 1, 4, 3, zero=ZeroCommOptions(shard_size=2))),
    "cp2 x dp2 stage 2": (["--context-parallel-size", "2", "--zero-stage", "2"], Layout(1, 1, 2, 2, cp=2)),
    # the zero-bubble schedules: what each weight pass keeps from B to W counted with the activations
    "pp4 ZB-H1 stage 0": (["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "zb-h1",
                           "--global-batch-size", "16"], Layout(1, 4, 1, 0, schedule="zb-h1")),
    "pp2 x tp2 + SP ZBV stage 1": (["--untie-embeddings-and-output-weights", *_pp(2, "zbv"),
                                   *_tp(2, "--sequence-parallel"), "--zero-stage", "1"],
                                  Layout(2, 2, 1, 1, sequence_parallel=True, schedule="zbv")),
    "cp4 stage 1 bf16 full recompute": (["--context-parallel-size", "4", "--zero-stage", "1", "--bf16",
                                         "--recompute-granularity", "full", "--recompute-num-layers", "1"],
                                        Layout(1, 1, 1, 1, recompute="full", cp=4)),
    "dp2 x tp2 + SP stage 1, the MLPs and norms recomputed": (
        [*_tp(2, "--sequence-parallel"), "--zero-stage", "1", "--recompute-granularity", "selective",
         "--recompute-modules", "mlp", "layernorm"],
        Layout(2, 1, 2, 1, recompute="selective", sequence_parallel=True,
               recompute_modules=("mlp", "layernorm"))),
}
DATA_PARALLEL_ONLY = [name for name, (_, layout) in LAYOUTS.items() if layout.tp == layout.pp == 1]


LLAMA_LAYOUTS = {f"llama dp2 x tp2 + SP stage {stage}": (
    [*LLAMA, *_tp(2, "--sequence-parallel"), "--zero-stage", str(stage),
     "--zero-persistence-threshold", "1000",
     *(["--bf16"] if stage == 3 else [])], Layout(2, 1, 2, stage, sequence_parallel=True))
    for stage in range(4)}
EXPERTS = ["--num-experts", "4", "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2",
           "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate", "--moe-aux-loss-coeff",
           "1e-2", "--moe-token-dispatcher-type", "alltoall"]
LLAMA_LAYOUTS["llama MoE ep2 x expert dp 2 stage 1"] = (
    [*LLAMA, *EXPERTS, "--expert-model-parallel-size", "2", "--zero-stage", "1"], Layout(1, 1, 4, 1, ep=2))
LLAMA_LAYOUTS["llama MoE ep2 x tp2 + SP stage 3"] = (
    [*LLAMA, *EXPERTS, *_tp(2, "--sequence-parallel"), "--expert-model-parallel-size", "2", "--zero-stage",
     "3", "--zero-persistence-threshold", "1000"], Layout(2, 1, 2, 3, sequence_parallel=True, ep=2))
MUON = ["--optimizer", "muon"]
LLAMA_LAYOUTS["llama Muon dp4 stage 3 (its matrices' pieces to their owners and back)"] = (
    [*LLAMA, *MUON, "--zero-stage", "3", "--zero-persistence-threshold", "1000"],
    Layout(1, 1, 4, 3, optimizer="muon"))
LLAMA_LAYOUTS["llama Muon dp2 x tp2 + SP stage 1"] = (
    [*LLAMA, *MUON, *_tp(2, "--sequence-parallel"), "--zero-stage", "1"],
    Layout(2, 1, 2, 1, sequence_parallel=True, optimizer="muon"))
MAMBA = ["--hybrid-layer-pattern", "M*GK-", "--mamba-head-dim", "16",
         "--mamba-num-groups", "2", "--mamba-state-dim", "16", "--mamba-chunk-size", "8",
         "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "16",
         "--linear-value-head-dim", "8"]
LLAMA_LAYOUTS["hybrid M*GK- dp2 x tp2 + SP stage 1"] = (
    [*LLAMA, *MAMBA, *_tp(2, "--sequence-parallel"), "--zero-stage", "1"],
    Layout(2, 1, 2, 1, sequence_parallel=True))
LLAMA_LAYOUTS["hybrid M*|GK- pp2 x cp2 stage 3, the Mamba mixer recomputed"] = (
    [*LLAMA, *MAMBA[:1], "M*|GK-", *MAMBA[2:], *_pp(2), "--context-parallel-size", "2", "--zero-stage", "3",
     "--zero-persistence-threshold", "1000", "--recompute-granularity", "selective", "--recompute-modules",
     "mamba"], Layout(1, 2, 1, 3, cp=2, recompute="selective", recompute_modules=("mamba",), split=(2, 3)))
LLAMA_LAYOUTS["llama with 2 prediction depths, dp2 x tp2 + SP stage 1"] = (  # (no windows: not with depths)
    [*LLAMA[:LLAMA.index("--window-size")], "--mtp-num-layers", "2", *_tp(2, "--sequence-parallel"),
     "--zero-stage", "1"],
    Layout(2, 1, 2, 1, sequence_parallel=True))
LLAMA_LAYOUTS["llama dp4 stage 0, the MLPs recomputed"] = (
    [*LLAMA, "--recompute-granularity", "selective", "--recompute-modules", "mlp"],
    Layout(1, 1, 4, 0, recompute="selective", recompute_modules=("mlp",)))


@pytest.mark.parametrize("layouts", [LAYOUTS, LLAMA_LAYOUTS], ids=["gpt", "llama"])
def test_planner_matches_measured_model_states_and_activations(stdlib_corpus, tmp_path, layouts):
    """Also the trainer's start-up table (each rank's expected model states) within 5% of what it holds,
    and, where only data parallelism communicates, the link model's bytes (per rank, and leaving a node)
    within 2% of those counted (block padding of the quantized collectives aside, gloo's patterns)."""
    runs = [flags + ["--train-iters", "2", "--lr-warmup-iters", "1", "--log-interval", "1", "--metrics-file",
                     str(tmp_path / f"{i}.jsonl")]
            for i, (flags, _) in enumerate(layouts.values())]
    run_world(4, _train, runs, stdlib_corpus, timeout_s=600)
    for i, (name, (flags, layout)) in enumerate(layouts.items()):
        ranks = [json.loads(line)
                 for line in (tmp_path / f"{i}.jsonl").read_text().splitlines()][-1]["per_rank"]
        config = parse_config(TINY + flags)
        config.model.vocab_size = 512  # the corpus tokenizer's
        config.model.resolve_pattern()  # (a pattern's layer count, as the trainer's validation makes it)
        layout = Layout(layout.tp, layout.pp, layout.dp, layout.zero_stage, layout.recompute, 2,
                        sequence_parallel=layout.sequence_parallel, split=layout.split,
                        zero=layout.zero, cp=layout.cp, recompute_modules=layout.recompute_modules,
                        ep=layout.ep, schedule=layout.schedule, optimizer=layout.optimizer)
        predicted = plan_layout(config.model, layout, config.training.global_batch_size,
                                2 if "--bf16" in flags else 4,
                                persistence_threshold=config.zero.zero_persistence_threshold)
        states = max(r["model_state_bytes"] for r in ranks)
        activations = max(r["saved_activation_bytes"] for r in ranks)
        assert predicted.model_state_bytes == pytest.approx(states, rel=0.05), (name, predicted, states)
        assert predicted.activation_bytes == pytest.approx(activations, rel=0.10), (name,
                                                                                    predicted, activations)
        if layout.pp == 4:  # rank r is stage r: each stage's states and activations on their own
            micro_batches = config.training.global_batch_size // 2
            for stage, rank in enumerate(ranks):
                assert model_state_bytes(config.model, layout, stage, 4) == pytest.approx(
                    rank["model_state_bytes"], rel=0.05), (name, stage)
                assert activation_bytes(config.model, layout, stage, micro_batches, 4) == pytest.approx(
                    rank["saved_activation_bytes"], rel=0.10), (name, stage)
        if layout.optimizer == "muon":  # its exchange priced as an upper bound, the rest as counted
            found = transfers(config.model, layout, 8 // (2 * layout.dp), 2 if "--bf16" in flags else 4,
                              backend="gloo")
            bound = sum(t.per_rank * t.count for t in found if t.operation == "all_to_all")
            exchanged = max(r["comm_bytes"]["all_to_all"] for r in ranks)
            assert 0 < bound and exchanged <= bound, (name, exchanged, bound)
        elif name in DATA_PARALLEL_ONLY:
            nodes = 2 if "--gpus-per-node" in flags else None
            found = transfers(config.model, layout, 8 // (2 * layout.dp), 2 if "--bf16" in flags else 4,
                              gpus_per_node=nodes, backend="gloo")  # 8 sequences, micro-batches of 2
            sent = max(sum(r["comm_bytes"].values()) for r in ranks)
            leaving = sum(sum(r["comm_bytes_inter_node"].values()) for r in ranks[:2])  # node 0's two ranks
            assert (sum(t.per_rank * t.count for t in found)
                    == pytest.approx(sent, rel=0.02)), (name, found, ranks)
            assert (sum(t.leaving_node * t.count for t in found)
                    == pytest.approx(leaving, rel=0.02, abs=64)), name
        for rank in ranks:
            held = rank["model_state_bytes"] + rank["offloaded_bytes"]
            assert rank["expected_model_state_bytes"] == pytest.approx(held, rel=0.05), (name, rank)


def test_planner_ranks_layouts_that_fit_and_prints_json(capsys):
    config = parse_config(["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
                           "--seq-length", "2048", "--vocab-size", "50257",
                           "--global-batch-size", "512", "--bf16"])
    plans = plan(config.model, 64, 8, parse_bytes("80GiB"), 512)
    assert plans and all(p.total_bytes <= 80 * 2**30 for p in plans)
    assert [p.score for p in plans] == sorted(p.score for p in plans)
    assert not plan(config.model, 8, 8, parse_bytes("256MiB"), 512)  # 8 x 256 MiB cannot hold 1.3B parameters
    plan_main(["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
               "--seq-length", "2048",
               "--vocab-size", "50257", "--global-batch-size", "512", "--bf16", "--zero-stage", "3",
               "--world-size", "64", "--memory-per-device", "80GiB", "--json", "--top", "3"])
    printed = json.loads(capsys.readouterr().out)
    assert len(printed) == 3 and all(entry["zero_stage"] == 3 for entry in printed)
    # 64 ranks on 8 nodes: tp inside a node never crosses; dp groups (stride tp) span nodes and cross
    for entry in printed:
        sent, crossing = entry["comm_bytes_per_step"], entry["comm_bytes_inter_node_per_step"]
        assert crossing["tp"] == 0 and crossing["dp"] == sent["dp"] > 0
    # --micro-batch-size alone: each layout's global batch is Megatron's default, micro-batch x dp
    plan_main(["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length",
               "2048", "--vocab-size", "50257", "--micro-batch-size", "2", "--bf16", "--world-size", "8",
               "--memory-per-device", "80GiB", "--json", "--top", "50"])
    printed = json.loads(capsys.readouterr().out)
    assert printed and all(entry["micro_batch_size"] == 2 and entry["pp"] == 1 for entry in printed)
    one = Layout(tp=2, pp=2, dp=2, zero_stage=3)  # 8 ranks: pp stage 0 = ranks 0-3, stage 1 = ranks 4-7
    found = {node: transfers(config.model, one, 4, 2, gpus_per_node=node) for node in (2, 4, 8)}
    sent = sent_by_axis(found[8])
    assert all(sent[axis] for axis in ("dp", "tp", "pp"))
    assert sent["cp"] == 0 and sent_by_axis(found[4], crossing=True) == {"dp": 0.0, "tp": 0.0,
                                                                         "pp": sent["pp"], "cp": 0.0}
    assert sent_by_axis(found[8], crossing=True) == {"dp": 0.0, "tp": 0.0, "pp": 0.0, "cp": 0.0}
    assert sent_by_axis(found[2], crossing=True) == {"dp": sent["dp"], "tp": 0.0, "pp": sent["pp"], "cp": 0.0}


def test_planner_proposes_context_parallelism_for_long_sequences():
    """Llama-3 8B on 8 nodes of 8 x 80 GiB: at 8K tokens the best layouts keep whole sequences, at 128K the
    best cuts them (whole, only recompute fits: full, or the MLP's and the norms'); a cp rank keeps 1/cp of
    the activations (logits included) and sends ring attention's blocks over the cp group."""
    config = parse_config(["--config", "launch/configs/presets/llama3-8b.yaml"]).model
    assert all(p.layout.cp == 1 for p in plan(config, 64, 8, parse_bytes("80GiB"), 128)[:3])
    config.seq_length = config.max_position_embeddings = 131072
    plans = plan(config, 64, 8, parse_bytes("80GiB"), 16)
    assert plans and plans[0].layout.cp > 1
    assert all(p.layout.cp > 1 or p.layout.recompute_label in ("full", "mlp+layernorm") for p in plans)
    one, two = (plan_layout(config, Layout(8, 1, 8 // cp, 1, sequence_parallel=True, cp=cp), 16, 2)
                for cp in (1, 2))
    assert two.activation_bytes == pytest.approx(one.activation_bytes / 2, rel=1e-9)
    assert one.comm_bytes["cp"] == 0 and two.comm_bytes["cp"] > 0


def test_link_model_prefers_zero_2_on_a_slow_link_and_zero_plus_plus_when_ranks_share_a_node(capsys):
    """Two nodes of 8 data-parallel ranks: on a slow link the planner ranks ZeRO-2 over plain ZeRO-3 (no
    parameter gathers across the link) and ZeRO-3 with hpZ + qwZ + qgZ over both; on a fast link the
    gap between the stages shrinks to what the node's own links cost, and the quantize passes cost more
    than the bytes they save."""
    flags = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "1024",
             "--vocab-size", "50257", "--global-batch-size", "64", "--bf16"]
    config = parse_config(flags)
    gaps = []
    for links in (Links(200e9, 1.25e9, 10e-6), Links(200e9, 400e9, 10e-6)):
        zero2, zero3, zero_plus_plus = (plan_layout(config.model,
                                                    Layout(1, 1, 16, stage, zero=options), 64, 2,
                                                    gpus_per_node=8, links=links).step_seconds
                                        for stage, options in ((2, ZeroCommOptions()), (3, ZeroCommOptions()),
                                                               (3, ZeroCommOptions(8, True, True))))
        gaps.append((zero3 - zero2, zero_plus_plus - zero3))
    (slow, slow_quantized), (fast, fast_quantized) = gaps
    assert slow > 0 and fast < 0.1 * slow, gaps
    assert slow_quantized < 0 < fast_quantized, gaps
    plan_main([*flags, "--world-size", "16", "--tensor-model-parallel-size", "1",
               "--pipeline-model-parallel-size",
               "1", "--inter-node-bandwidth", "10Gbit", "--top", "3"])
    printed = capsys.readouterr().out
    assert ("on these links ZeRO-3 with hpZ 8 + qwZ + qgZ is fastest" in printed
            and "step s" in printed), printed


PRESET_WORLDS = {"gpt-125m": 8, "gpt-350m": 8, "gpt-1.3b": 16, "gpt-2.7b": 32, "gpt-6.7b": 64, "gpt-13b": 128,
                 "gpt-30b": 256, "gpt-175b": 1024, "llama3-8b": 64, "llama3-8b-32k": 64, "llama3-8b-128k": 64}


def test_every_preset_is_valid_and_its_suggested_layout_fits_80gib():
    from pretrain.startup.validation import validate

    for name, world in PRESET_WORLDS.items():
        config = parse_config(["--config", f"launch/configs/presets/{name}.yaml"])
        topology = validate(config, world)
        recompute = config.recompute.recompute_granularity
        layout = Layout(topology.tp, topology.pp, topology.dp, config.zero.zero_stage, recompute,
                        config.training.micro_batch_size, sequence_parallel=config.parallel.sequence_parallel,
                        cp=topology.cp)
        predicted = plan_layout(config.model, layout, config.training.global_batch_size, 2)
        assert predicted.total_bytes <= 80 * 2**30, (name, predicted.total_bytes / 2**30)
        size = float(name.split("-")[1][:-1]) * (1e9 if name.split("-")[1][-1] == "b" else 1e6)
        # the size in its name, within 25%
        assert abs(num_parameters(config.model) - size) <= 0.25 * size, name


ARCHITECTURES = {"gpt-3": {}, "rope": {"position_embedding_type": "rope"},
                 "gqa + qk norms": {"group_query_attention": True, "num_query_groups": 2,
                                    "qk_layernorm": True},
                 "rmsnorm + squared relu": {"normalization": "RMSNorm", "squared_relu": True},
                 "llama": {"normalization": "RMSNorm", "swiglu": True, "ffn_hidden_size": 160,
                           "position_embedding_type": "rope", "group_query_attention": True,
                           "num_query_groups": 2,
                           "disable_bias_linear": True, "qk_layernorm": True},
                 "qwen3-next (output gate, 1p norms, partial rotary)": {
                     "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
                     "rotary_percent": 0.5, "group_query_attention": True, "num_query_groups": 2,
                     "disable_bias_linear": True, "qk_layernorm": True, "apply_layernorm_1p": True,
                     "attention_output_gate": True},
                 "latent attention": {"normalization": "RMSNorm", "position_embedding_type": "rope",
                                      "multi_latent_attention": True, "q_lora_rank": 24, "kv_lora_rank": 16,
                                      "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 12},
                 "latent attention, one query projection": {
                     "normalization": "RMSNorm", "position_embedding_type": "rope",
                     "multi_latent_attention": True, "kv_lora_rank": 16, "qk_head_dim": 8,
                     "qk_pos_emb_head_dim": 4, "v_head_dim": 12}}


HYBRID = {"hybrid_layer_pattern": "M*-GK", "normalization": "RMSNorm", "position_embedding_type": "rope",
          "mamba_head_dim": 16, "mamba_num_groups": 2, "mamba_state_dim": 16, "mamba_chunk_size": 8,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 8}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_layers_saved_activations_follow_its_architecture(dtype):
    """The planner's per-layer accounting against the bytes one layer of each kind keeps for backward
    (measured over its forward): the GPT blocks of several architectures, and a hybrid pattern's Mamba-2,
    attention, MLP, gated delta net and Kimi delta attention layers."""
    import torch

    from models.config import GPTConfig
    from models.attention import LayerInputs
    from models.layers.registry import LayerContext, build_layer
    from models.rotary import rotary_tables
    from parallel.comm import AxisGroup, CommStats
    from parallel.saved_activations import SavedActivationMeter
    from parallel.tensor.random import model_parallel_tracker

    s, b, h, dtype = 32, 2, 64, getattr(torch, dtype)
    cases = [(name, {"num_layers": 1, **options}, 0) for name, options in ARCHITECTURES.items()]
    cases += [(f"hybrid {symbol}", HYBRID, index)
              for index, symbol in enumerate(HYBRID["hybrid_layer_pattern"])]
    for name, options, index in cases:
        config = GPTConfig(hidden_size=h, num_attention_heads=4, seq_length=s, vocab_size=300,
                           hidden_dropout=0.0, attention_dropout=0.0, **options)
        entry = config.layer_types()[index]
        tp = AxisGroup("tp", (0,), None, CommStats())
        layer = build_layer(entry, LayerContext(config, tp, 0, False, model_parallel_tracker(0, 0)), index)
        layer = layer.to(dtype)
        x = torch.randn(s, b, h, dtype=dtype, requires_grad=True)
        rotary = (rotary_tables(config, torch.arange(s).expand(b, s), dtype)
                  if config.position_embedding == "rope" else None)
        meter = SavedActivationMeter()
        with meter.recording():
            y = layer(x, LayerInputs(rotary))
        y.float().sum().backward()
        predicted = layer_elements(config, Layout(1, 1, 1, 0, micro_batch_size=b), entry) * x.element_size()
        assert predicted == pytest.approx(meter.peak_bytes, rel=0.03), name


def test_every_layer_kind_is_priced():
    from launch.tools.planning.layer_parts import SUBLAYERS
    from models.layers.registry import KINDS

    assert {entry for entry, kind in KINDS.items() if kind.build is not None} == set(SUBLAYERS)


def test_planner_searches_expert_parallelism():
    """With experts every ep that divides them and the grid is a candidate: at a fixed grid a rank's
    model states fall as ep spreads the experts, and the tokens' dispatch appears on the ep axis."""
    config = parse_config(TINY + ["--num-experts", "8", "--moe-ffn-hidden-size", "128", "--swiglu",
                                  "--global-batch-size", "64", "--vocab-size", "512"])
    plans = plan(config.model, 16, 8, parse_bytes("1GiB"), 64, 4, tp=1, pp=1, cp=1, zero_stage=1)
    grid = {p.layout.ep: p for p in plans if (p.layout.micro_batch_size, p.layout.recompute,
                                               p.layout.offload_optimizer) == (1, None, "none")}
    assert sorted(grid) == [1, 2, 4, 8]
    states = [grid[ep].model_state_bytes for ep in (1, 2, 4, 8)]
    assert states == sorted(states, reverse=True) and states[0] > states[-1]
    assert grid[1].comm_bytes["ep"] == 0 < grid[2].comm_bytes["ep"]


def test_planner_prices_each_pipeline_schedules_bubble_and_activations(capsys):
    """pp4 with 8 micro-batches: 1F1B's bubble is (p - 1) / (m + p - 1); ZB-H1's and ZBV's are smaller, laid
    out with the layers' own costs (B without the weights' products, W those); their activations peak no
    lower than 1F1B's first stage (they hold as many micro-batches, plus the weight passes' operands); the
    command prints each layout's schedule and bubble."""
    flags = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "2048", "--vocab-size", "32000", "--untie-embeddings-and-output-weights",
             "--bf16"]
    config = parse_config(flags).model
    plans = {kind: plan_layout(config, Layout(1, 4, 1, 1, schedule=kind), 8, 2)
             for kind in ("1f1b", "zb-h1", "zbv")}
    assert pipeline_time("1f1b", 4, 8, ((1.0, 2.0, 0.0),) * 4) == (pytest.approx(3 / 11), 1.0)
    # the untied output layer (2.6 layers' products) makes the last stage the busiest: it waits least
    assert plans["1f1b"].imbalance > 1.3 and plans["1f1b"].bubble < 3 / 11
    assert plans["zbv"].bubble < plans["zb-h1"].bubble < plans["1f1b"].bubble
    assert plans["zb-h1"].activation_bytes >= plans["1f1b"].activation_bytes
    assert plans["zbv"].score < plans["zb-h1"].score < plans["1f1b"].score
    plan_main([*flags, "--world-size", "4", "--pipeline-model-parallel-size", "4",
               "--tensor-model-parallel-size", "1", "--zero-stage", "1", "--global-batch-size", "8",
               "--top", "30"])
    printed = capsys.readouterr().out
    assert "schedule layers per stage bubble" in printed
    assert all(f" {kind} " in printed for kind in ("1f1b", "zb-h1", "zbv"))


def test_planner_proposes_the_cut_that_unloads_the_output_layers_stage(capsys):
    """An untied output layer over 128k tokens costs about ten of this model's layers: the even pp4 cut
    leaves the last stage busiest, so the planner proposes Megatron's first/last counts 1 + 3 + 3 + 1 and
    ranks it first (less imbalance, a shorter step); 7 layers, which pp4 cannot cut evenly, are priced on
    the proposed cut alone, the last stage the lighter (2 + 2 + 2 + 1)."""
    flags = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length",
             "2048", "--vocab-size", "128000", "--untie-embeddings-and-output-weights", "--bf16"]
    config = parse_config(flags).model
    proposed = balanced_split(config, 4, 1, False)
    assert proposed == (1, 3, 3, 1)
    even, uneven = (plan_layout(config, Layout(1, 4, 1, 1, split=split), 8, 2) for split in (None, proposed))
    assert uneven.imbalance < even.imbalance and uneven.score < even.score
    grid = ["--world-size", "4", "--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "1",
            "--zero-stage", "1", "--global-batch-size", "8", "--json"]
    plan_main([*flags, *grid])
    best = json.loads(capsys.readouterr().out)[0]
    assert tuple(best["split"]) == proposed, best
    plan_main([*flags, "--num-layers", "7", *grid])
    assert {tuple(layout["split"]) for layout in json.loads(capsys.readouterr().out)} == {(2, 2, 2, 1)}
