"""A sweep's WSD mode: one warmup-stable-decay run per model (and layout, rate, seed), cooldown branches from
its stable checkpoints, each branch one point of the loss-against-tokens curve at a fraction of the
compute of separate runs (MiniCPM; Hagele et al. 2024: a 20% cooldown matches cosine).

``branch_iters: [N1, N2, ...]`` are the points' lengths; each branch cools down over the last
``cooldown_fraction`` of its length (default 0.2): it loads the stable run's checkpoint of iteration
``P = round(N (1 - f))`` and decays over ``K = N - P`` (``--cooldown-iters``). The stable run trains
towards the longest point in segments, each stopped and saved at the next branch point (``--exit-interval
P`` stops a run resumed before P exactly at P), its data and schedule those of the longest point's
separate run; every branch reads on in that data order. A stable segment already saved and a branch
already in the table are skipped, so an interrupted study started again goes on. Each branch and each
stable segment is its own run in the wandb group of the sweep. The study's compute is the stable run's
``P_max`` iterations and every branch's ``K``, against ``sum N`` for separate runs, a fraction
``f + (1 - f) N_max / sum N``: written to ``sweep.json`` (``study_flops``, ``separate_flops``,
``study_fraction``) and said by ``launch.scaling_law fit``.
"""

from __future__ import annotations

import csv
import json
import math
import os

from pretrain.checkpoint.catalog import CheckpointError, read_manifest

DEFAULT_COOLDOWN = 0.2
SEPARATE = ("wsd", "cosine")  # the separate runs a study may train beside its branches, to compare


def points(sweep: dict) -> list[tuple[int, int, int]]:
    """(N, P, K) of each branch, shortest first: its length, branch point and cooldown; ValueError naming
    the key for points (or separate runs) that do not make a study."""
    unknown = [style for style in sweep.get("separate") or [] if style not in SEPARATE]
    if unknown or not isinstance(sweep.get("separate") or [], list):
        raise ValueError(f"separate {sweep.get('separate')!r}: give a list of {' and '.join(SEPARATE)}")
    fraction = sweep.get("cooldown_fraction", DEFAULT_COOLDOWN)
    lengths = sweep.get("branch_iters")
    if not isinstance(lengths, list) or not lengths or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in lengths):
        raise ValueError(f"branch_iters {lengths!r}: give a list of whole numbers > 0, e.g. [40, 80, 160]")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"cooldown_fraction {fraction!r}: give a fraction between 0 and 1, e.g. 0.2")
    found = [(n, round(n * (1 - fraction)), n - round(n * (1 - fraction))) for n in sorted(set(lengths))]
    starts = [p for _, p, _ in found]
    if any(p < 1 or k < 1 for _, p, k in found) or len(set(starts)) != len(starts):
        raise ValueError(f"branch_iters {sorted(lengths)} with cooldown_fraction {fraction}: branch points "
                         f"{starts} are not distinct iterations >= 1 with a cooldown of at least 1: give "
                         "longer or fewer points")
    return found


def study_key(run: dict) -> str:
    return f"{run['model']}-{run['layout']}-lr{run['lr']:g}-s{run['seed']}"


def branch_runs(sweep: dict, studies: list[dict]) -> list[dict]:
    """The table's rows to train: each study's branch per point (``train_iters`` its length N)."""
    return [{**study, "run": f"{study_key(study)}-cooldown{n}", "budget": "", "train_iters": n,
             "branch": (p, k)} for study in studies for n, p, k in points(sweep)]


def separate_runs(sweep: dict, studies: list[dict]) -> list[dict]:
    """Separate runs of every point from scratch (``separate: [wsd, cosine]``): a WSD run decaying over
    the branch's cooldown, a cosine one decaying over the whole run; rows of ``separate.csv``."""
    styles = sweep.get("separate") or []
    return [{**study, "run": f"{study_key(study)}-separate-{style}{n}", "budget": "", "train_iters": n,
             "separate": style} for study in studies for n, _, _ in points(sweep) for style in styles]


