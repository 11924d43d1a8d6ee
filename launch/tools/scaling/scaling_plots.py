"""The plots of a scaling-law fit (``scaling_law``): IsoFLOP profiles with their vertices,
the compute-optimal frontier with its bootstrap band, loss against FLOPs per size with the fitted law,
and the law's residuals. PNG files; draws only what the fit holds."""

from __future__ import annotations

import os

import numpy as np

from launch.tools.scaling.scaling_fits import Runs, predicted_loss


def _isoflop(axis, runs: Runs, result: dict) -> None:
    budgets = result["approach2"]["budgets"]
    colours = {}
    for group in np.unique(runs.budget):
        mine = runs.budget == group
        flops = float(np.median(runs.flops[mine]))
        order = np.argsort(runs.parameters[mine])
        line, = axis.plot(runs.parameters[mine][order], runs.loss[mine][order], "o", label=f"C = {flops:.2g}")
        colours[flops] = line.get_color()
        if len(np.unique(runs.parameters[mine])) >= 3:
            curve = np.polyfit(np.log(runs.parameters[mine]), runs.loss[mine], 2)
            xs = np.geomspace(runs.parameters[mine].min(), runs.parameters[mine].max(), 50)
            axis.plot(xs, np.polyval(curve, np.log(xs)), "-", color=line.get_color(), alpha=0.6)
    for budget in budgets:
        colour = min(colours.items(), key=lambda item: abs(np.log(item[0] / budget["flops"])))[1]
        interval = budget.get("ci90", {}).get("parameters")
        error = ([[max(budget["parameters"] - interval[0], 0)], [max(interval[1] - budget["parameters"], 0)]]
                 if interval else None)
        axis.errorbar([budget["parameters"]], [budget["loss"]], xerr=error, fmt="*", markersize=14,
                      color=colour, markeredgecolor="black")
    axis.set(xscale="log", xlabel="parameters N", ylabel="loss", title="IsoFLOP profiles (* vertex, 90% CI)")
    axis.legend(fontsize=8)


def _frontier(axes, runs: Runs, result: dict) -> None:
    second, points = result["approach2"], result["optimal"]
    for axis, key, symbol in ((axes[0], "parameters", "N"), (axes[1], "tokens", "D")):
        budgets = second["budgets"]
        axis.plot([b["flops"] for b in budgets], [b[key] for b in budgets], "*", markersize=12,
                  label="IsoFLOP vertices")
        if second.get("laws"):
            slope, intercept = second["laws"][key]
            band = second.get("band")
            xs = np.array(band["flops"]) if band else np.geomspace(runs.flops.min(), runs.flops.max(), 25)
            exponent = second["a"] if key == "parameters" else second["b"]
            axis.plot(xs, np.exp(intercept) * xs ** slope, "-",
                      label=f"approach 2: {symbol} ~ C^{exponent:.3f}")
            if band:
                low_high = np.array(band[key])
                axis.fill_between(xs, low_high[:, 0], low_high[:, 1], alpha=0.25, label="90% band")
        envelope = result["approach1"]["points"]
        axis.plot([p["flops"] for p in envelope], [p[key] for p in envelope], "s", mfc="none",
                  label="approach 1 envelope")
        three = [p for p in points if p["approach"] == 3]
        if three:
            axis.plot([p["flops"] for p in three], [p[key] for p in three], "x", markersize=10,
                      label="approach 3 optimum")
        axis.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel=f"{symbol}_opt",
                 title=f"compute-optimal {symbol}")
        axis.legend(fontsize=8)


def _law(axis, runs: Runs, result: dict) -> None:
    law, k = result["approach3"], result["flops_per_parameter_token"]
    for size in np.unique(runs.parameters):
        mine = runs.parameters == size
        order = np.argsort(runs.flops[mine])
        line, = axis.plot(runs.flops[mine][order], runs.loss[mine][order], "o", label=f"N = {size:.3g}")
        xs = np.geomspace(runs.flops.min() / 2, runs.flops.max() * 2, 50)
        axis.plot(xs, predicted_loss(law, size, xs / (k * size)), "-", color=line.get_color(), alpha=0.6)
    axis.set(xscale="log", xlabel="training FLOPs C", ylabel="loss",
             title=f"L = {law['E']:.3g} + {law['A']:.3g}/N^{law['alpha']:.3f} + "
                   f"{law['B']:.3g}/D^{law['beta']:.3f}")
    axis.legend(fontsize=7, ncol=2)


def _residuals(axis, runs: Runs, result: dict) -> None:
    residual = np.log(predicted_loss(result["approach3"], runs.parameters, runs.tokens)) - np.log(runs.loss)
    points = axis.scatter(runs.flops, residual, c=np.log10(runs.parameters), cmap="viridis")
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set(xscale="log", xlabel="training FLOPs C", ylabel="log L_fit - log L",
             title="approach 3 residuals")
    axis.figure.colorbar(points, ax=axis, label="log10 N")


def plot_all(runs: Runs, result: dict, output: str) -> None:
    """DIR/isoflop.png, frontier.png, law.png and residuals.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, draw, shape in (("isoflop", _isoflop, (1, 1)), ("frontier", _frontier, (1, 2)),
                              ("law", _law, (1, 1)), ("residuals", _residuals, (1, 1))):
        figure, axes = plt.subplots(*shape, figsize=(6.5 * shape[1], 4.8))
        # a --budget far beyond the sweep's stretches a log axis past what a float holds: drawn all the same
        with np.errstate(over="ignore", invalid="ignore"):
            draw(axes, runs, result)
            figure.tight_layout()
            figure.savefig(os.path.join(output, f"{name}.png"), dpi=100)
        plt.close(figure)
