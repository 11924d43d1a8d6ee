"""Scaling laws from a sweep's table: Chinchilla's three approaches with bootstrap intervals; and muP's
coordinate check (``coord-check``: ``coord_check``).

    python -m launch.scaling_law fit RESULTS.csv --output DIR [--loss-column val_loss]
        [--params-column parameters] [--budget FLOPS ...] [--bootstrap 200] [--seed 0]

RESULTS.csv is ``launch.sweep``'s table or any CSV with columns ``parameters`` (N), ``tokens`` (D) or
``flops`` (C; then D = C / 6N, and without ``flops`` C = 6ND, each said in the output) and a loss
column. Hoffmann et al.'s three fits (``scaling_fits``), each refitted on runs resampled with
replacement for its 90% intervals (Besiroglu et al. 2024 showed how narrow unbootstrapped ones are):

1. the envelope: runs no other run beats with fewer FLOPs; N and D of those against C as power laws;
2. IsoFLOP profiles: runs whose FLOPs agree within 5% form a budget; per budget a parabola of loss in
   log N, its vertex the optimal size (and tokens, interpolated in log D); N_opt ~ C^a, D_opt ~ C^b;
3. the parametric law L(N, D) = E + A / N^alpha + B / D^beta, minimising the Huber loss (delta 1e-3) of
   log L with L-BFGS (scipy) from Hoffmann's grid of starts; the objective reported.

For each ``--budget`` the compute-optimal N, D and loss by Approaches 2 and 3 (Approach 3 with
C = k N D, k the runs' median FLOPs per parameter-token: our FLOPs count attention, so k > 6). A budget
beyond the sweep's is answered as an extrapolation, marked so (``extrapolated`` in fit.json, in the
table); one where a law gives no finite value is refused, naming it.

A WSD sweep's table (its points cooldown branches) adds the study's compute against separate runs of
its points (``study`` in fit.json, from ``sweep.json``).

DIR/fit.json (every number, schema below), DIR/isoflop.png (the profiles and their vertices),
DIR/frontier.png (N_opt and D_opt against C with their bands), DIR/law.png (loss against FLOPs per
size with the fitted law), DIR/residuals.png (Approach 3's residuals); a summary table on stdout, and
the fit logged to the sweep's wandb group when the sweep had one (``sweep.json`` beside the table).

fit.json::

    {"input": {"path", "rows", "loss_column", "params_column", "notes": [str]},
     "flops_per_parameter_token": k, "bootstrap": {"resamples", "interval": 0.9, "seed"},
     "approach1": {"a", "b", "points": [{"flops", "parameters", "tokens", "loss"}], "ci90": {"a", "b"}},
     "approach2": {"a", "b", "ci90": {"a", "b"}, "skipped": [str],
                   "budgets": [{"flops", "sizes", "parameters", "tokens", "loss", "extrapolated",
                                "ci90": {"parameters", "tokens", "loss"}}]},
     "approach3": {"A", "B", "E", "alpha", "beta", "objective", "huber_delta", "starts", "ci90": {...}},
     "optimal": [{"flops", "approach": 2 or 3, "parameters", "tokens", "loss", "extrapolated",
                  "ci90": {"parameters", "tokens", "loss"}}]}

``ci90`` values are [low, high]; a quantity no resample could fit has none.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

import numpy as np

from launch.tools.scaling import coord_check
from launch.tools.scaling.scaling_fits import (FitError, Runs, approach1, approach2, approach3, bootstrap,
                                               optimal_points)
from launch.tools.scaling.scaling_plots import plot_all
from launch.help_text import help_description


def read_runs(path: str, loss_column: str = "val_loss",
              params_column: str = "parameters") -> tuple[Runs, list]:
    """The runs of a CSV and the notes on what was derived; FitError naming a missing column or a bad
    value."""
    try:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            rows, columns = list(reader), list(reader.fieldnames or [])
    except OSError as error:
        raise FitError(f"{path}: {error.strerror}") from None
    if columns and not rows:
        raise FitError(f"{path}: a header ({', '.join(columns)}) and no run: the sweep has written no "
                       "result yet")
    missing = [name for name in (params_column, loss_column) if name not in columns]
    if "tokens" not in columns and "flops" not in columns:
        missing.append("tokens (or flops)")
    if missing:
        raise FitError(f"{path}: no column {', '.join(missing)} (it has {', '.join(columns) or 'none'}); "
                       "name others with --loss-column / --params-column")
    notes = []

    def values(column: str) -> np.ndarray:
        out = []
        for number, row in enumerate(rows, 2):  # line 1 is the header
            try:
                value = float(row[column])
            except (TypeError, ValueError):
                value = math.nan
            if not math.isfinite(value) or value <= 0:
                raise FitError(f"{path} line {number}: {column} is {row[column]!r}; every value must be a "
                               "finite number > 0")
            out.append(value)
        return np.array(out)

    parameters, loss = values(params_column), values(loss_column)
    if "tokens" in columns:
        tokens = values("tokens")
        flops = values("flops") if "flops" in columns else 6 * parameters * tokens
        if "flops" not in columns:
            notes.append("no flops column: C = 6 N D")
    else:
        flops = values("flops")
        tokens = flops / (6 * parameters)
        notes.append("no tokens column: D = C / (6 N)")
    labels = [row.get("model") or f"{int(n):,}" for row, n in zip(rows, parameters)]
    return Runs(parameters, tokens, flops, loss, labels), notes


def fit(runs: Runs, budgets: list[float], resamples: int, seed: int) -> dict:
    """Every approach, its bootstrap intervals and the optimal points at ``budgets``, as fit.json holds
    them."""
    if len(runs.loss) < 5:
        raise FitError(f"{len(runs.loss)} rows cannot fit Approach 3's 5 parameters (E, A, B, alpha, beta): "
                       "give at least 5 runs")
    first, second, third = approach1(runs), approach2(runs), approach3(runs)
    result = {"flops_per_parameter_token": runs.flops_per_parameter_token(),
              "approach1": first, "approach2": second, "approach3": third}
    result["optimal"] = optimal_points(runs, second, third, budgets)
    for point in result["optimal"]:
        values = [point[key] for key in ("parameters", "tokens", "loss")]
        if not all(math.isfinite(value) and value > 0 for value in values):
            found = ", ".join(f"{value:.3g}" for value in values)
            raise FitError(f"--budget {point['flops']:g}: Approach {point['approach']}'s law gives no finite "
                           f"optimum there (N, D, loss = {found}; the sweep's budgets span "
                           f"{runs.flops.min():.3g} to {runs.flops.max():.3g} FLOPs): give a budget nearer "
                           "them")
    bootstrap(runs, result, budgets, resamples, np.random.default_rng(seed))
    return result


def summary(result: dict) -> str:
    """The fit as a table for the terminal."""
    def interval(block: dict, key: str, form: str = "{:.3g}") -> str:
        low_high = block.get("ci90", {}).get(key)
        return f"[{form.format(low_high[0])}, {form.format(low_high[1])}]" if low_high else "[-]"

    lines = ["approach | quantity | value | 90% interval", "---|---|---|---"]
    for number, keys in ((1, ("a", "b")), (2, ("a", "b")), (3, ("E", "A", "B", "alpha", "beta"))):
        block = result[f"approach{number}"]
        for key in keys:
            if block.get(key) is not None:
                lines.append(f"{number} | {key} | {block[key]:.4g} | {interval(block, key)}")
    lines.append(f"3 | objective (Huber, delta {result['approach3']['huber_delta']:g}) | "
                 f"{result['approach3']['objective']:.4g} | ")
    for budget in result["approach2"]["budgets"]:
        lines.append(f"2 | N_opt at C = {budget['flops']:.3g} ({budget['sizes']} sizes) | "
                     f"{budget['parameters']:.4g} | {interval(budget, 'parameters')}")
    for point in result["optimal"]:
        beyond = " (extrapolated beyond the sweep's budgets)" if point.get("extrapolated") else ""
        lines.append(f"{point['approach']} | optimum at C = {point['flops']:.3g}{beyond}: N, D, loss | "
                     f"{point['parameters']:.4g}, {point['tokens']:.4g}, {point['loss']:.4g} | "
                     f"N {interval(point, 'parameters')}")
    return "\n".join(lines)


def _sweep_record(table: str) -> dict:
    """The record of the sweep that wrote ``table`` (its sweep.json), or {} for another table."""
    meta = os.path.join(os.path.dirname(os.path.abspath(table)), "sweep.json")
    if not os.path.exists(meta):
        return {}
    with open(meta) as handle:
        return json.load(handle)


def _log_to_wandb(sweep: dict, result: dict, output: str) -> bool:
    """Log the fit to the wandb group of the sweep (its record), if it had one."""
    if not sweep.get("wandb_project"):
        return False
    import wandb

    run = wandb.init(project=sweep["wandb_project"], group=sweep["name"], name=f"{sweep['name']}-scaling-law",
                     job_type="scaling-law", dir=output, mode=os.environ.get("WANDB_MODE", "offline"))
    third = result["approach3"]
    run.summary.update({f"approach3/{key}": third[key]
                        for key in ("A", "B", "E", "alpha", "beta", "objective")})
    run.summary.update({f"approach2/{key}": result["approach2"][key] for key in ("a", "b")
                        if result["approach2"].get(key) is not None})
    run.log({name: wandb.Image(os.path.join(output, f"{name}.png"))
             for name in ("isoflop", "frontier", "law", "residuals")})
    run.finish()
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.scaling_law",
                                     description=help_description(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fitting = commands.add_parser("fit", help="fit the three approaches to a results table")
    fitting.add_argument("table", help="RESULTS.csv")
    fitting.add_argument("--output", required=True, help="directory for fit.json and the plots")
    fitting.add_argument("--loss-column", default="val_loss")
    fitting.add_argument("--params-column", default="parameters")
    fitting.add_argument("--budget", type=float, nargs="+", default=[], help="FLOPs to give optima for")
    fitting.add_argument("--bootstrap", type=int, default=200, help="resamples for the intervals")
    fitting.add_argument("--seed", type=int, default=0)
    coord_check.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "coord-check":
        try:
            coord_check.run(args)
        except ValueError as error:
            sys.exit(f"error: {error}")
        return
    bad = [budget for budget in args.budget if not (math.isfinite(budget) and budget > 0)]
    if bad:
        sys.exit(f"error: --budget {bad[0]:g}: give compute budgets as FLOPs > 0, e.g. --budget 1e13 1e14")
    sweep, study = _sweep_record(args.table), None
    if sweep.get("mode") == "wsd":  # its points are cooldown branches: what they cost, said first
        study = {key: sweep[key] for key in ("branch_iters", "cooldown_fraction", "study_flops",
                                             "separate_flops", "study_fraction")}
        print(f"study compute: {sweep['study_flops']:.3g} FLOPs (stable runs and cooldowns from "
              f"{len(sweep['branch_iters'])} branch points) against {sweep['separate_flops']:.3g} for "
              f"separate runs of the points: {sweep['study_fraction']:.0%}", flush=True)
    try:
        runs, notes = read_runs(args.table, args.loss_column, args.params_column)
        for note in notes:
            print(f"note: {note}")
        result = fit(runs, args.budget, args.bootstrap, args.seed)
    except FitError as error:
        sys.exit(f"error: {error}")
    for skipped in result["approach2"]["skipped"]:
        print(f"note: approach 2: {skipped}")
    beyond = sorted({point["flops"] for point in result["optimal"] if point["extrapolated"]})
    if beyond:
        print(f"note: --budget {', '.join(f'{flops:g}' for flops in beyond)} beyond the sweep's budgets "
              f"({runs.flops.min():.3g} to {runs.flops.max():.3g} FLOPs): their optima are extrapolations")
    result = {"input": {"path": os.path.abspath(args.table), "rows": len(runs.loss),
                        "loss_column": args.loss_column, "params_column": args.params_column, "notes": notes},
              "bootstrap": {"resamples": args.bootstrap, "interval": 0.9, "seed": args.seed}, **result}
    if study:
        result["study"] = study
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "fit.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    plot_all(runs, result, args.output)
    print(summary(result))
    logged = _log_to_wandb(sweep, result, args.output)
    print(f"wrote {args.output}/fit.json and isoflop, frontier, law, residuals .png"
          + (" (logged to the sweep's wandb group)" if logged else ""))


if __name__ == "__main__":
    main()
