"""The launch commands as a user meets them: every ``python -m launch...`` path the README, docs and configs
name is a command; the tools are split by concern behind short command modules; launch.plan refuses a size
or rate without a unit, says how far its search is and lists pretrain's flags in --help; launch.torchrun
takes torchrun's spelling of the process count; --help describes each command in whole sentences."""

import glob
import json
import importlib
import importlib.util
import os
import re

import pytest

from launch.tools.planning import plan_command as planner
from parallel.pipeline.partition import rank_layer_counts

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README_COMMANDS = {"launch.plan", "launch.sweep", "launch.scaling_law", "launch.chaos",
                   "launch.tools.fault_sweep", "launch.tools.gpu_check", "launch.torchrun"}
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]


def _named_modules() -> tuple[set[str], set[str]]:
    """(every ``launch.X...`` module named in the README, docs/, the configs and scripts; those of them run
    as ``python -m``, ``-m`` or a launcher's ``ENTRY``)."""
    paths = [os.path.join(REPOSITORY, name) for name in ("README.md", ".ci/run", "launch/slurm.sbatch")]
    for pattern in ("docs/*.md", "launch/*.sh", "launch/configs/**/*.yaml"):
        paths += glob.glob(os.path.join(REPOSITORY, pattern), recursive=True)
    named, run = set(), set()
    for path in paths:
        with open(path) as handle:
            text = handle.read()
        named.update(re.findall(r"\blaunch(?:\.[A-Za-z_]\w*)+", text))
        run.update(re.findall(r"(?:-m |ENTRY:-|ENTRY=\"?)(launch(?:\.[A-Za-z_]\w*)+)", text))
    return named, run


def test_every_launch_module_the_docs_name_exists_and_each_command_runs():
    named, run = _named_modules()
    assert README_COMMANDS <= run, README_COMMANDS - run
    for name in sorted(named):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, f"{name} is named but is no module"
        if name in run:
            with open(spec.origin) as handle:
                assert 'if __name__ == "__main__":' in handle.read(), f"{name} does not run as python -m"


def test_the_tools_are_split_by_concern_behind_short_command_modules():
    tools = os.path.join(REPOSITORY, "launch", "tools")
    assert sorted(name for name in os.listdir(tools) if name != "__pycache__") == [
        "__init__.py", "draft.py", "fault_sweep.py", "faults", "gpu_check.py", "planning",
        "readme_commands.py", "scaling"]
    concerns = {"planning": {"plan", "plan_command", "layout", "layout_price", "activation_price",
                             "layer_parts", "muon_price", "link_model", "devices", "schedule_price"},
                "scaling": {"sweep", "isoflop", "scaling_law", "scaling_fits", "scaling_plots", "wsd_study",
                            "prose_corpus", "coord_check"},
                "faults": {"fault_sweep", "fault_injection", "chaos"}}
    for concern, modules in concerns.items():
        found = {name[:-3] for name in os.listdir(os.path.join(tools, concern)) if name.endswith(".py")}
        assert found == modules | {"__init__"}, (concern, found)
    for command, home in (("launch/plan.py", "launch.tools.planning.plan_command"),
                          ("launch/sweep.py", "launch.tools.scaling.sweep"),
                          ("launch/scaling_law.py", "launch.tools.scaling.scaling_law"),
                          ("launch/chaos.py", "launch.tools.faults.chaos"),
                          ("launch/tools/fault_sweep.py", "launch.tools.faults.fault_sweep")):
        with open(os.path.join(REPOSITORY, command)) as handle:
            text = handle.read()
        assert f"from {home} import main\n" in text and len(text.splitlines()) <= 6, command  # no copied code


@pytest.mark.parametrize("flag, value, message", [
    ("--memory-per-device", "80", "error: --memory-per-device '80' has no unit: write 80GiB (or 80GB); a "
                                  "number alone would be 80 bytes"),
    ("--memory-per-device", "lots", "error: --memory-per-device 'lots' is not a size: give a number and a "
                                    "unit, e.g. 80GiB or 40GB"),
    ("--inter-node-bandwidth", "100", "error: --inter-node-bandwidth '100' has no unit: write 100Gbit (or "
                                      "100GB/s)"),
    ("--intra-node-bandwidth", "fast", "error: --intra-node-bandwidth 'fast' is not a bandwidth"),
])
def test_plan_refuses_a_size_or_rate_without_a_unit_in_one_line(flag, value, message):
    with pytest.raises(SystemExit) as stop:
        planner.main([*TINY, "--world-size", "4", flag, value])
    assert str(stop.value.code).startswith(message) and "\n" not in str(stop.value.code), stop.value.code
    assert planner.parse_bytes("80gib") == planner.parse_bytes("80 GiB") == 80 * 2**30
    assert planner.parse_bytes("40GB") == 40 * 10**9


