"""Chinchilla's three scaling fits on one set of runs, the compute-optimal points they give, and their
bootstrap over the runs (``launch.tools.scaling.scaling_law`` is the command; its docstring, the method)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

HUBER_DELTA = 1e-3
BUDGET_TOLERANCE = 0.05  # runs whose FLOPs agree within 5% form one budget
# Hoffmann et al.'s grid of starts for (log A, log B, log E, alpha, beta): 4500 points
GRID = np.array(np.meshgrid(np.arange(0, 30, 5.0), np.arange(0, 30, 5.0), np.arange(-1, 1.5, 0.5),
                            np.arange(0, 2.5, 0.5), np.arange(0, 2.5, 0.5), indexing="ij")).reshape(5, -1).T
SCREENED = 100  # L-BFGS runs from the grid's points of least objective (all of them: a minute per fit)
RESTARTS = 4  # a resample starts from the full fit's best distinct solutions


class FitError(ValueError):
    """Input no fit can use, naming the column, the row or the count that is wrong."""


@dataclass
class Runs:
    """The runs of a table as arrays: N, D, C, loss, a label per run (its model), and the budget (group of
    FLOPs within 5%) each belongs to. Owns no fit."""

    parameters: np.ndarray
    tokens: np.ndarray
    flops: np.ndarray
    loss: np.ndarray
    labels: list[str]
    budget: np.ndarray = field(default=None)

    def __post_init__(self) -> None:
        if self.budget is None:
            self.budget = _budget_groups(self.flops)

    def take(self, index: np.ndarray) -> Runs:
        return Runs(self.parameters[index], self.tokens[index], self.flops[index], self.loss[index],
                    [self.labels[i] for i in index], self.budget[index])

    def flops_per_parameter_token(self) -> float:
        """k of C = k N D (6 for Chinchilla's count; ours counts attention too)."""
        return float(np.median(self.flops / (self.parameters * self.tokens)))


def _budget_groups(flops: np.ndarray) -> np.ndarray:
    """A budget number per run: runs sorted by FLOPs, a new budget wherever one is over 5% above the
    smallest of the current budget."""
    groups = np.empty(len(flops), dtype=int)
    start, number = None, -1
    for index in np.argsort(flops, kind="stable"):
        if start is None or flops[index] > start * (1 + BUDGET_TOLERANCE):
            start, number = flops[index], number + 1
        groups[index] = number
    return groups


def _power_law(x: np.ndarray, y: np.ndarray) -> tuple[float, float] | None:
    """(slope, intercept) of log y against log x, or None with fewer than two distinct x."""
    if len(np.unique(x)) < 2:
        return None
    slope, intercept = np.polyfit(np.log(x), np.log(y), 1)
    return float(slope), float(intercept)


def approach1(runs: Runs) -> dict:
    """The envelope: the runs no run with fewer (or equal) FLOPs beats; N and D of them against C."""
    best, points = np.inf, []
    for index in np.lexsort((runs.loss, runs.flops)):  # by FLOPs, the least loss first among equals
        if runs.loss[index] < best:
            best = runs.loss[index]
            points.append(int(index))
    chosen = np.array(points)
    n_law = _power_law(runs.flops[chosen], runs.parameters[chosen])
    d_law = _power_law(runs.flops[chosen], runs.tokens[chosen])
    return {"a": n_law and n_law[0], "b": d_law and d_law[0],
            "points": [{"flops": float(runs.flops[i]), "parameters": float(runs.parameters[i]),
                        "tokens": float(runs.tokens[i]), "loss": float(runs.loss[i])} for i in points]}


def approach2(runs: Runs) -> dict:
    """IsoFLOP profiles: per budget of at least 3 sizes a parabola of loss in log N, its vertex (N_opt, the
    loss there, D_opt from log D interpolated linearly in log N); power laws of N_opt, D_opt and the
    vertex loss against C over the budgets. A vertex outside the sizes tried is marked ``extrapolated``;
    one beyond them by more than their own span (in log N: a nearly flat profile, as a small sweep's
    noise or a resample gives) locates no minimum, and its budget is skipped and said."""
    budgets, skipped = [], []
    for group in np.unique(runs.budget):
        mine = runs.budget == group
        flops = float(np.median(runs.flops[mine]))
        log_n, log_d, loss = np.log(runs.parameters[mine]), np.log(runs.tokens[mine]), runs.loss[mine]
        sizes = len(np.unique(log_n))
        if sizes < 3:
            skipped.append(f"the budget of {flops:.3g} FLOPs has {sizes} model size{'s' * (sizes != 1)}; a "
                           "parabola needs 3: skipped")
            continue
        curve, slope = np.polyfit(log_n, loss, 2), np.polyfit(log_n, log_d, 1)
        if curve[0] <= 0:
            skipped.append(f"the budget of {flops:.3g} FLOPs has no minimum (its loss does not curve up in "
                           "log N): skipped")
            continue
        vertex = -curve[1] / (2 * curve[0])
        low, high = log_n.min(), log_n.max()
        if not low - (high - low) <= vertex <= high + (high - low):
            skipped.append(f"the budget of {flops:.3g} FLOPs has its parabola's vertex at N = "
                           f"{_exp_text(vertex)}, beyond the sizes tried ({np.exp(low):.3g} to "
                           f"{np.exp(high):.3g}) by more than their span: no minimum located (add sizes "
                           "towards it): skipped")
            continue
        if np.polyval(curve, vertex) <= 0:
            skipped.append(f"the budget of {flops:.3g} FLOPs has its parabola's minimum at a loss <= 0: "
                           "skipped")
            continue
        budgets.append({"flops": flops, "sizes": sizes, "parameters": float(np.exp(vertex)),
                        "tokens": float(np.exp(np.polyval(slope, vertex))),
                        "loss": float(np.polyval(curve, vertex)),
                        "extrapolated": bool(not log_n.min() <= vertex <= log_n.max())})
    result = {"a": None, "b": None, "budgets": budgets, "skipped": skipped}
    if len(budgets) >= 2:
        flops = np.array([b["flops"] for b in budgets])
        laws = {key: _power_law(flops, np.array([b[key] for b in budgets]))
                for key in ("parameters", "tokens", "loss")}
        result.update(a=laws["parameters"][0], b=laws["tokens"][0], laws=laws)
    elif budgets:
        skipped.append("power laws need 2 budgets; one could be fitted")
    return result


def _objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray,
               delta: float = HUBER_DELTA) -> tuple[float, np.ndarray]:
    """Huber loss of log L(N, D) - log L and its gradient, theta = (log A, log B, log E, alpha, beta)."""
    log_a, log_b, log_e, alpha, beta = theta
    terms = np.stack([log_a - alpha * log_n, log_b - beta * log_d, np.full_like(log_n, log_e)])
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    residual = top + np.log(total) - log_loss
    weights /= total
    small = np.abs(residual) <= delta
    value = np.where(small, 0.5 * residual ** 2, delta * (np.abs(residual) - 0.5 * delta)).sum()
    slope = np.where(small, residual, delta * np.sign(residual))
    grad = np.array([(slope * weights[0]).sum(), (slope * weights[1]).sum(), (slope * weights[2]).sum(),
                     -(slope * weights[0] * log_n).sum(), -(slope * weights[1] * log_d).sum()])
    return float(value), grad


