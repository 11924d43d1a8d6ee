"""muP's coordinate check (Tensor Programs V; microsoft/mup's ``get_coord_data``): the size of each part's
activations, per coordinate, over the first steps of training at growing widths, under the standard
parametrization and under muP. Under muP it stays flat across widths; under the standard one it grows
(the updates of a fixed rate add up over the width).

    python -m launch.scaling_law coord-check --output DIR [--widths 64 128 256 512] [--base-width 64]
        [--steps 5] [--lr 1e-2] [--layers 2] [--head-dim 16] [--seed 0]

Each width trains our GPT (one process, heads = width / head dim) with AdamW on its own parameter groups
(muP's rates and epsilons from ``pretrain.training.param_groups``) at a constant rate, on the same random
token batches for every width. After each step it measures the mean |x| of the embeddings' output, each
layer's output and the logits. DIR/coord.json holds every number, DIR/coord.png the curves (one panel per
parametrization and step, width on the x axis), and the table printed gives, per part, the last step's
size at the widest width over the narrowest's: near 1 under muP.
"""

from __future__ import annotations

import json
import os

import torch

from models.config import GPTConfig
from models.gpt import GPTModel
from parallel.comm import AxisGroup, CommStats
from pretrain.config.schema import OptimizerConfig
from pretrain.training.param_groups import parameter_groups

VOCAB, SEQ, BATCH = 256, 32, 8
PARAMETRIZATIONS = ("standard", "mup")


def _model(width: int, base: int, layers: int, head_dim: int, mup: bool, seed: int) -> GPTModel:
    config = GPTConfig(num_layers=layers, hidden_size=width, num_attention_heads=width // head_dim,
                       seq_length=SEQ, vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                       position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                       use_mup=mup, mup_base_hidden_size=base if mup else None)
    return GPTModel(config, AxisGroup("tp", (0,), None, CommStats()), seed=seed)


def coordinates(width: int, base: int, layers: int, head_dim: int, mup: bool, steps: int, lr: float,
                seed: int) -> dict[str, list[float]]:
    """Mean |x| of each part's output after each of ``steps`` AdamW steps at ``width``."""
    torch.manual_seed(seed)
    model = _model(width, base, layers, head_dim, mup, seed)
    groups = parameter_groups([model], OptimizerConfig(lr=lr, weight_decay=0.0), model.config.mup_width_mult)
    for group in groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    seen: dict[str, float] = {}

    def record(name: str):
        return lambda module, inputs, output: seen.__setitem__(name, output.detach().abs().mean().item())

    parts = [("embedding", model.word_embedding)] + [(f"layer {i}", layer) for i, layer in
                                                      enumerate(model.layers)]
    for name, module in parts:
        module.register_forward_hook(record(name))
    data = torch.Generator().manual_seed(seed)
    found: dict[str, list[float]] = {}
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=data)
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        loss = model(tokens[:, :-1], positions, labels=tokens[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            seen["logits"] = model(tokens[:, :-1], positions)[..., :VOCAB].abs().mean().item()
        for name, value in seen.items():
            found.setdefault(name, []).append(value)
    return found


def coord_check(widths: list[int], base: int, layers: int, head_dim: int, steps: int, lr: float,
                seed: int) -> dict:
    """{parametrization: {width: {part: [mean |x| per step]}}}."""
    return {kind: {str(width): coordinates(width, base, layers, head_dim, kind == "mup", steps, lr, seed)
                   for width in widths} for kind in PARAMETRIZATIONS}


def growth(result: dict, widths: list[int]) -> dict[str, dict[str, float]]:
    """Per parametrization and part: the last step's size at the widest width over the narrowest's."""
    narrow, wide = str(min(widths)), str(max(widths))
    return {kind: {part: result[kind][wide][part][-1] / result[kind][narrow][part][-1]
                   for part in result[kind][narrow]} for kind in result}


def plot(result: dict, widths: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = len(next(iter(result["mup"][str(widths[0])].values())))
    figure, axes = plt.subplots(2, steps, figsize=(3.2 * steps, 6), squeeze=False, sharey="row")
    for row, kind in enumerate(PARAMETRIZATIONS):
        for step in range(steps):
            axis = axes[row][step]
            for part in result[kind][str(widths[0])]:
                axis.plot(widths, [result[kind][str(w)][part][step] for w in widths], marker="o", label=part)
            axis.set(xscale="log", yscale="log", title=f"{kind}, step {step + 1}", xlabel="width")
            axis.set_xticks(widths, [str(width) for width in widths], minor=False)
            axis.minorticks_off()
    axes[0][0].set_ylabel("mean |x|")
    axes[1][0].set_ylabel("mean |x|")
    axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run(args) -> None:
    """The ``coord-check`` command: measure, write DIR/coord.json and DIR/coord.png, print the growth."""
    widths = sorted(args.widths)
    counts = [("--widths", min(widths)), ("--base-width", args.base_width), ("--head-dim", args.head_dim),
              ("--steps", args.steps), ("--layers", args.layers)]
    for flag, value in counts:
        if value < 1:
            raise ValueError(f"{flag} {value}: give 1 or more")
    if not args.lr > 0:
        raise ValueError(f"--lr {args.lr:g}: give a learning rate > 0")
    if any(width % args.head_dim for width in widths) or args.base_width % args.head_dim:
        raise ValueError(f"--widths {widths} and --base-width {args.base_width} must be multiples of "
                         f"--head-dim {args.head_dim}")
    result = coord_check(widths, args.base_width, args.layers, args.head_dim, args.steps, args.lr, args.seed)
    ratios = growth(result, widths)
    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "coord.json"), "w") as handle:
        json.dump({"widths": widths, "base_width": args.base_width, "steps": args.steps, "lr": args.lr,
                   "coordinates": result, "growth": ratios}, handle, indent=1)
    plot(result, widths, os.path.join(args.output, "coord.png"))
    print(f"mean |x| at width {widths[-1]} over width {widths[0]} after step {args.steps}:")
    print("part | " + " | ".join(PARAMETRIZATIONS))
    for part in ratios["mup"]:
        print(f"{part} | " + " | ".join(f"{ratios[kind][part]:.2f}" for kind in PARAMETRIZATIONS))
    print(f"wrote {args.output}/coord.json and coord.png")


def add_parser(commands) -> None:
    parser = commands.add_parser("coord-check", help="muP's coordinate check at growing widths")
    parser.add_argument("--output", required=True, help="directory for coord.json and coord.png")
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--base-width", type=int, default=64, help="muP's --mup-base-hidden-size")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
