"""The planner's step time against published runs of 1.7B-1T-parameter models on A100 and H100 clusters.

    python -m launch.bench.published_runs [--output docs/published_runs.md]

Each run is priced at the layout, batch and cut its paper gives (``launch.plan``'s ``plan_layout``, with the
built-in profile of its device and that device's DGX node links), and set beside the step time the paper
reports, or the one its reported throughput implies: its own FLOP count of a step over the cluster's rate.
The profiles' rates are estimates from data sheets (``launch.tools.planning.devices``), never fitted to these
runs. Where a paper leaves something out (micro-batch size, schedule, recompute), the run says what is
assumed. Sources:

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
  (arXiv:2104.04473), table 1: GPT 1.7B-1T on Selene's DGX A100s, teraFLOP/s per GPU with full recompute,
  the step's FLOPs 96 B s l h^2 (1 + s / 6h + V / 16 l h); micro-batch 1 and 1F1B assumed.
- Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv:2201.11990),
  its system-performance table: 105 layers, hidden 20480, 128 heads, batch 1920 of 2048 tokens, tp 8 x pp 35
  on 280, 350 and 420 DGX A100 nodes, 60.1, 50.2 and 44.4 s an iteration (measured step times).
- BigScience 2022, BLOOM 176B (arXiv:2211.05100, and its model card: "about 150 TFLOP per GPU per
  second"): 70 layers, hidden 14336, 112 heads, vocabulary 250,880, tp 4 x pp 12 x dp 8 on 384 A100s, ZeRO-1,
  batch 2048 of 2048 tokens, full recompute; the step's FLOPs by the formula above; micro-batch 2, and the
  70 layers cut over 12 stages with the embedding and the loss counted as layers (5, 6 x 10, 5) assumed.
- Llama Team 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783), table 4: Llama 3 405B (126 layers,
  hidden 16384, 128 heads, 8 key/value groups, SwiGLU 53248, vocabulary 128,256) on 8,192 and 16,384 H100s,
  tp 8 x pp 16, 16M tokens of 8,192 a step, 430 and 400 teraFLOP/s per GPU, an interleaved schedule whose
  first and last virtual stage hold one layer fewer (Megatron's --account-for-embedding-in-pipeline-split
  and --account-for-loss-in-pipeline-split); the step's FLOPs are ``models.counting``'s (6 per weight and
  token, attention's s^2 whole); micro-batch 1, ZeRO-1, no recompute, sequence parallelism and 4 virtual
  stages per rank assumed (the paper does not give them: with 2 the predictions are 1.00x and 1.09x, with 8
  0.88x and 0.86x, with 1F1B 1.18x and 1.42x). The long-context row (cp 16 at 131k tokens) is left out: at
  that length the attention's FLOPs decide the rate, and the paper does not say whether it counts the causal
  half.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from launch.bench.world import write_table
from launch.help_text import help_description
from parallel.pipeline.layer_split import SplitRequest


@dataclass(frozen=True)
class PublishedRun:
    """One run as its paper gives it: the model, the layout and batch, and the step time it measured (or
    that its throughput implies). A record; pricing it is ``predict``'s."""

    source: str
    name: str
    device: str
    model: dict  # GPTConfig fields
    tp: int
    pp: int
    gpus: int
    batch: int  # sequences a step
    measured: float  # seconds a step
    micro_batch: int = 1
    recompute: str | None = "full"
    zero_stage: int = 0
    cut: SplitRequest = SplitRequest()  # how the layers are cut over the stages (even unless given)
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    vp: int = 1  # chunks per stage (interleaved)


def _gpt(layers: int, hidden: int, heads: int, vocabulary: int = 51_200, sequence: int = 2048) -> dict:
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=sequence,
                max_position_embeddings=sequence, vocab_size=vocabulary)


def megatron_step_seconds(hidden: int, layers: int, batch: int, gpus: int, teraflops: float,
                          vocabulary: int = 51_200, sequence: int = 2048) -> float:
    """Narayanan et al.'s step time: their FLOP count of a step (full recompute) over the cluster's rate."""
    flops = 96 * batch * sequence * layers * hidden ** 2 * (1 + sequence / (6 * hidden)
                                                            + vocabulary / (16 * layers * hidden))
    return flops / (gpus * teraflops * 1e12)


NARAYANAN = "Narayanan et al. 2021, table 1"
# (name, heads, hidden, layers, tp, pp, GPUs, batch, achieved teraFLOP/s per GPU)
_TABLE_1 = [("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
            ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142), ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
            ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138), ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
            ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
            ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
            ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
            ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163)]
