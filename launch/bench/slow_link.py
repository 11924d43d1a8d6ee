"""Step time of ZeRO-2, ZeRO-3, ZeRO-3 + hpZ, ZeRO-3 + hpZ + qwZ + qgZ and ZeRO-3 in shard groups of a
node, on two emulated nodes of 2 ranks joined by a truly slow link, beside the link model's prediction.

    sudo python -m launch.bench.slow_link [--rates 1gbit 10gbit] [--iters 6] [--hidden-size 512]

The nodes are network namespaces joined by a veth pair shaped with tc (``launch.bench.netns_link``): ranks
0-1 in one, 2-3 in the other, so gloo's traffic between them crosses the shaped link and traffic within a
node stays on its loopback. Every configuration trains the same bf16 GPT (dp 4) at each rate, its runs
back to back. Measured: the median step time after the first iteration, the bytes that left node 0 in the
last step (the trainer's comm_bytes_inter_node of ranks 0 and 1) and, at the first rate, the bytes node
0's ranks counted in the second half of the steps beside the TCP payload node 0's end of the link carried
for them (its veth statistics less the frames' headers, ``launch.bench.wire_bytes``, which also sets every
collective alone beside its count first; taken as the difference from a run of half the iterations, which
has the same start-up, the weights' broadcast, and the same final evaluation). Predicted at a rate:
``launch.tools.planning``'s ``layout_price.transfers`` on gloo timed by ``link_model.step_seconds`` on
the links as probed (TCP bytes per second and latency across the pair and on a node's loopback) around the
configuration's compute taken from its runs at the other rates (the compute that the overlap model turns
into the measured step there, a third of it forward; averaged; it includes the quantize passes, which do
not depend on the link): a prediction never sees the run it predicts, and it tests the link model, not a
FLOP estimate. (An unshaped pair is no reference on 2 cores: its fast transfers keep the receiving ranks
busy on the CPU the others compute on, and its steps come out slower than at 10 Gbit/s.)"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from launch.bench.wire_bytes import payload
from launch.bench.wire_bytes import measure as measure_operations
from launch.bench.wire_bytes import table as operations_table
from launch.bench.world import write_table
from launch.tools.planning.link_model import Links, Transfer, ZeroCommOptions, step_seconds
from launch.bench.netns_link import LinkSetupError, TwoNodes
from launch.tools.planning.layout import Layout
from launch.tools.planning.layout_price import transfers
from pretrain.config.arguments import parse_config
from parallel.process_groups import free_port
from launch.help_text import help_description

CONFIGURATIONS = {
    "ZeRO-2": (2, ZeroCommOptions(), []),
    "ZeRO-3": (3, ZeroCommOptions(), []),
    "ZeRO-3 + hpZ": (3, ZeroCommOptions(hpz=2), ["--zero-hpz-partition-size", "2"]),
    "ZeRO-3 + hpZ + qwZ + qgZ": (3, ZeroCommOptions(2, True, True), ["--zero-hpz-partition-size", "2",
                                                                 "--zero-quantized-weights",
                                                                 "--zero-quantized-gradients"]),
    "ZeRO-3, shard size = node": (3, ZeroCommOptions(shard_size=2), ["--zero-shard-size", "2"]),
}
RANKS, PER_NODE = 4, 2


def train(nodes: TwoNodes, flags: list[str], directory: str) -> tuple[list[dict], tuple[int, int]]:
    """One run of ``python -m pretrain`` on the two nodes: rank 0's metrics lines, and the (bytes, frames)
    node 0's end of the link sent during the run."""
    metrics = os.path.join(directory, "metrics.jsonl")
    before = nodes.sent(0)
    nodes.run_ranks([sys.executable, "-m", "pretrain", *flags, "--metrics-file", metrics], RANKS, PER_NODE,
                    free_port(), directory)
    after = nodes.sent(0)
    with open(metrics) as handle:
        return [json.loads(line) for line in handle], (after[0] - before[0], after[1] - before[1])


def left_node0(line: dict) -> float:
    """The bytes node 0's ranks counted as crossing to the other node in one logged step."""
    return sum(sum(rank["comm_bytes_inter_node"].values()) for rank in line["per_rank"][:PER_NODE])


def measure(run: tuple[list[dict], tuple[int, int]]) -> tuple[float, float, float]:
    """(median step seconds after the first, bytes that left node 0 in the last step, final loss)."""
    lines = run[0]
    step = statistics.median(line["step_time_s"] for line in lines[1:])
    return step, left_node0(lines[-1]), lines[-1]["loss"]