def _screened(runs: Runs, starts: np.ndarray, keep: int) -> np.ndarray:
    """The ``keep`` starts of least objective (evaluated at all of them at once)."""
    if len(starts) <= keep:
        return starts
    log_n, log_d, log_loss = np.log(runs.parameters), np.log(runs.tokens), np.log(runs.loss)
    terms = np.stack([starts[:, :1] - starts[:, 3:4] * log_n, starts[:, 1:2] - starts[:, 4:5] * log_d,
                      np.broadcast_to(starts[:, 2:3], (len(starts), len(log_n)))])
    residual = np.logaddexp.reduce(terms, axis=0) - log_loss
    huber = np.where(np.abs(residual) <= HUBER_DELTA, 0.5 * residual ** 2,
                     HUBER_DELTA * (np.abs(residual) - 0.5 * HUBER_DELTA)).sum(axis=1)
    return starts[np.argsort(huber, kind="stable")[:keep]]


def minimise_law(runs: Runs, starts: np.ndarray) -> list[tuple[float, np.ndarray]]:
    """(objective, theta) of L-BFGS from each start, best first."""
    data = (np.log(runs.parameters), np.log(runs.tokens), np.log(runs.loss))
    found = []
    for start in starts:
        result = minimize(_objective, start, args=data, jac=True, method="L-BFGS-B",
                          options={"maxiter": 5000, "ftol": 1e-15, "gtol": 1e-12})
        if np.isfinite(result.fun):
            found.append((float(result.fun), result.x))
    return sorted(found, key=lambda pair: pair[0])