@pytest.mark.parametrize("flags, message", [
    (["--world-size", "0"], "error: --world-size 0: give the devices, at least 1"),
    (["--world-size", "-4"], "error: --world-size -4: give the devices, at least 1"),
    (["--world-size", "8", "--top", "0"], "error: --top 0: give the layouts to print, at least 1"),
    (["--world-size", "8", "--global-batch-size", "0"], "error: --global-batch-size 0: give at least 1"),
    (["--world-size", "8", "--num-layers", "0"], "error: --num-layers must be >= 1, got 0"),
    (["--world-size", "8", "--hidden-size", "63"], "error: --num-attention-heads 4 does not divide "
                                                   "--hidden-size 63"),
    (["--world-size", "8", "--seq-length", "-5"], "error: --seq-length must be >= 1, got -5"),
    (["--world-size", "8", "--num-experts", "3", "--moe-router-topk", "5"],
     "error: --moe-router-topk 5 must be between 1 and --num-experts 3"),
    (["--world-size", "8", "--num-experts", "4", "--expert-model-parallel-size", "3"],
     "error: --expert-model-parallel-size 3 does not divide --num-experts 4"),
    # sizes the world cannot hold, and cuts of the layers pretrain refuses
    (["--world-size", "8", "--pipeline-model-parallel-size", "3"],
     "error: --world-size 8 is not divisible by --pipeline-model-parallel-size 3"),
    (["--world-size", "8", "--tensor-model-parallel-size", "3"],
     "error: --world-size 8 is not divisible by --tensor-model-parallel-size 3"),
    (["--world-size", "8", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "9"],
     "error: --decoder-first-pipeline-num-layers 9: leaves -1 of --num-layers 8 for the other 1 stage(s)"),
    (["--world-size", "8", "--num-layers", "8", "--pipeline-model-parallel-size", "8", "--pipeline-schedule",
      "zbv"], "error: zbv: --num-layers 8 is not divisible by --pipeline-model-parallel-size 8 x "
              "--virtual-pipeline-size 2"),
    (["--world-size", "8", "--num-layers", "8", "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
      "zbv", "--pipeline-layers-per-stage", "3", "5"],
     "error: --pipeline-layers-per-stage: a stage of 3 layers does not cut into its 2 virtual chunks"),
    (["--world-size", "8", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "E|t*4|t*3|tL"],
     "error: no layout of 8 devices runs as asked: at the last tried, --pipeline-schedule interleaved needs"),
    (["--world-size", "8", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Et|tmL"], "error: --pipeline-model-parallel-layout 'Et|tmL': "
                                                      "multi-token prediction layers (m) are not built here"),
])
def test_plan_refuses_a_model_or_size_that_cannot_be_in_one_line(flags, message):
    with pytest.raises(SystemExit) as stop:
        planner.main([*TINY, *flags])
    assert str(stop.value.code).startswith(message) and "\n" not in str(stop.value.code), stop.value.code


def test_plan_prices_what_pretrain_runs(capsys):
    """Agreement with pretrain: 7 layers cut 1 + 2 + 2 + 2 over pp4 (Megatron's first-stage count), ZBV with
    an explicit split (each stage's layers over its two chunks), a layout string, a model of 4 layers at
    pp2 with Megatron's default batch (one micro-batch a step): each priced, with its cut shown (an
    interleaved layout string at one micro-batch a step is refused above, as pretrain refuses it)."""
    cases = [(["--num-layers", "7", "--decoder-first-pipeline-num-layers", "1",
               "--pipeline-model-parallel-size", "4"], {(1, 2, 2, 2)}),
             (["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
               "--pipeline-layers-per-stage", "2", "6"], {(2, 6)}),
             (["--num-layers", "8", "--pipeline-model-parallel-size", "2",
               "--pipeline-model-parallel-layout", "E|t*4|t*3|tL", "--global-batch-size", "16"], {(3, 5)}),
             (["--pipeline-model-parallel-size", "2"], {None})]
    for flags, cuts in cases:
        planner.main([*TINY, "--world-size", "8", *flags, "--json"])
        layouts = json.loads(capsys.readouterr().out)
        assert layouts, flags
        assert {tuple(rank_layer_counts(layout["split"], layout["pp"], layout["schedule"] == "zbv"))
                if layout["split"] else None for layout in layouts} == cuts, flags


def test_plan_skips_the_grids_that_cannot_hold_the_expert_size_asked(capsys):
    """--expert-model-parallel-size 4 on 8 devices: the layouts whose etp (their tp) x 4 does not divide
    the ranks are skipped, not a traceback; those that can are priced."""
    planner.main([*TINY, "--world-size", "8", "--num-experts", "8", "--expert-model-parallel-size", "4",
                  "--json"])
    layouts = json.loads(capsys.readouterr().out)
    assert layouts and {layout["ep"] for layout in layouts} == {4} and all(
        8 % (layout["tp"] * 4) == 0 for layout in layouts)


def test_plan_says_how_far_its_search_is_on_stderr(monkeypatch, capsys):
    flags = [*TINY, "--world-size", "4", "--memory-per-device", "1GiB", "--inter-node-bandwidth", "10Gbit",
             "--top", "1"]
    planner.main(flags)  # a search shorter than the interval says nothing
    assert "layouts priced" not in capsys.readouterr().err
    monkeypatch.setattr(planner, "PROGRESS_INTERVAL", 0.0)
    planner.main(flags)
    said = capsys.readouterr().err.splitlines()
    counts = [re.fullmatch(r"launch\.plan: (\d+) / (\d+) layouts priced, \d+ s( \(about \d+ s left\))?", line)
              for line in said]
    assert said and all(counts), said
    done, totals = [int(match[1]) for match in counts], {int(match[2]) for match in counts}
    assert len(totals) == 1 and done[0] == 0 and done[-1] == totals.pop() > 1 and done == sorted(done)


def test_plan_help_lists_config_and_the_model_flags(capsys):
    with pytest.raises(SystemExit) as stop:
        planner.main(["--help"])
    assert stop.value.code == 0
    printed = capsys.readouterr().out
    for flag in ("--config FILE", "--num-layers N", "--hidden-size N", "--num-attention-heads N",
                 "--seq-length N", "--global-batch-size N", "--tensor-model-parallel-size N",
                 "--zero-stage N", "--bf16, --no-bf16", "--memory-per-device SIZE",
                 "--inter-node-bandwidth RATE"):
        assert flag in printed, flag
    assert ("Every flag of python -m pretrain and every key of a --config YAML is accepted"
            in " ".join(printed.split()))


def test_torchrun_takes_torchruns_spelling_of_the_process_count(monkeypatch):
    import launch.torchrun as launcher

    started = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda arguments: started.append(arguments) or 0)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # main exports OMP_NUM_THREADS
    for spelling in (["--nproc-per-node", "2"], ["--nproc_per_node=2"], ["--nproc", "2"]):
        with pytest.raises(SystemExit) as stop:
            launcher.main([*spelling, "--train-iters", "3"])
        assert stop.value.code == 0
    assert started == [launcher.torchrun_arguments(2, ["--train-iters", "3"])] * 3


