"""A Mamba-2 hybrid and a gated delta net hybrid against the transformer of equal parameters, and our
Mamba-2 and gated delta net layers against transformers' NemotronH and Qwen3-Next layers (their PyTorch
paths), each measurement in a process of its own:

    python -m launch.bench.hybrid [--lengths 1024 2048 4096 8192] [--repeats 3]
    [--rows layer model gdn-layer gdn-model kda-layer] [--output runs/bench/hybrid.md]

``layer`` rows: one Mamba-2 layer (pre-norm, mixer, residual) on the same shapes and weights' shapes, ours
(``models.mamba.layer``: the chunked scan keeping only its inputs and redoing its chunks in backward, the
gated norm keeping y, z and 1 / rms) against transformers' ``NemotronHBlock`` (what its ``torch_forward``
keeps): the median forward + backward time of the repeats, its ratio to transformers', and the bytes saved
for backward (saved-tensor hooks). ``model`` rows: our hybrid of the pattern (Mamba-2, MLP and one attention
layer in eight) against our GPT of the same width whose MLP width is set for the same parameters: step
time (forward, loss, backward) and saved bytes at each length. ``gdn-layer`` and ``gdn-model`` rows: the same
for a gated delta net (``models.gdn.layer`` against a pre-norm, transformers' ``Qwen3NextGatedDeltaNet`` and
the residual) and a 3:1 hybrid of them (``G-G-G-*-``, Qwen3-Next's proportion). ``kda-layer`` rows: our
Kimi delta attention layer (the value heads and width) against transformers' Kimi Linear
``KimiLinearDeltaAttention`` with its pre-norm and the residual. The two systems of a row alternate,
process by process; one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from launch.bench.world import write_table
from launch.help_text import help_description

SHAPE = {"hidden": 256, "head_dim": 32, "heads": 16, "groups": 2, "state": 64, "chunk": 128, "vocab": 8192,
         "pattern": "M-M-*-M-", "attention_heads": 4,
         # a gated delta net's: key heads of key_dim, twice the value heads of value_dim
         "key_heads": 4, "value_heads": 8, "key_dim": 64, "value_dim": 64, "gdn_pattern": "G-G-G-*-"}
GDN = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
SHAPE_OF_GDN = ("key_heads", "value_heads", "key_dim", "value_dim")


def _layer_worker(system: str, length: int, shape: dict, warmup: int = 1, steps: int = 3) -> dict:
    import torch

    from parallel.saved_activations import SavedActivationMeter

    torch.manual_seed(0)
    h = shape["hidden"]
    if system == "ours":
        from models.config import GPTConfig
        from models.mamba.layer import MambaLayer
        from parallel.comm import AxisGroup, CommStats
        from parallel.tensor.random import model_parallel_tracker

        config = GPTConfig(hybrid_layer_pattern="M", hidden_size=h, num_attention_heads=4, seq_length=length,
                           vocab_size=100, mamba_head_dim=shape["head_dim"], mamba_num_heads=shape["heads"],
                           mamba_num_groups=shape["groups"], mamba_state_dim=shape["state"],
                           mamba_chunk_size=shape["chunk"], normalization="RMSNorm", hidden_dropout=0.0)
        layer = MambaLayer(config, 0, AxisGroup("tp", (0,), None, CommStats()), 0, False,
                           model_parallel_tracker(0, 0))
        x = torch.randn(length, 1, h, requires_grad=True)

        def forward():
            return layer(x)
    else:
        from transformers import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

        config = NemotronHConfig(hidden_size=h, mamba_num_heads=shape["heads"],
                                 mamba_head_dim=shape["head_dim"], n_groups=shape["groups"],
                                 ssm_state_size=shape["state"], chunk_size=shape["chunk"],
                                 layer_norm_epsilon=1e-5, layers_block_type=["mamba"], vocab_size=100)
        layer = NemotronHBlock(config, 0).train()
        x = torch.randn(1, length, h, requires_grad=True)

        def forward():
            out = layer(x)
            return out[0] if isinstance(out, tuple) else out
    return _timed(forward, warmup, steps, SavedActivationMeter)


def _gdn_layer_worker(system: str, length: int, shape: dict, warmup: int = 1, steps: int = 3) -> dict:
    import torch

    from parallel.saved_activations import SavedActivationMeter

    torch.manual_seed(0)
    h = shape["hidden"]
    if system == "ours":
        from models.config import GPTConfig
        from models.gdn.layer import GatedDeltaLayer
        from parallel.comm import AxisGroup, CommStats
        from parallel.tensor.random import model_parallel_tracker

        config = GPTConfig(hybrid_layer_pattern="G", hidden_size=h, num_attention_heads=4, seq_length=length,
                           vocab_size=100, normalization="RMSNorm", hidden_dropout=0.0,
                           **{ours: shape[key] for ours, key in zip(GDN, SHAPE_OF_GDN)})
        layer = GatedDeltaLayer(config, 0, AxisGroup("tp", (0,), None, CommStats()), 0, False,
                                model_parallel_tracker(0, 0))
        x = torch.randn(length, 1, h, requires_grad=True)

        def forward():
            return layer(x)
    else:
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextGatedDeltaNet,
                                                                         Qwen3NextRMSNorm)

        config = Qwen3NextConfig(hidden_size=h, num_hidden_layers=1, vocab_size=100, hidden_act="silu",
                                 **{ours: shape[key] for ours, key in zip(GDN, SHAPE_OF_GDN)})
        mixer, norm = Qwen3NextGatedDeltaNet(config, 0).train(), Qwen3NextRMSNorm(h)
        x = torch.randn(1, length, h, requires_grad=True)

        def forward():  # its decoder layer's pre-norm, mixer and residual
            return x + mixer(norm(x))
    return _timed(forward, warmup, steps, SavedActivationMeter)


def _kda_layer_worker(system: str, length: int, shape: dict, warmup: int = 1, steps: int = 3) -> dict:
    import torch

    from parallel.saved_activations import SavedActivationMeter

    torch.manual_seed(0)
    h, heads, width = shape["hidden"], shape["value_heads"], shape["value_dim"]
    if system == "ours":
        from models.config import GPTConfig
        from models.kda.layer import KimiDeltaLayer
        from parallel.comm import AxisGroup, CommStats
        from parallel.tensor.random import model_parallel_tracker

        config = GPTConfig(hybrid_layer_pattern="K", hidden_size=h, num_attention_heads=4, seq_length=length,
                           vocab_size=100, normalization="RMSNorm", hidden_dropout=0.0,
                           linear_num_value_heads=heads, linear_value_head_dim=width)
        layer = KimiDeltaLayer(config, 0, AxisGroup("tp", (0,), None, CommStats()), 0, False,
                               model_parallel_tracker(0, 0))
        x = torch.randn(length, 1, h, requires_grad=True)

        def forward():
            return layer(x)
    else:
        from transformers import KimiLinearConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import (KimiLinearDeltaAttention,
                                                                           KimiLinearRMSNorm)

        config = KimiLinearConfig(hidden_size=h, num_hidden_layers=1, vocab_size=100, pad_token_id=0,
                                  bos_token_id=0, eos_token_id=1, linear_attn_config={
                                      "num_heads": heads, "head_dim": width, "short_conv_kernel_size": 4,
                                      "kda_layers": [1], "full_attn_layers": []})
        mixer, norm = KimiLinearDeltaAttention(config, 0).train(), KimiLinearRMSNorm(h)
        x = torch.randn(1, length, h, requires_grad=True)

        def forward():  # its decoder layer's pre-norm, mixer and residual
            return x + mixer(norm(x))
    return _timed(forward, warmup, steps, SavedActivationMeter)


def _model_worker(system: str, length: int, shape: dict, warmup: int = 1, steps: int = 3) -> dict:
    import torch

    from models.config import GPTConfig
    from models.gpt import GPTModel
    from parallel.comm import AxisGroup, CommStats
    from parallel.saved_activations import SavedActivationMeter

    config = GPTConfig(**model_config(system, length, shape))
    model = GPTModel(config, AxisGroup("tp", (0,), None, CommStats()), seed=0)
    tokens = torch.randint(0, shape["vocab"], (1, length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length).expand(1, length)

    def forward():
        return model(tokens, positions, labels=tokens).mean()
    result = _timed(forward, warmup, steps, SavedActivationMeter)
    return {**result, "parameters": sum(p.numel() for p in model.parameters())}


def model_config(system: str, length: int, shape: dict) -> dict:
    """The hybrid's settings (a Mamba-2 one, or with ``shape``'s ``gdn`` a gated delta net one), or the
    transformer's: as many layers of two parts, its MLP wide enough for the same parameters
    (``equal_ffn``)."""
    common = dict(hidden_size=shape["hidden"], num_attention_heads=shape["attention_heads"],
                  seq_length=length, vocab_size=shape["vocab"], normalization="RMSNorm",
                  position_embedding_type="rope", swiglu=True, disable_bias_linear=True, hidden_dropout=0.0,
                  attention_dropout=0.0, ffn_hidden_size=4 * shape["hidden"])
    if system == "hybrid" and shape.get("gdn"):
        return dict(common, hybrid_layer_pattern=shape["gdn_pattern"],
                    **{ours: shape[key] for ours, key in zip(GDN, SHAPE_OF_GDN)})
    if system == "hybrid":
        return dict(common, hybrid_layer_pattern=shape["pattern"], mamba_head_dim=shape["head_dim"],
                    mamba_num_heads=shape["heads"], mamba_num_groups=shape["groups"],
                    mamba_state_dim=shape["state"], mamba_chunk_size=shape["chunk"])
    return dict(common, num_layers=len(_pattern(shape)) // 2, ffn_hidden_size=equal_ffn(shape))


def _pattern(shape: dict) -> str:
    return shape["gdn_pattern"] if shape.get("gdn") else shape["pattern"]


def equal_ffn(shape: dict) -> int:
    """The transformer's MLP width that gives it the hybrid's parameters (to a multiple of 8)."""
    from models.config import GPTConfig
    from models.counting import num_parameters

    def count(**options) -> int:
        return num_parameters(GPTConfig(**{**model_config("hybrid", 64, shape), **options}))
    target = count()
    layers = len(_pattern(shape)) // 2
    base = count(hybrid_layer_pattern=None, num_layers=layers, ffn_hidden_size=8)
    per_width = (count(hybrid_layer_pattern=None, num_layers=layers, ffn_hidden_size=16) - base) / 8
    return max(8, 8 * round((8 + (target - base) / per_width) / 8))


def _timed(forward, warmup: int, steps: int, meter_class) -> dict:
    times, saved = [], 0
    for step in range(warmup + steps):
        meter = meter_class()
        started = time.perf_counter()
        with meter.recording():
            out = forward()
        out.float().square().mean().backward() if out.dim() else out.backward()
        if step >= warmup:
            times.append(time.perf_counter() - started)
            saved = meter.peak_bytes
    return {"seconds": statistics.median(times), "saved_bytes": saved}


ROWS = {"layer": (("ours", "transformers"), _layer_worker),
        "model": (("hybrid", "transformer"), _model_worker),
        "gdn-layer": (("ours", "transformers"), _gdn_layer_worker),
        "gdn-model": (("hybrid", "transformer"), _model_worker),
        "kda-layer": (("ours", "transformers"), _kda_layer_worker)}


def _run(kind: str, system: str, length: int, shape: dict) -> dict:
    command = [sys.executable, "-m", "launch.bench.hybrid", "--worker", kind, system, str(length),
               json.dumps(shape)]
    job = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    found = [line for line in job.stdout.splitlines() if line.startswith("RESULT ")]
    if job.returncode or not found:
        sys.exit(f"{kind} {system} at {length} failed:\n{job.stderr[-3000:]}")
    return json.loads(found[-1][len("RESULT "):])


def measure(lengths: list[int], repeats: int, shape: dict, kinds: list[str]) -> list[str]:
    rows = ["| rows | tokens | system | step s (median) | vs peer | saved MiB | vs peer | parameters |",
            "|---|---|---|---|---|---|---|---|"]
    for kind in kinds:
        systems = ROWS[kind][0]
        for length in lengths:
            runs = {system: [] for system in systems}
            for _ in range(repeats):  # the two alternate, process by process
                for system in systems:
                    runs[system].append(_run(kind, system, length, shape))
            summary = {system: {"seconds": statistics.median(r["seconds"] for r in found),
                                "saved_bytes": found[-1]["saved_bytes"],
                                "parameters": found[-1].get("parameters")}
                       for system, found in runs.items()}
            peer = summary[systems[1]]
            for system in systems:
                mine = summary[system]
                count = f"{mine['parameters']:,}" if mine["parameters"] else "-"
                rows.append(f"| {kind} | {length} | {system} | {mine['seconds']:.3f} | "
                            f"{mine['seconds'] / peer['seconds']:.2f}x | {mine['saved_bytes'] / 2**20:.1f} | "
                            f"{mine['saved_bytes'] / peer['saved_bytes']:.2f}x | {count} |")
            print(rows[-2], rows[-1], sep="\n", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        kind, system, length, shape = argv[1], argv[2], int(argv[3]), json.loads(argv[4])
        shape["gdn"] = kind.startswith("gdn")
        print("RESULT " + json.dumps(ROWS[kind][1](system, length, shape)), flush=True)
        return
    parser = argparse.ArgumentParser(prog="python -m launch.bench.hybrid",
                                     description=help_description(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                        help="tokens per sequence (default: 1024 2048 4096 8192)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per system and length (default: 3)")
    parser.add_argument("--hidden", type=int, default=SHAPE["hidden"], help="model width (default: 256)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS),
                        help="which comparisons (default: all)")
    parser.add_argument("--output", default="runs/bench/hybrid.md", help="where the table goes")
    args = parser.parse_args(argv)
    shape = dict(SHAPE, hidden=args.hidden)
    rows = measure(args.lengths, args.repeats, shape, args.rows)
    title = (f"Mamba-2 layer and hybrid '{shape['pattern']}' (h {shape['hidden']}, {shape['heads']} heads of "
             f"{shape['head_dim']}, {shape['groups']} groups, state {shape['state']}, chunk "
             f"{shape['chunk']}); gated delta net layer and hybrid '{shape['gdn_pattern']}' "
             f"({shape['key_heads']} key heads of {shape['key_dim']}, {shape['value_heads']} value heads of "
             f"{shape['value_dim']}); one thread each, batch 1")
    write_table(args.output, [title, "", *rows])


if __name__ == "__main__":
    main()
