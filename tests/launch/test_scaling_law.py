"""Scaling-law fits against data drawn from a known law: Approach 2's exponent within a few hundredths,
Approach 3's parameters within their bootstrap intervals and its objective no worse than a minimisation
started from the truth; bad tables refused by name; a small, noisy sweep fitted without warnings, its
budgets beyond the sweep answered as extrapolations or refused naming --budget."""

import csv
import json
import math
import warnings

import numpy as np
import pytest

from launch.tools.scaling import scaling_law
from launch.tools.scaling.scaling_fits import Runs, minimise_law

TRUE = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}  # Hoffmann et al.'s law
BUDGETS = [1e18, 3e18, 1e19, 3e19, 1e20]


def _law(n, d):
    return TRUE["E"] + TRUE["A"] / n ** TRUE["alpha"] + TRUE["B"] / d ** TRUE["beta"]


def _write(path, rows, columns=("model", "parameters", "tokens", "flops", "val_loss")):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def _isoflop_rows(noise: float, seed: int = 0, sizes: int = 9) -> list[dict]:
    """IsoFLOP groups around the true optimum (a decade either side), loss times exp(noise x N(0, 1))."""
    rng = np.random.default_rng(seed)
    alpha, beta = TRUE["alpha"], TRUE["beta"]
    scale = (alpha * TRUE["A"] / (beta * TRUE["B"])) ** (1 / (alpha + beta))
    rows = []
    for flops in BUDGETS:
        optimum = scale * (flops / 6) ** (beta / (alpha + beta))
        for n in optimum * np.geomspace(0.1, 10, sizes):
            d = flops / (6 * n)
            rows.append({"model": f"{n:.3g}", "parameters": n, "tokens": d, "flops": flops,
                         "val_loss": _law(n, d) * math.exp(noise * rng.standard_normal())})
    return rows


def test_fits_recover_a_known_law_with_honest_intervals(tmp_path, capsys):
    table = _write(tmp_path / "results.csv", _isoflop_rows(noise=0.01))
    output = tmp_path / "fit"
    scaling_law.main(["fit", table, "--output", str(output), "--budget", "1e21", "--bootstrap", "60"])
    fit = json.loads((output / "fit.json").read_text())
    true_a = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])
    assert abs(fit["approach2"]["a"] - true_a) < 0.03, fit["approach2"]
    assert abs(fit["approach2"]["b"] - (1 - true_a)) < 0.03
    assert len(fit["approach2"]["budgets"]) == len(BUDGETS)
    third = fit["approach3"]
    for key in ("E", "alpha", "beta"):
        low, high = third["ci90"][key]
        assert low <= TRUE[key] <= high, (key, third[key], third["ci90"][key])
    # no worse than a minimisation started from the truth
    runs, _ = scaling_law.read_runs(table)
    truth = np.array([math.log(TRUE["A"]), math.log(TRUE["B"]), math.log(TRUE["E"]), TRUE["alpha"],
                      TRUE["beta"]])
    reference = minimise_law(runs, truth[None, :])[0][0]
    assert third["objective"] <= reference + 1e-12, (third["objective"], reference)
    optimal = {point["approach"]: point for point in fit["optimal"]}
    assert set(optimal) == {2, 3} and all(point["flops"] == 1e21 for point in optimal.values())
    low, high = optimal[2]["ci90"]["parameters"]
    assert low < optimal[2]["parameters"] < high
    for name in ("isoflop", "frontier", "law", "residuals"):
        assert (output / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "| a |" in printed and "objective" in printed


def test_a_table_of_flops_only_and_a_budget_of_two_sizes_are_said(tmp_path, capsys):
    rows = _isoflop_rows(noise=0.005, sizes=5)
    rows += [{"parameters": 3e9, "flops": 3e21, "val_loss": 2.0}, {"parameters": 5e9, "flops": 3e21,
                                                                     "val_loss": 2.01}]
    table = _write(tmp_path / "flops.csv", rows, ("parameters", "flops", "val_loss"))
    scaling_law.main(["fit", table, "--output", str(tmp_path / "fit"), "--bootstrap", "5"])
    printed = capsys.readouterr().out
    assert "no tokens column: D = C / (6 N)" in printed
    assert "the budget of 3e+21 FLOPs has 2 model sizes; a parabola needs 3: skipped" in printed


@pytest.mark.parametrize("rows, columns, message", [
    ([{"parameters": 1e6, "tokens": 1e9, "loss": 3.0}], ("parameters", "tokens", "loss"),
     r"no column val_loss \(it has parameters, tokens, loss\); name others with --loss-column"),
    ([{"parameters": 1e6, "val_loss": 3.0}], ("parameters", "val_loss"), "no column tokens \\(or flops\\)"),
    ([{"parameters": -1, "tokens": 1e9, "val_loss": 3.0}], ("parameters", "tokens", "val_loss"),
     "line 2: parameters is '-1'; every value must be a finite number > 0"),
    ([{"parameters": 1e6, "tokens": 1e9, "val_loss": "nan"}], ("parameters", "tokens", "val_loss"),
     "line 2: val_loss is 'nan'"),
    ([{"parameters": 1e6 * (i + 1), "tokens": 1e9, "val_loss": 3.0} for i in range(4)],
     ("parameters", "tokens", "val_loss"), "4 rows cannot fit Approach 3's 5 parameters"),
    ([], ("parameters", "tokens", "val_loss"),
     r"a header \(parameters, tokens, val_loss\) and no run: the sweep has written no result yet"),
])
def test_bad_tables_are_refused_naming_the_column_row_or_count(tmp_path, rows, columns, message):
    table = _write(tmp_path / "bad.csv", rows, columns)
    with pytest.raises(SystemExit, match=message):
        scaling_law.main(["fit", table, "--output", str(tmp_path / "fit")])


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps 0: give 1 or more"), (["--head-dim", "0"], "--head-dim 0: give 1 or more"),
    (["--widths", "0", "64"], "--widths 0: give 1 or more"), (["--lr", "0"], "--lr 0: give a learning rate")])