def approach3(runs: Runs, starts: np.ndarray = GRID, screened: int = SCREENED) -> dict:
    """The parametric law L(N, D) = E + A / N^alpha + B / D^beta (Huber loss of log L, L-BFGS from the
    ``screened`` points of Hoffmann's grid where the objective is least); ``restarts``: the best distinct
    solutions, where a resample's fit starts."""
    found = minimise_law(runs, _screened(runs, starts, screened))
    if not found:
        raise FitError("Approach 3: no start of the grid reached a finite objective")
    objective, theta = found[0]
    if not all(np.isfinite(list(_law(theta).values()))):
        raise FitError(f"Approach 3 ran off to infinity ({_law(theta)}): the runs do not constrain the law; "
                       "add sizes or budgets")
    distinct = []
    for _, candidate in found:
        if all(np.abs(candidate - other).max() > 1e-3 for other in distinct):
            distinct.append(candidate)
        if len(distinct) == RESTARTS:
            break
    return {**_law(theta), "objective": objective, "huber_delta": HUBER_DELTA,
            "starts": min(len(starts), screened),
            "restarts": [list(map(float, x)) for x in distinct]}


def _law(theta: np.ndarray) -> dict:
    """A, B, E, alpha, beta of theta (a resample whose fit ran off to infinity gives inf: no interval
    counts it)."""
    log_a, log_b, log_e, alpha, beta = map(float, theta)
    with np.errstate(over="ignore"):
        return {"A": float(np.exp(log_a)), "B": float(np.exp(log_b)), "E": float(np.exp(log_e)),
                "alpha": alpha, "beta": beta}


def predicted_loss(law: dict, parameters, tokens):
    """L(N, D) of an Approach-3 law, its terms taken in logs (A / N^alpha = exp(log A - alpha log N): an
    extreme fit, say alpha 60 and A 1e250, stays finite where it can); inf where it cannot, no warning."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return (law["E"] + np.exp(np.log(law["A"]) - law["alpha"] * np.log(parameters))
                + np.exp(np.log(law["B"]) - law["beta"] * np.log(tokens)))


def _exp_text(log_value: float) -> str:
    """exp(log_value) for a message, as 10^x where a float cannot hold it."""
    return f"{np.exp(log_value):.3g}" if abs(log_value) < 700 else f"10^{log_value / np.log(10):.0f}"


def within_budgets(runs: Runs, flops: float) -> bool:
    """Whether ``flops`` lies among the runs' budgets (within 5% of their least and greatest FLOPs)."""
    tolerance = 1 + BUDGET_TOLERANCE
    return bool(runs.flops.min() / tolerance <= flops <= runs.flops.max() * tolerance)


def optimal_points(runs: Runs, second: dict, third: dict, budgets: list[float]) -> list[dict]:
    """The compute-optimal N, D and loss at each budget C: Approach 2's power laws, and Approach 3's law
    minimised along C = k N D; each point ``extrapolated`` where C lies beyond the runs' budgets. Computed
    in logs: a value a float cannot hold is inf (``fit`` refuses such a ``--budget``; a resample's is left
    out of the intervals), never an exception or a warning."""
    points = []
    k = runs.flops_per_parameter_token()
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        for flops in budgets:
            log_c, beyond = np.log(flops), not within_budgets(runs, flops)
            if second.get("laws"):
                laws = (second["laws"][key] for key in ("parameters", "tokens", "loss"))
                n, d, loss = (float(np.exp(intercept + slope * log_c)) for slope, intercept in laws)
                points.append({"flops": flops, "approach": 2, "parameters": n, "tokens": d, "loss": loss,
                               "extrapolated": beyond})
            alpha, beta = third["alpha"], third["beta"]
            if alpha > 0 and beta > 0:
                log_scale = (np.log(alpha) + np.log(third["A"]) - np.log(beta) - np.log(third["B"])) / (
                    alpha + beta)
                log_n = log_scale + beta / (alpha + beta) * (log_c - np.log(k))
                n, d = np.exp(log_n), np.exp(log_c - np.log(k) - log_n)
                points.append({"flops": flops, "approach": 3, "parameters": float(n), "tokens": float(d),
                               "loss": float(predicted_loss(third, n, d)), "extrapolated": beyond})
    return points


