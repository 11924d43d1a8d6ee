"""Scaling-study sweeps: ``python -m launch.sweep SWEEP.yaml`` trains a grid of runs and tabulates them.

Three modes. ``grid`` (the default): model sizes x layouts x learning rates x seeds, every run for
``train_iters`` at the same tokens per step. ``isoflop``: model sizes x compute ``budgets``, each run's
iterations chosen so that its training FLOPs meet its budget (``isoflop``; sizes listed or from a
depth/width rule), for ``python -m launch.scaling_law fit``. ``wsd``: one warmup-stable-decay run per
model, layout, rate and seed, and cooldown branches from its stable checkpoints, one row per point of
``branch_iters`` at a fraction of separate runs' compute (``wsd_study``). Each run is one ``python -m
pretrain`` on its layout's processes, a member of the wandb group named after the sweep (when
``wandb_project`` is set), and one row of ``OUTPUT/results.csv``: parameters with and without embeddings,
the final training loss and, with ``eval_iters``, the held-out validation loss at the end (``val_loss``),
tokens, the exact training FLOPs, tokens/s, model-state and peak memory per rank. Per-iteration metrics
stay in ``OUTPUT/runs/RUN.jsonl``; ``OUTPUT/sweep.json`` records the sweep (mode, budgets, the FLOPs
formula, the wandb group). A row is written as soon as its run ends, so an interrupted sweep started
again skips the finished runs. At the end ``OUTPUT/sweep.png`` plots loss against training FLOPs per
model size (a WSD study: loss against tokens, each stable run beside its branches), and throughput and
memory per layout. A sweep file::

    name: cpu-scaling
    output: runs/sweeps/cpu-scaling
    tokens_per_step: 2048
    seq_length: 64
    train_iters: 20                # grid mode
    eval_iters: 8                  # validation batches at the end (omit: no val_loss)
    wandb_project: null            # a project name: every run joins group "cpu-scaling"
    common: {micro_batch_size: 2, lr_warmup_iters: 2}
    models:                        # name: model flags (as in a pretrain YAML)
      2l-64: {num_layers: 2, hidden_size: 64, num_attention_heads: 4}
      4l-128: {num_layers: 4, hidden_size: 128, num_attention_heads: 4}
    layouts:                       # name: processes and parallel flags
      dp2: {nproc: 2}
      tp2: {nproc: 2, tensor_model_parallel_size: 2}
    lrs: [3.0e-3, 1.0e-3]
    seeds: [1]

An IsoFLOP sweep replaces ``train_iters`` with ``mode: isoflop``, ``budgets: [FLOPs, ...]`` and
optionally ``min_iters`` (default 20) / ``max_iters``, and may give ``sizes: {layers: [...],
width_per_layer: W, head_dim: H}`` (and ``pattern: P``: each size a hybrid of P repeated) instead of
``models``. A WSD study replaces it with ``mode: wsd``,
``branch_iters: [N, ...]`` and optionally ``cooldown_fraction`` (default 0.2; the decay's shape is
``lr_wsd_decay_style`` in ``common``) and ``separate: [wsd, cosine]``: separate runs of every point from
scratch, their rows in ``OUTPUT/separate.csv``, each branch's loss printed beside theirs.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import sys

import yaml

from data.tokenizers.spec import build_tokenizer
from launch.pretrain_run import run_pretrain
from launch.tools.scaling import wsd_study
from launch.tools.scaling.isoflop import FLOPS_FORMULA, generated_models, plan_budget
from models.counting import flops_per_token, non_embedding_parameters, num_parameters
from models.config import GPTConfig
from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate
from launch.help_text import help_description

COLUMNS = ["run", "model", "layout", "lr", "seed", "budget", "train_iters", "parameters",
           "non_embedding_parameters", "final_loss", "val_loss", "tokens", "flops", "tokens_per_s",
           "model_state_bytes", "peak_mem_bytes"]
REQUIRED = {"grid": ("name", "output", "tokens_per_step", "seq_length", "train_iters", "layouts"),
            "isoflop": ("name", "output", "tokens_per_step", "seq_length", "budgets", "layouts"),
            "wsd": ("name", "output", "tokens_per_step", "seq_length", "branch_iters", "layouts")}


def settings_flags(settings: dict) -> list[str]:
    """{"num_layers": 2, "sequence_parallel": True} -> ["--num-layers", "2", "--sequence-parallel"]."""
    flags = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:  # 0 is a value (seed 0, no warm-up)
            flags += [flag, str(value)]
    return flags


def load_sweep(path: str) -> dict:
    """The sweep file, its models generated where it gives a size rule; ValueError naming what is wrong."""
    try:  # safe_load: a tag that would construct a Python object is refused, never run
        with open(path) as handle:
            sweep = yaml.safe_load(handle) or {}
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(error).split())})") from None
    if not isinstance(sweep, dict):
        raise ValueError(f"{path}: expected a mapping (name, output, models, ...)")
    mode = sweep.setdefault("mode", "grid")
    if mode not in REQUIRED:
        raise ValueError(f"{path}: mode {mode!r}: choose grid, isoflop or wsd")
    missing = [key for key in REQUIRED[mode] if key not in sweep]
    if "models" not in sweep and "sizes" not in sweep:
        missing.append("models (or sizes)")
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)} (see python -m launch.sweep --help)")
    _check_values(path, sweep)
    if sweep["tokens_per_step"] % sweep["seq_length"]:
        raise ValueError(f"{path}: tokens_per_step {sweep['tokens_per_step']} is not a multiple of "
                         f"seq_length {sweep['seq_length']}")
    if "sizes" in sweep:
        sweep["models"] = {**generated_models(sweep["sizes"]), **sweep.get("models", {})}
    if mode == "wsd":
        try:
            wsd_study.points(sweep)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
    return sweep


def _check_values(path: str, sweep: dict) -> None:
    """ValueError naming the key for a count, rate or table of the wrong kind."""
    def positive(key: str, value, kind=int) -> None:
        if kind is float and isinstance(value, str):  # YAML 1.1 reads 1e12 (no dot, no sign) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) \
                or value <= 0:
            what = "number" if kind is float else "whole number"
            raise ValueError(f"{path}: {key} {value!r}: give a {what} > 0")

    for key in ("tokens_per_step", "seq_length", "train_iters", "min_iters", "max_iters", "eval_iters"):
        if key in sweep and (key != "eval_iters" or sweep[key]):
            positive(key, sweep[key])
    for key in ("budgets", "lrs", "seeds"):
        if key in sweep and (not isinstance(sweep[key], list) or not sweep[key]):
            raise ValueError(f"{path}: {key} {sweep[key]!r}: give a list, e.g. {key}: [1, 2]")
    for budget in sweep.get("budgets", []):
        positive("a budget of", budget, float)
    for lr in sweep.get("lrs", []):
        positive("a learning rate of", lr, float)
    for key in ("models", "layouts", "common"):
        tables = {"common": sweep[key]} if key == "common" and key in sweep else sweep.get(key, {})
        if not isinstance(tables, dict) or not all(isinstance(value, dict) for value in tables.values()):
            raise ValueError(f"{path}: {key} must map names to settings, e.g. {key}: "
                             "{small: {num_layers: 2}}" if key != "common"
                             else f"{path}: common must be a mapping of settings")
    for name, layout in sweep["layouts"].items():
        positive(f"layout {name}'s nproc", layout.get("nproc", 1))


def check_runs(path: str, sweep: dict, runs: list[dict]) -> None:
    """Each run's pretrain settings validated at its world size before any run starts (ValueError naming the
    run and the flag): a bad model or layout is said once, not after the runs before it."""
    seen = set()
    for run in runs:
        if (run["model"], run["layout"]) in seen:
            continue
        seen.add((run["model"], run["layout"]))
        nproc, settings = _settings(sweep, run)
        try:
            validate(parse_config(settings_flags(settings)), nproc)
        except ConfigError as error:
            raise ValueError(f"{path}: model {run['model']} with layout {run['layout']}: {error}") from None


def _settings(sweep: dict, run: dict) -> tuple[int, dict]:
    """(processes, pretrain settings) of one run."""
    layout = dict(sweep["layouts"][run["layout"]])
    nproc = layout.pop("nproc", 1)
    settings = {**sweep.get("common", {}), **sweep["models"][run["model"]], **layout,
                "seq_length": sweep["seq_length"],
                "global_batch_size": sweep["tokens_per_step"] // sweep["seq_length"],
                "train_iters": run["train_iters"], "lr": run["lr"], "seed": run["seed"], "log_interval": 1}
    if sweep["mode"] == "wsd":  # the stable run's data and schedule (a branch ends at its own point)
        settings.update(wsd_study.schedule_settings(sweep, run))
    if sweep.get("eval_iters"):  # one evaluation, after the last iteration (a branch's: at its end)
        settings.update(eval_interval=settings["train_iters"], eval_iters=sweep["eval_iters"])
    return nproc, settings


def model_config(sweep: dict, model: str) -> GPTConfig:
    """The model a run of ``model`` trains, as pretrain reads its flags (vocabulary from its tokenizer)."""
    config = parse_config(settings_flags({**sweep.get("common", {}), **sweep["models"][model],
                                  "seq_length": sweep["seq_length"]}))
    if config.model.vocab_size is None:  # the tokenizer's vocabulary (the built-in corpus's by default)
        config.model.vocab_size = (build_tokenizer(config.data.tokenizer_spec(None)).vocab_size
                                   if config.data.data_path else config.data.default_corpus_vocab_size)
    return config.model


def runs_of(sweep: dict) -> tuple[list[dict], list[str]]:
    """Every run of the sweep, in order (name, model, layout, learning rate, seed, budget, iterations),
    and why each size an IsoFLOP budget cannot hold is skipped."""
    lrs, seeds = sweep.get("lrs", [3e-4]), sweep.get("seeds", [1])
    if sweep["mode"] == "wsd":
        return wsd_study.branch_runs(sweep, studies_of(sweep)), []
    if sweep["mode"] == "grid":
        return [{"run": f"{model}-{layout}-lr{lr:g}-s{seed}", "model": model, "layout": layout, "lr": lr,
                 "seed": seed, "budget": "", "train_iters": sweep["train_iters"]}
                for model, layout, lr, seed in itertools.product(sweep["models"], sweep["layouts"], lrs,
                                                                 seeds)], []
    runs, skipped = [], []
    for budget, model in itertools.product(sweep["budgets"], sweep["models"]):
        iters, why = plan_budget(float(budget), model_config(sweep, model), sweep["tokens_per_step"],
                                 sweep.get("min_iters", 20), sweep.get("max_iters"))
        if why:
            skipped.append(f"{model} at {float(budget):.3g} FLOPs: {why}")
            continue
        runs += [{"run": f"{model}-C{float(budget):.3g}-{layout}-lr{lr:g}-s{seed}", "model": model,
                  "layout": layout, "lr": lr, "seed": seed, "budget": float(budget), "train_iters": iters}
                 for layout, lr, seed in itertools.product(sweep["layouts"], lrs, seeds)]
    return runs, skipped


def studies_of(sweep: dict) -> list[dict]:
    """A WSD sweep's stable runs: model x layout x learning rate x seed."""
    return [{"model": model, "layout": layout, "lr": lr, "seed": seed} for model, layout, lr, seed in
            itertools.product(sweep["models"], sweep["layouts"], sweep.get("lrs", [3e-4]),
                              sweep.get("seeds", [1]))]