LLAMA_405B = dict(num_layers=126, hidden_size=16384, num_attention_heads=128, group_query_attention=True,
                  num_query_groups=8, ffn_hidden_size=53248, swiglu=True, normalization="RMSNorm",
                  position_embedding_type="rope", disable_bias_linear=True,
                  untie_embeddings_and_output_weights=True, seq_length=8192, max_position_embeddings=8192,
                  vocab_size=128_256)

RUNS = [
    *(PublishedRun(NARAYANAN, name, "a100", _gpt(layers, hidden, heads), tp, pp, gpus, batch,
                   megatron_step_seconds(hidden, layers, batch, gpus, teraflops))
      for name, heads, hidden, layers, tp, pp, gpus, batch, teraflops in _TABLE_1),
    *(PublishedRun("Smith et al. 2022 (MT-NLG)", f"530B on {gpus:,}", "a100", _gpt(105, 20480, 128), 8, 35,
                   gpus, 1920, seconds) for gpus, seconds in ((2240, 60.1), (2800, 50.2), (3360, 44.4))),
    PublishedRun("BigScience 2022 (BLOOM)", "176B on 384", "a100", _gpt(70, 14336, 112, 250_880), 4, 12,
                 384, 2048, megatron_step_seconds(14336, 70, 2048, 384, 150, 250_880), micro_batch=2,
                 zero_stage=1, cut=SplitRequest(embedding=True, loss=True)),
]


def _llama_runs() -> list[PublishedRun]:
    """Llama 3 405B's rows: the step time its tokens and teraFLOP/s imply, by ``models.counting``'s FLOPs."""
    from models.counting import flops_per_token

    tokens = 2048 * 8192  # 16M a step
    flops = flops_per_token(_config(LLAMA_405B)) * tokens
    return [PublishedRun("Llama Team 2024, table 4", f"Llama 3 405B on {gpus:,}", "h100", LLAMA_405B, 8, 16,
                         gpus, 2048, flops / (gpus * teraflops * 1e12), recompute=None, zero_stage=1,
                         cut=SplitRequest(embedding=True, loss=True), sequence_parallel=True,
                         schedule="interleaved", vp=4)
            for gpus, teraflops in ((8192, 430), (16384, 400))]


def _config(model: dict):
    from launch.tools.scaling.sweep import settings_flags
    from pretrain.config.arguments import parse_config

    return parse_config(settings_flags(model)).model


def predict(runs: list[PublishedRun]) -> list[dict]:
    """Every run's layout, measured and predicted step seconds."""
    from launch.tools.planning.devices import DGX_LINKS, load_profile
    from launch.tools.planning.layout import Layout
    from launch.tools.planning.link_model import Device, Links
    from launch.tools.planning.plan import plan_layout
    results = []
    for run in runs:
        config = _config(run.model)
        dp = run.gpus // (run.tp * run.pp)
        split = run.cut.split(config.num_layers, run.pp, run.vp)
        layout = Layout(run.tp, run.pp, dp, run.zero_stage, recompute=run.recompute,
                        micro_batch_size=run.micro_batch, sequence_parallel=run.sequence_parallel,
                        split=split, schedule=run.schedule, vp=run.vp)
        plan = plan_layout(config, layout, run.batch, 2, gpus_per_node=8,
                           links=Links(*DGX_LINKS[run.device], 10e-6),
                           device=Device(profile=load_profile(run.device)))
        results.append({"source": run.source, "name": run.name, "device": run.device, "tp": run.tp,
                        "pp": run.pp, "dp": dp, "gpus": run.gpus, "batch": run.batch,
                        "measured": run.measured, "predicted": plan.step_seconds})
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.published_runs",
                                     description=help_description(__doc__))
    parser.add_argument("--output", default="runs/bench/published_runs.md")
    args = parser.parse_args(argv)
    results = predict(RUNS + _llama_runs())
    rows = ["launch.plan's step time (built-in device profiles, DGX links) against published runs\n",
            "| source | run | device | tp | pp | dp | GPUs | batch | measured step s | predicted s | "
            "predicted / measured |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['source']} | {r['name']} | {r['device']} | {r['tp']} | {r['pp']} | {r['dp']} | "
                    f"{r['gpus']} | {r['batch']} | {r['measured']:.2f} | {r['predicted']:.2f} | "
                    f"{r['predicted'] / r['measured']:.3f} |")
        print(rows[-1], flush=True)
    write_table(args.output, rows)
    return results


if __name__ == "__main__":
    main()