def schedule_settings(sweep: dict, run: dict) -> dict:
    """A run's schedule: the stable run's and its branches' (the longest point's separate run's: WSD ending
    at N_max after a cooldown of K_max, its data for N_max iterations), or a separate run's."""
    found = {n: k for n, _, k in points(sweep)}
    n = run["train_iters"] if "separate" in run else max(found)
    if run.get("separate") == "cosine":
        return {"train_iters": n, "lr_decay_style": "cosine", "lr_decay_iters": n}
    return {"train_iters": n, "lr_decay_style": "WSD", "lr_decay_iters": n, "lr_wsd_decay_iters": found[n]}


def comparison(rows: list[dict], separate: list[dict]) -> list[str]:
    """Each branch's loss beside the separate runs of its point, as lines to print."""
    lines = []
    for row in rows:
        loss = float(row["val_loss"] or row["final_loss"])
        others = [(other["run"].rsplit("-", 1)[1], float(other["val_loss"] or other["final_loss"]))
                  for other in separate
                  if other["model"] == row["model"] and other["layout"] == row["layout"]
                  and other["lr"] == row["lr"] and other["seed"] == row["seed"]
                  and other["train_iters"] == row["train_iters"]]
        lines.append(f"{row['run']}: {loss:.4f}" + "".join(
            f"; separate {name} {value:.4f} ({(loss - value) / value:+.2%})" for name, value in others))
    return lines


def stable_directory(sweep: dict, run: dict) -> str:
    return os.path.join(sweep["output"], "stable", study_key(run))


def stable_saved(directory: str, iteration: int) -> bool:
    """Whether the stable run's checkpoint of ``iteration`` is there, intact by its manifest."""
    try:
        read_manifest(directory, iteration)
    except CheckpointError:
        return False
    return True


def segment_flags(directory: str, stop: int) -> dict:
    """The stable run resumed (when it has a checkpoint) and stopped, saving, at branch point ``stop``."""
    return {"save": directory, "load": directory, "exit_interval": stop}


def branch_flags(directory: str, branch: tuple[int, int]) -> dict:
    point, cooldown = branch
    return {"load": directory, "ckpt_step": point, "cooldown_iters": cooldown}


def compute(sweep: dict, studies: list[dict], flops_per_iteration) -> dict:
    """The study's training FLOPs (each stable run to P_max and every cooldown) against separate runs'
    (every point trained from scratch); ``flops_per_iteration(model)``."""
    found = points(sweep)
    each = [flops_per_iteration(study["model"]) for study in studies]
    study = (found[-1][1] + sum(k for _, _, k in found)) * math.fsum(each)
    separate = sum(n for n, _, _ in found) * math.fsum(each)
    return {"study_flops": study, "separate_flops": separate, "study_fraction": study / separate}


def plot_branches(sweep: dict, rows: list[dict], axis) -> None:
    """Loss against tokens: each study's stable run, its branches beside it."""
    for index, study in enumerate(dict.fromkeys(study_key(row | {"lr": float(row["lr"])}) for row in rows)):
        color = f"C{index % 10}"
        stable = _lines(os.path.join(sweep["output"], "runs", f"{study}-stable.jsonl"))
        axis.plot([line["iteration"] * sweep["tokens_per_step"] for line in stable],
                  [line["loss"] for line in stable], color=color, label=f"{study} stable")
        for row in rows:
            if row["run"].startswith(f"{study}-cooldown"):
                lines = _lines(os.path.join(sweep["output"], "runs", f"{row['run']}.jsonl"))
                axis.plot([line["iteration"] * sweep["tokens_per_step"] for line in lines],
                          [line["loss"] for line in lines], color=color, linestyle="--")
                axis.scatter([int(row["tokens"])], [float(row["val_loss"] or row["final_loss"])],
                             color=color, marker="o")
        for other in _separate_rows(sweep):
            if other["run"].startswith(f"{study}-separate-"):
                marker = "x" if other["run"].rsplit("-", 1)[1].startswith("wsd") else "^"
                axis.scatter([int(other["tokens"])], [float(other["val_loss"] or other["final_loss"])],
                             color=color, marker=marker)
    axis.set(xscale="log", xlabel="tokens", ylabel="loss",
             title="stable (-), cooldowns (--, o), separate wsd (x), cosine (^)")
    axis.legend(fontsize=7)


def _separate_rows(sweep: dict) -> list[dict]:
    path = os.path.join(sweep["output"], "separate.csv")
    if not os.path.exists(path):
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle]