def finished_runs(table: str) -> set[str]:
    """The runs a table already holds; ValueError for a table of other columns (an older sweep's)."""
    if not os.path.exists(table):
        return set()
    with open(table, newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames != COLUMNS:
            raise ValueError(f"{table} has the columns {', '.join(reader.fieldnames or [])}, not this "
                             "sweep's: give the sweep another output")
        return {row["run"] for row in reader}


def _pretrain(sweep: dict, run: dict, name: str, extra: dict, log: str, mode: str = "w") -> list[dict]:
    """Run ``run``'s pretrain with ``extra`` settings as wandb run ``name``; its metrics lines, written
    (``mode`` "a": appended) to ``runs/LOG.jsonl``."""
    nproc, settings = _settings(sweep, run)
    settings.update(extra)
    if sweep.get("wandb_project"):
        settings.update(wandb_project=sweep["wandb_project"], wandb_group=sweep["name"], wandb_exp_name=name)
    lines = run_pretrain(nproc, settings_flags(settings))
    with open(os.path.join(sweep["output"], "runs", f"{log}.jsonl"), mode) as handle:
        handle.writelines(json.dumps(line) + "\n" for line in lines)
    return lines


def train_run(sweep: dict, run: dict) -> dict:
    """Train one run (a WSD branch: its stable run's segment to the branch point first, where it is not
    saved yet); its row of the table."""
    extra = {}
    if "branch" in run:
        directory = wsd_study.stable_directory(sweep, run)
        if not wsd_study.stable_saved(directory, run["branch"][0]):
            stable = f"{wsd_study.study_key(run)}-stable"
            _pretrain(sweep, run, f"{stable}-to{run['branch'][0]}",
                      wsd_study.segment_flags(directory, run["branch"][0]), stable, mode="a")
        extra = wsd_study.branch_flags(directory, run["branch"])
    lines = _pretrain(sweep, run, run["run"], extra, run["run"])
    config = model_config(sweep, run["model"])
    tokens = sweep["tokens_per_step"] * run["train_iters"]
    timed = lines[1:] or lines
    return {**{key: value for key, value in run.items() if key in COLUMNS},
            "parameters": num_parameters(config),
            "non_embedding_parameters": non_embedding_parameters(config), "final_loss": lines[-1]["loss"],
            "val_loss": lines[-1].get("valid_loss", ""), "tokens": tokens,
            "flops": flops_per_token(config) * tokens,
            "tokens_per_s": sum(line["tokens_per_s"] for line in timed) / len(timed),
            "model_state_bytes": max(r["model_state_bytes"] for r in lines[-1]["per_rank"]),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in lines[-1]["per_rank"])}