def test_coord_check_refuses_bad_counts_naming_the_flag(tmp_path, flags, message):
    with pytest.raises(SystemExit, match=f"^error: {message}"):
        scaling_law.main(["coord-check", "--output", str(tmp_path), *flags])
    assert not any(tmp_path.iterdir())


def test_runs_within_five_percent_of_flops_form_one_budget():
    runs = Runs(np.ones(5), np.ones(5), np.array([100.0, 104.0, 106.0, 300.0, 310.0]), np.ones(5), [""] * 5)
    assert runs.budget.tolist() == [0, 0, 1, 2, 2]


# A small IsoFLOP sweep as the CPU preset gives one: 3 budgets x 4 sizes, losses that follow no clean law,
# the largest budget's loss still falling across its sizes (its minimum lies far beyond them)
SMALL_SIZES = (2.0e4, 4.5e4, 8.0e4, 1.8e5)
SMALL_LOSSES = {3e11: (4.52, 4.41, 4.47, 4.71), 1e12: (4.31, 4.12, 4.09, 4.22),
                3e12: (4.2, 4.0391, 3.9266, 3.7702)}


def _small_sweep(path):
    return _write(path, [{"model": f"{n:.3g}", "parameters": n, "tokens": flops / (7 * n), "flops": flops,
                          "val_loss": loss}
                         for flops, losses in SMALL_LOSSES.items() for n, loss in zip(SMALL_SIZES, losses)])


@pytest.mark.parametrize("budgets", [[], ["1e12", "1e14", "1e15"]])
def test_a_small_sweep_is_fitted_without_warnings_and_budgets_beyond_it_are_extrapolations(tmp_path, capsys,
                                                                                            budgets):
    table, output = _small_sweep(tmp_path / "results.csv"), tmp_path / "fit"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's overflow / invalid-value warnings
        scaling_law.main(["fit", table, "--output", str(output), "--bootstrap", "10",
                          *(["--budget", *budgets] if budgets else [])])
    printed = capsys.readouterr().out
    assert ("the budget of 3e+12 FLOPs has its parabola's vertex at N = 1e+26, beyond the sizes tried "
            "(2e+04 to 1.8e+05) by more than their span: no minimum located") in printed
    fit = json.loads((output / "fit.json").read_text())
    assert [point["flops"] for point in fit["approach2"]["budgets"]] == [3e11, 1e12]
    points = {(point["flops"], point["approach"]): point for point in fit["optimal"]}
    assert set(points) == {(float(budget), approach) for budget in budgets for approach in (2, 3)}
    for (flops, _), point in points.items():
        assert all(math.isfinite(point[key]) and point[key] > 0 for key in ("parameters", "tokens", "loss"))
        assert point["extrapolated"] == (flops > 3e12)
        assert (f"optimum at C = {flops:.3g} (extrapolated beyond the sweep's budgets)" in printed) == (
            flops > 3e12)
    if budgets:
        assert ("note: --budget 1e+14, 1e+15 beyond the sweep's budgets (3e+11 to 3e+12 FLOPs): their optima "
                "are extrapolations") in printed


def test_a_budget_no_law_can_answer_is_refused_naming_it(tmp_path):
    """Vertices a decade apart per half-decade of compute: N_opt ~ C^2, no float at 1e200 FLOPs."""
    rows = [{"parameters": vertex * scale, "tokens": flops / (7 * vertex * scale), "flops": flops,
             "val_loss": round(4 + 0.1 * math.log(scale) ** 2 - 0.2 * math.log10(flops / 3e11), 4)}
            for flops, vertex in ((3e11, 3e4), (1e12, 3e5), (3e12, 3e6)) for scale in (0.25, 0.5, 1, 2, 4)]
    table = _write(tmp_path / "steep.csv", rows, ("parameters", "tokens", "flops", "val_loss"))
    refusal = (r"^error: --budget 1e\+200: Approach 2's law gives no finite optimum there "
               r"\(N, D, loss = inf, .*\): give a budget nearer them$")
    with pytest.raises(SystemExit, match=refusal):
        scaling_law.main(["fit", table, "--output", str(tmp_path / "fit"), "--budget", "1e200"])
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit, match=f"^error: --budget {bad}: give compute budgets as FLOPs > 0"):
            scaling_law.main(["fit", table, "--output", str(tmp_path / "fit"), "--budget", bad])