def compute_of(step: float, found: list[Transfer], links: Links, micro_batches: int) -> float:
    """The compute whose predicted step on ``links`` is the measured ``step`` (the prediction grows with
    the compute; bisection)."""
    low, high = 0.0, step
    for _ in range(60):
        middle = (low + high) / 2
        low, high = ((middle, high) if step_seconds(found, links, middle, micro_batches) < step
                     else (low, middle))
    return (low + high) / 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.slow_link",
                                     description=help_description(__doc__))
    parser.add_argument("--rates", nargs="+", default=["10gbit", "1gbit"],
                        help="tc rates of the link (two or more)")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per configuration and rate, alternating the "
                        "rates; each cell is their median step")
    parser.add_argument("--configurations", nargs="+", choices=list(CONFIGURATIONS),
                        default=list(CONFIGURATIONS))
    parser.add_argument("--wire-elements", type=int, default=1 << 20,
                        help="fp32 elements a rank sends in each collective of the wire check")
    parser.add_argument("--output", default="runs/bench/slow_link.md")
    args = parser.parse_args(argv)
    chosen = {name: CONFIGURATIONS[name] for name in args.configurations}
    model = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
             "--num-attention-heads",
             "8", "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16",
             "--default-corpus-vocab-size", "4096", "--zero-persistence-threshold", "1000", "--train-iters",
             str(args.iters), "--log-interval", "1", "--eval-interval", str(args.iters), "--eval-iters", "1",
             "--sample-prompt", ""]
    config = parse_config(model + ["--vocab-size", "4096"])
    micro_batches = 8 // RANKS
    results: dict[tuple[str, str], tuple[float, float, float]] = {}
    # the steps' own bytes on the wire: a run of half the iterations has the same start-up (the weights'
    # broadcast) and final evaluation, so the difference of the two runs' payloads is the later steps'
    half = max(args.iters // 2, 1)
    shorter = [str(half) if previous in ("--train-iters", "--eval-interval") else flag
               for previous, flag in zip([None] + model, model)]
    wire: dict[str, tuple[float, float]] = {}
    links: dict[str, Links] = {}
    rates = args.rates
    if len(rates) < 2:
        parser.error("--rates needs at least two rates: each is predicted from the runs at the others")
    try:
        for rate in rates:
            with TwoNodes(rate) as nodes:
                across, latency = nodes.probe(0, 1)
                links[rate] = Links(nodes.probe(0, 0)[0], across, latency)
            print(f"link {rate}: {across * 8 / 1e9:.2f} Gbit/s across, latency "
                  f"{latency * 1e6:.0f} us, loopback {links[rate].intra_node * 8 / 1e9:.1f} Gbit/s",
                  flush=True)
        with TwoNodes(rates[0]) as nodes:  # each collective alone: counted beside what crossed the link
            operations = operations_table(measure_operations(nodes, args.wire_elements))
        # a configuration's runs back to back, so that the machine's drifting speed hits its rates alike
        for name, (stage, _, flags) in chosen.items():
            runs: dict[str, list[tuple[float, float, float]]] = {rate: [] for rate in rates}
            for _ in range(args.repeats):
                for rate in rates:
                    with TwoNodes(rate) as nodes, tempfile.TemporaryDirectory() as directory:
                        run = train(nodes, model + ["--zero-stage", str(stage), *flags], directory)
                    runs[rate].append(measure(run))
                    print(f"  {name} at {rate}: {runs[rate][-1][0]:.3f} s a step", flush=True)
                    if rate == rates[0] and name not in wire:
                        with TwoNodes(rate) as nodes, tempfile.TemporaryDirectory() as directory:
                            half_run = train(nodes, shorter + ["--zero-stage", str(stage), *flags], directory)
                        wire[name] = (sum(map(left_node0, run[0][half:])),
                                      payload(*run[1]) - payload(*half_run[1]))
            for rate in rates:
                step = statistics.median(run[0] for run in runs[rate])
                results[name, rate] = (step, *runs[rate][-1][1:])
    except LinkSetupError as error:
        sys.exit(f"error: {error}")
    rows = [f"Each collective of parallel.comm alone ({args.wire_elements * 4 / 2**20:.1f} MiB fp32 a rank, "
            f"dp 4, at {rates[0]}; launch.bench.wire_bytes):", "", *operations, "",
            f"GPT {args.num_layers} x {args.hidden_size}, bf16, dp 4 as two nodes of 2 (network namespaces "
            "joined by "
            f"a veth pair shaped with tc), {args.iters} iterations of 8 sequences of 64; step = median "
            "after the "
            f"first (of {args.repeats} runs: their median); predicted = launch.tools.planning.link_model's "
            "overlap model on gloo on the probed links around the "
            "configuration's compute from its runs at the other rates", "",
            "| configuration | MiB leaving node 0 per step (counted / model) | "
            f"steps {half + 1}-{args.iters} at {rates[0]}: MiB counted / TCP payload on the link (ratio) | "
            + " | ".join(f"{rate} s | predicted | error" for rate in rates) + " | final loss |",
            "|---" * (4 + 3 * len(rates)) + "|"]
    for name, (stage, options, _) in chosen.items():
        found = transfers(config.model, Layout(1, 1, RANKS, stage, zero=options), micro_batches, 2, 4,
                          gpus_per_node=PER_NODE, backend="gloo", bucket_size=config.zero.zero_bucket_size)
        _, leaving, loss = results[name, rates[0]]
        counted, carried = wire[name]
        compute = {rate: compute_of(results[name, rate][0], found, links[rate], micro_batches)
                   for rate in rates}
        cells = [name, f"{leaving / 2**20:.1f} / {sum(t.leaving_node * t.count for t in found) / 2**20:.1f}",
                 f"{counted / 2**20:.1f} / {carried / 2**20:.1f} ({carried / counted:.3f})"]
        for rate in rates:
            others = [compute[other] for other in rates if other != rate]
            measured = results[name, rate][0]
            predicted = step_seconds(found, links[rate], sum(others) / len(others), micro_batches)
            cells += [f"{measured:.3f}", f"{predicted:.3f}", f"{(predicted - measured) / measured:+.0%}"]
        rows.append("| " + " | ".join(cells + [f"{loss:.4f}"]) + " |")
    write_table(args.output, rows)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
