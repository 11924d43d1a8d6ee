"""The planner's command line as a user types it: the stage whose transfers it prices, the layout keys of
a --config it honours (and --any-layout, which drops them), what --help shows each flag takes, and the
layouts that do not fit, dropped before they are timed."""

import json
import re

import pytest

from launch.tools.planning.plan_command import main as plan_main


def test_planner_prices_the_pipeline_stage_that_sends_most(capsys):
    """pp2 cut 1 + 7: the second stage's rank sends most (its 7 layers' tp all-reduces, its parameters'
    gradients), and the table and JSON show that stage's bytes and say which stage they are."""
    flags = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "2048", "--vocab-size", "32000", "--bf16", "--world-size", "8",
             "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--context-parallel-size", "1", "--decoder-first-pipeline-num-layers", "1", "--zero-stage", "1",
             "--micro-batch-size", "1"]
    plan_main([*flags, "--json", "--top", "100"])
    printed = json.loads(capsys.readouterr().out)
    sbh = 2048 * 1024 * 2  # a micro-batch's activations (bytes): each layer all-reduces them 4 times
    assert printed and all(entry["comm_stage"] == 1 for entry in printed)
    assert {entry["comm_bytes_per_step"]["tp"] / sbh for entry in printed if entry["recompute"] != "full"} \
        == {4 * 7}
    plan_main(flags)
    table = capsys.readouterr().out
    assert "comm GiB/step of a rank of the stage sending most (stage: dp / tp / pp / cp" in table
    assert table.count("| 1: ") == 10, table


def test_planner_honours_the_configs_layout_keys(capsys):
    """gpt-1.3b.yaml's tp 1, pp 1 and ZeRO 2 restrict the search as the flags do, and a flag replaces a key
    (--any-layout drops the file's keys); a tp wider than a node is refused in one line, naming where it
    came from."""
    preset = ["--config", "launch/configs/presets/gpt-1.3b.yaml", "--world-size", "16", "--json", "--top",
              "1000"]
    for flags, grid in (([], (1, 1, 2)),
                        (["--tensor-model-parallel-size", "2", "--zero-stage", "3"], (2, 1, 3))):
        plan_main([*preset, *flags])
        assert {(e["tp"], e["pp"], e["zero_stage"]) for e in json.loads(capsys.readouterr().out)} == {grid}
    plan_main([*preset, "--any-layout", "--zero-stage", "3"])
    searched = {(e["tp"], e["pp"], e["zero_stage"]) for e in json.loads(capsys.readouterr().out)}
    assert {stage for _, _, stage in searched} == {3} and len({(tp, pp) for tp, pp, _ in searched}) > 3
    for flags, message in (
            ([*preset, "--tensor-model-parallel-size", "16", "--world-size", "32"],
             "error: --tensor-model-parallel-size 16 does not fit in a node of --gpus-per-node 8: tp stays "
             "within one node"),
            (["--config", "launch/configs/presets/gpt-175b.yaml", "--world-size", "1024",
              "--gpus-per-node", "4"],
             "error: --tensor-model-parallel-size 8 (from --config launch/configs/presets/gpt-175b.yaml) "
             "does not fit in a node of --gpus-per-node 4")):
        with pytest.raises(SystemExit) as stop:
            plan_main(flags)
        assert str(stop.value.code).startswith(message) and "\n" not in str(stop.value.code), stop.value.code


def test_plan_help_shows_what_each_pretrain_flag_takes(capsys):
    """Numbers show N; a flag of text shows its choices or what the text is, never N."""
    from launch.tools.planning.plan_command import PLAN_FLAGS
    from pretrain.config.arguments import build_parser

    with pytest.raises(SystemExit):
        plan_main(["--help"])
    printed = capsys.readouterr().out
    for shown in ("--pipeline-schedule {gpipe,1f1b,interleaved,zb-h1,zbv,none}", "--optimizer NAME",
                  "--pipeline-model-parallel-layout LAYOUT", "--config FILE", "--num-layers N"):
        assert shown in printed, shown
    text = [option for action in build_parser()._actions if action.type in (None, str) and action.nargs != 0
            for option in action.option_strings if option in PLAN_FLAGS]
    assert text and not [flag for flag in text if re.search(rf"{flag} N\b", printed)]


def test_planner_drops_what_does_not_fit_before_timing_it(capsys):
    """A layout over --memory-per-device is priced no further: the layouts and figures printed are those
    of the search without the limit that fit it, in the same order."""
    flags = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
             "--seq-length", "1024", "--vocab-size", "32000", "--global-batch-size", "16", "--bf16",
             "--world-size", "8",
             "--gpus-per-node", "4", "--inter-node-bandwidth", "100Gbit", "--json", "--top", "100000"]
    plan_main([*flags, "--memory-per-device", "300MiB"])
    fitting = json.loads(capsys.readouterr().out)
    plan_main([*flags, "--memory-per-device", "1TiB"])
    every = json.loads(capsys.readouterr().out)
    assert 0 < len(fitting) < len(every)
    assert fitting == [entry for entry in every if entry["total_bytes"] <= 300 * 2**20]


def test_planner_takes_a_hybrid_pattern_of_any_length(capsys):
    """The pattern sets the layers (no --num-layers needed) and the search cuts them (its | set aside, said);
    an all-Mamba pattern, which has no attention heads, searches tp too."""
    common = ["--world-size", "4", "--memory-per-device", "80GiB", "--hidden-size", "256", "--seq-length",
              "256", "--global-batch-size", "8", "--mamba-head-dim", "32", "--mamba-num-groups", "4"]
    plan_main([*common, "--hybrid-layer-pattern", "M-M-*-|M-M-*-", "--num-attention-heads", "4", "--json",
               "--pipeline-model-parallel-size", "2"])
    printed = capsys.readouterr().out
    assert "priced without its |" in printed
    layouts = json.loads(printed[printed.index("["):])
    assert layouts and {entry["pp"] for entry in layouts} == {2}
    plan_main([*common, "--hybrid-layer-pattern", "MMMM", "--num-attention-heads", "1", "--json",
               "--tensor-model-parallel-size", "2"])
    assert {entry["tp"] for entry in json.loads(capsys.readouterr().out)} == {2}