@pytest.mark.parametrize("module, says", [
    ("launch.torchrun", "Every other flag goes to python -m pretrain unchanged (python -m pretrain --help "
                        "lists them)"),
    ("launch.tools.fault_sweep", "The cases' pretrain flags are fixed (python -m pretrain --help lists every "
                                 "flag); this command takes only the options below."),
    # benchmarks whose first docstring line used to end mid-sentence
    ("launch.bench.moe", "each run in a torchrun world of its own on the built-in corpus"),
    ("launch.bench.pipeline", "on a plain-torch GPT of the same shape (its own world)."),
    ("launch.bench.offload", "on a GPT whose optimizer states dominate its model states."),
    ("launch.bench.checkpoint", "the memory a re-cut and a conversion take beyond the largest saved piece"),
])
def test_help_describes_the_command_in_whole_sentences(module, says, capsys):
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    description = " ".join(capsys.readouterr().out.split("\n\n")[1].split())
    assert description.endswith(".") and says in description, description


def test_the_readme_runs_the_isoflop_preset_as_the_preset_says():
    """The README's IsoFLOP example: the preset's budgets for the fit and the preset's time."""
    with open(os.path.join(REPOSITORY, "launch", "configs", "sweep-isoflop-cpu.yaml")) as handle:
        preset = handle.read()
    with open(os.path.join(REPOSITORY, "README.md")) as handle:
        readme = handle.read()
    fit = (r"python -m launch\.scaling_law fit runs/sweeps/cpu-isoflop/\S+ --output \S+ \\\s+"
           r"--budget ([\de+. ]+)")
    budgets = [re.search(fit, text.replace("\n#", "\n"))[1].split() for text in (preset, readme)]
    assert budgets[0] == budgets[1], budgets
    sweep = readme.index("python -m launch.sweep launch/configs/sweep-isoflop-cpu.yaml")
    said = re.findall(r"about (\d+) minutes", readme[readme.rindex("```", 0, sweep):sweep])
    assert said == re.findall(r"about (\d+) minutes on 2 cores", preset), said
