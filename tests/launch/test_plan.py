"""The memory planner predicts what runs measure: model states within 5%, saved activations within 10%."""

import json

import pytest

from launch.plan import Layout, main as plan_main, parse_bytes, plan, plan_layout
from pretrain.arguments import parse_config
from tests.pretrain.test_trainer import TINY, _pp, _tp, _train
from tests.world import run_world

LAYOUTS = {  # flags -> the planner's layout (world of 4)
    "dp4 stage 0": ([], Layout(1, 1, 4, 0)),
    "dp2 x tp2 + SP stage 2": ([*_tp(2, "--sequence-parallel"), "--zero-stage", "2"], Layout(2, 1, 2, 2, sequence_parallel=True)),
    "pp2 x dp2 stage 3": ([*_pp(2), "--zero-stage", "3", "--zero-persistence-threshold", "0"], Layout(1, 2, 2, 3)),
    "tp2 x pp2 stage 1 full recompute": ([*_tp(2), *_pp(2), "--zero-stage", "1", "--recompute-granularity", "full",
                                          "--recompute-num-layers", "1"],
                                         Layout(2, 2, 1, 1, recompute="full")),
    "dp4 stage 3 bf16": (["--zero-stage", "3", "--zero-persistence-threshold", "0", "--bf16"], Layout(1, 1, 4, 3)),
}


def test_planner_matches_measured_model_states_and_activations(stdlib_corpus, tmp_path):
    runs = [flags + ["--train-iters", "2", "--log-interval", "1", "--metrics-file", str(tmp_path / f"{i}.jsonl")]
            for i, (flags, _) in enumerate(LAYOUTS.values())]
    run_world(4, _train, runs, stdlib_corpus, timeout_s=600)
    for i, (name, (flags, layout)) in enumerate(LAYOUTS.items()):
        ranks = [json.loads(line) for line in (tmp_path / f"{i}.jsonl").read_text().splitlines()][-1]["per_rank"]
        config = parse_config(TINY + flags)
        config.model.vocab_size = 512  # the corpus tokenizer's
        layout = Layout(layout.tp, layout.pp, layout.dp, layout.zero_stage, layout.recompute, 2,
                        sequence_parallel=layout.sequence_parallel)
        predicted = plan_layout(config.model, layout, 8, 2 if "--bf16" in flags else 4,
                                persistence_threshold=config.zero.zero_persistence_threshold)
        states = max(r["model_state_bytes"] for r in ranks)
        activations = max(r["saved_activation_bytes"] for r in ranks)
        assert predicted.model_state_bytes == pytest.approx(states, rel=0.05), (name, predicted, states)
        assert predicted.activation_bytes == pytest.approx(activations, rel=0.10), (name, predicted, activations)


def test_planner_ranks_layouts_that_fit_and_prints_json(capsys):
    config = parse_config(["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
                           "--seq-length", "2048", "--vocab-size", "50257", "--global-batch-size", "512", "--bf16"])
    plans = plan(config.model, 64, 8, parse_bytes("80GiB"), 512)
    assert plans and all(p.total_bytes <= 80 * 2**30 for p in plans)
    assert [p.score for p in plans] == sorted(p.score for p in plans)
    assert not plan(config.model, 8, 8, parse_bytes("256MiB"), 512)  # 8 x 256 MiB cannot hold 1.3B parameters
    plan_main(["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
               "--vocab-size", "50257", "--global-batch-size", "512", "--bf16", "--zero-stage", "3",
               "--world-size", "64", "--memory-per-device", "80GiB", "--json", "--top", "3"])
    printed = json.loads(capsys.readouterr().out)
    assert len(printed) == 3 and all(entry["zero_stage"] == 3 for entry in printed)


PRESET_WORLDS = {"gpt-125m": 8, "gpt-350m": 8, "gpt-1.3b": 16, "gpt-2.7b": 32, "gpt-6.7b": 64, "gpt-13b": 128,
                 "gpt-30b": 256, "gpt-175b": 1024}


def test_every_preset_is_valid_and_its_suggested_layout_fits_80gib():
    from pretrain.validation import validate

    for name, world in PRESET_WORLDS.items():
        config = parse_config(["--config", f"launch/configs/presets/{name}.yaml"])
        topology = validate(config, world)
        recompute = config.recompute.recompute_granularity
        layout = Layout(topology.tp, topology.pp, topology.dp, config.zero.zero_stage, recompute,
                        config.training.micro_batch_size, sequence_parallel=config.parallel.sequence_parallel)
        predicted = plan_layout(config.model, layout, config.training.global_batch_size, 2)
        assert predicted.total_bytes <= 80 * 2**30, (name, predicted.total_bytes / 2**30)
        assert abs(config.model.num_parameters() / float(name[4:-1]) - (1e9 if name[-1] == "b" else 1e6)) \
            <= 0.25 * (1e9 if name[-1] == "b" else 1e6), name  # the size in its name, within 25%
