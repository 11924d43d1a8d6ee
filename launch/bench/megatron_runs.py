"""The planner's step time against Megatron-LM's published runs on A100 clusters.

    python -m launch.bench.megatron_runs [--device a100] [--output runs/bench/megatron_runs.md]

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC21,
arXiv:2104.04473), table 1: GPT models of 1.7B to 1T parameters (sequence 2048, vocabulary 51,200, full
activation recompute, mixed precision) on Selene's DGX A100 nodes (8 GPUs on NVLink, 8 HDR InfiniBand
adapters each), at the tensor- and pipeline-parallel sizes and batch sizes given there, with the
teraFLOP/s per GPU each achieved end to end. The measured step time is their FLOP count over the cluster's
rate: 96 B s l h^2 (1 + s / 6h + V / 16 l h) / (GPUs x teraFLOP/s). The table does not give the
micro-batch size or the pipeline schedule: this prices micro-batch 1 and 1F1B (the planner's default).
``launch.plan``'s prediction is for the same layout (ZeRO stage 0: the paper's data parallelism), with
``--device``'s rates and its DGX node's links.
"""

from __future__ import annotations

import argparse

from launch.bench.world import write_table
from launch.help_text import help_description

SEQUENCE, VOCABULARY = 2048, 51_200
# (name, heads, hidden, layers, tp, pp, GPUs, batch, achieved teraFLOP/s per GPU)
RUNS = [("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
        ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142), ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
        ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138), ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
        ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
        ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
        ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def measured_step_seconds(hidden: int, layers: int, batch: int, gpus: int, teraflops: float) -> float:
    """The paper's step time: its FLOP count of a step (recompute included) over the cluster's rate."""
    flops = 96 * batch * SEQUENCE * layers * hidden ** 2 * (1 + SEQUENCE / (6 * hidden)
                                                           + VOCABULARY / (16 * layers * hidden))
    return flops / (gpus * teraflops * 1e12)


def predict(device: str) -> list[dict]:
    """Every run of ``RUNS``: its layout, measured and predicted step seconds."""
    from launch.tools.planning.devices import DGX_LINKS, load_profile
    from launch.tools.planning.layout import Layout
    from launch.tools.planning.link_model import Device, Links
    from launch.tools.planning.plan import plan_layout
    from models.config import GPTConfig

    profile = load_profile(device)
    links = Links(*DGX_LINKS.get(device, DGX_LINKS["a100"]), 10e-6)
    results = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, teraflops in RUNS:
        config = GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                           seq_length=SEQUENCE, max_position_embeddings=SEQUENCE, vocab_size=VOCABULARY)
        layout = Layout(tp, pp, gpus // (tp * pp), 0, recompute="full")
        plan = plan_layout(config, layout, batch, 2, gpus_per_node=8, links=links,
                           device=Device(profile=profile))
        results.append({"name": name, "tp": tp, "pp": pp, "dp": layout.dp, "gpus": gpus, "batch": batch,
                        "measured": measured_step_seconds(hidden, layers, batch, gpus, teraflops),
                        "predicted": plan.step_seconds})
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.megatron_runs",
                                     description=help_description(__doc__))
    parser.add_argument("--device", default="a100",
                        help="a built-in profile or a profile file (default: a100)")
    parser.add_argument("--output", default="runs/bench/megatron_runs.md")
    args = parser.parse_args(argv)
    results = predict(args.device)
    rows = [f"launch.plan --device {args.device} against Narayanan et al. 2021, table 1 (micro-batch 1, "
            "1F1B)\n",
            "| model | tp | pp | dp | GPUs | batch | measured step s | predicted s | predicted / measured |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['name']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['gpus']} | {r['batch']} | "
                    f"{r['measured']:.2f} | {r['predicted']:.2f} | {r['predicted'] / r['measured']:.3f} |")
        print(rows[-1], flush=True)
    write_table(args.output, rows)
    return results


if __name__ == "__main__":
    main()