def plot(sweep: dict, table: str, path: str) -> None:
    """Loss against training FLOPs per model size; tokens/s and peak memory per layout and model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(table, newline="") as handle:
        rows = list(csv.DictReader(handle))
    figure, (loss_axis, speed_axis, memory_axis) = plt.subplots(1, 3, figsize=(16, 4.5))
    for model in sweep["models"] if sweep["mode"] != "wsd" else []:
        mine = [row for row in rows if row["model"] == model]
        for row in mine[:1]:  # one trajectory per model size: its first run
            with open(os.path.join(sweep["output"], "runs", f"{row['run']}.jsonl")) as handle:
                lines = [json.loads(line) for line in handle]
            per_iteration = float(row["flops"]) / len(lines) if lines else 0
            loss_axis.plot([per_iteration * line["iteration"] for line in lines],
                           [line["loss"] for line in lines],
                           label=f"{model} ({int(row['parameters']) / 1e6:.2f}M)")
    if sweep["mode"] == "wsd":
        wsd_study.plot_branches(sweep, rows, loss_axis)
    else:
        loss_axis.set(xscale="log", xlabel="training FLOPs", ylabel="loss", title="loss vs compute")
        loss_axis.legend()
    layouts, models = list(sweep["layouts"]), list(sweep["models"])
    width = 0.8 / max(len(models), 1)
    for index, model in enumerate(models):
        for axis, column, scale in ((speed_axis, "tokens_per_s", 1), (memory_axis, "peak_mem_bytes", 2**-20)):
            values = [next((float(r[column]) * scale for r in rows
                            if r["model"] == model and r["layout"] == layout), 0)
                      for layout in layouts]
            axis.bar([i + index * width for i in range(len(layouts))], values, width, label=model)
    for axis, label in ((speed_axis, "tokens/s"), (memory_axis, "peak memory per rank (MiB)")):
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(layouts))], layouts)
        axis.set(ylabel=label, title=f"{label.split(' (')[0]} per layout")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.sweep", description=help_description(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("sweep", help="the sweep's YAML file")
    args = parser.parse_args(argv)
    try:
        sweep = load_sweep(args.sweep)
        table = os.path.join(sweep["output"], "results.csv")
        done = finished_runs(table)
        runs, skipped = runs_of(sweep)
        if not runs:
            raise ValueError(f"{args.sweep}: no run to train: {skipped[0] if skipped else 'no models'}"
                             + (f" (and {len(skipped) - 1} more skipped)" if len(skipped) > 1 else ""))
        check_runs(args.sweep, sweep, runs)
    except (OSError, ValueError, ConfigError) as error:
        sys.exit(f"error: {error}")
    os.makedirs(os.path.join(sweep["output"], "runs"), exist_ok=True)
    recorded = {key: sweep.get(key) for key in ("name", "mode", "budgets", "tokens_per_step", "seq_length",
                                                "wandb_project")} | {"flops_formula": FLOPS_FORMULA}
    if sweep["mode"] == "wsd":  # the study's compute against separate runs of its points
        per_iteration = {model: flops_per_token(model_config(sweep, model)) * sweep["tokens_per_step"]
                         for model in sweep["models"]}
        recorded.update(branch_iters=[n for n, _, _ in wsd_study.points(sweep)],
                        cooldown_fraction=sweep.get("cooldown_fraction", wsd_study.DEFAULT_COOLDOWN),
                        **wsd_study.compute(sweep, studies_of(sweep), per_iteration.get))
    with open(os.path.join(sweep["output"], "sweep.json"), "w") as handle:
        json.dump(recorded, handle, indent=1)
    print(f"sweep {sweep['name']} ({sweep['mode']}): {len(runs)} runs, "
          f"{len(done & {r['run'] for r in runs})} already finished; {FLOPS_FORMULA}")
    for why in skipped:
        print(f"skipped: {why}")
    _train_into(sweep, runs, table, done)
    separate = wsd_study.separate_runs(sweep, studies_of(sweep)) if sweep["mode"] == "wsd" else []
    if separate:  # a WSD study's separate runs of its points, to compare its branches with
        others = os.path.join(sweep["output"], "separate.csv")
        _train_into(sweep, separate, others, finished_runs(others))
        with open(table, newline="") as handle, open(others, newline="") as other:
            print("\n".join(wsd_study.comparison(list(csv.DictReader(handle)), list(csv.DictReader(other)))))
    plot(sweep, table, os.path.join(sweep["output"], "sweep.png"))
    print(f"table {table}, plot {os.path.join(sweep['output'], 'sweep.png')}")


def _train_into(sweep: dict, runs: list[dict], table: str, done: set[str]) -> None:
    """Train each run that ``table`` does not hold yet, its row appended as soon as it ends (an interrupted
    sweep resumes there)."""
    for number, run in enumerate(runs, 1):
        if run["run"] in done:
            continue
        print(f"[{number}/{len(runs)}] {run['run']} ({run['train_iters']} iterations)", flush=True)
        row = train_run(sweep, run)
        fresh = not os.path.exists(table)
        with open(table, "a", newline="") as handle:
            writer = csv.DictWriter(handle, COLUMNS)
            if fresh:
                writer.writeheader()
            writer.writerow(row)


if __name__ == "__main__":
    main()