def _interval(values: list[float]) -> list[float] | None:
    values = [v for v in values if v is not None and np.isfinite(v)]
    return [float(np.percentile(values, 5)), float(np.percentile(values, 95))] if values else None


def bootstrap(runs: Runs, result: dict, budgets: list[float], resamples: int,
              rng: np.random.Generator) -> None:
    """90% intervals of every fitted quantity, from ``resamples`` refits on runs drawn with replacement;
    written into ``result`` as each block's ``ci90``, with Approach 2's frontier band."""
    drawn: dict[tuple, list] = {}
    grid = np.array(sorted(b["flops"] for b in result["approach2"]["budgets"]))
    band = np.geomspace(grid.min() / 3, grid.max() * 3, 25) if len(grid) else np.array([])
    starts = np.array(result["approach3"]["restarts"])
    for _ in range(resamples):
        sample = runs.take(rng.integers(0, len(runs.loss), len(runs.loss)))
        first, second = approach1(sample), approach2(sample)
        found = minimise_law(sample, starts)
        third = _law(found[0][1]) if found else None
        for key in ("a", "b"):
            drawn.setdefault(("approach1", key), []).append(first[key])
            drawn.setdefault(("approach2", key), []).append(second[key])
        for key in ("A", "B", "E", "alpha", "beta"):
            drawn.setdefault(("approach3", key), []).append(third and third[key])
        vertices = {_nearest(grid, b["flops"]): b for b in second["budgets"]} if len(grid) else {}
        for index in range(len(grid)):
            for key in ("parameters", "tokens", "loss"):
                drawn.setdefault(("budget", index, key), []).append(vertices.get(index, {}).get(key))
        for point in optimal_points(sample, second, third, budgets) if third else []:
            for key in ("parameters", "tokens", "loss"):
                drawn.setdefault(("optimal", point["flops"], point["approach"], key), []).append(point[key])
        for key in ("parameters", "tokens"):
            law = second.get("laws", {}).get(key)
            with np.errstate(over="ignore"):
                curve = np.exp(law[1] + law[0] * np.log(band)) if law else None
            drawn.setdefault(("band", key), []).append(curve if law and np.isfinite(curve).all() else None)
    for number in (1, 2, 3):
        block = result[f"approach{number}"]
        block["ci90"] = {key: _interval(values) for (name, key), values in
                         ((k[:2], v) for k, v in drawn.items() if k[0] == f"approach{number}")}
    for index, budget in enumerate(sorted(result["approach2"]["budgets"], key=lambda b: b["flops"])):
        budget["ci90"] = {key: _interval(drawn[("budget", index, key)])
                          for key in ("parameters", "tokens", "loss")}
    for point in result["optimal"]:
        point["ci90"] = {key: _interval(drawn.get(("optimal", point["flops"], point["approach"], key), []))
                         for key in ("parameters", "tokens", "loss")}
    curves = {key: [c for c in drawn.get(("band", key), []) if c is not None]
              for key in ("parameters", "tokens")}
    if band.size and curves["parameters"]:
        result["approach2"]["band"] = {"flops": band.tolist(), **{
            key: np.percentile(np.array(curves[key]), [5, 95], axis=0).T.tolist() for key in curves}}


def _nearest(grid: np.ndarray, flops: float) -> int:
    return int(np.argmin(np.abs(np.log(grid) - np.log(flops))))
