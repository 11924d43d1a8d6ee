"""Device profiles: what an accelerator achieves, and the compute time of a step priced by it.

A ``DeviceProfile`` holds achieved rates, not the data sheet's peak: matrix products by the size of
their smallest dimension (a product of a thin matrix runs far below the peak), the attention kernel,
and memory bandwidth (what element-wise work and the optimizer step run at). ``compute_seconds`` prices
a step of the busiest pipeline stage by the shapes the layout gives each rank: every matrix product of
a layer (query-key-value, projection, the MLP's two, the output layer) at the rate of its shape, the
attention at the attention rate, the element-wise passes and the optimizer step at the bandwidth; the
link model (``link_model.step_seconds``) adds the communication that does not hide, ``plan`` the
pipeline bubble.

Built-in profiles (``PROFILES``): A100 (SXM, 80 GB), H100 (SXM) and H200. Their peaks are the data
sheets'; their rates are estimates of what a device achieves inside a training step: memory bandwidth
about 80% of the data sheet's, products below an isolated cuBLAS benchmark (an A100 reaches about 270
TFLOP/s on a large bf16 product alone, about 225 among a step's other kernels), the H100's and H200's
scaled from the A100's by their peaks. They are checked, not fitted, against published runs
(``launch.bench.published_runs`` prices Megatron-LM's, MT-NLG's, BLOOM's and Llama 3's runs on up to
16,384 A100s and H100s: docs/published_runs.md; the H200's predicts 56k tokens/s for this project's GPT-3
XL run on one H200, measured 50k eager and 55.5k for plain PyTorch compiled). A device's own rates replace
them: ``python -m launch.tools.gpu_check --sections rates`` measures the device it runs on and writes a
profile file that ``launch.plan --device FILE`` reads, a JSON object of the fields below and nothing else
(an unknown field, a missing one or a non-positive rate is refused by name).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from launch.tools.planning.layer_parts import RECOMPUTED_WHOLE, SUBLAYERS
from models.config import GPTConfig
from models.layers.registry import gated_delta_flops, kimi_delta_flops, mamba_flops

# bytes one element of the step's optimizer state moves through memory (fused AdamW on fp32 masters:
# read master, gradient, two moments; write master, two moments; write the 16-bit copy)
OPTIMIZER_BYTES_PER_ELEMENT = 4 * 4 + 3 * 4 + 2


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator's achieved rates: ``matmul`` ((smallest dimension, FLOP/s) pairs, ascending, of 16-bit
    matrix products), ``attention_flops`` (the fused attention kernel, forward and backward, counted as
    Megatron counts it: 4 s^2 x heads x head_dim per sequence forward, twice that backward),
    ``memory_bandwidth`` (bytes/s of a large copy), ``peak_flops`` (the data sheet's dense 16-bit figure, for
    MFU), ``quantize_rate`` (elements/s, ZeRO++'s passes). Owns numbers only; never measures."""

    name: str
    peak_flops: float
    matmul: tuple[tuple[int, float], ...]
    attention_flops: float
    memory_bandwidth: float
    quantize_rate: float = 100e9

    def __post_init__(self):
        object.__setattr__(self, "matmul", tuple((int(size), float(rate)) for size, rate in self.matmul))
        rates = [self.peak_flops, self.attention_flops, self.memory_bandwidth, self.quantize_rate]
        if not self.matmul or any(not (value > 0) for value in rates + [r for _, r in self.matmul]) \
                or any(size <= 0 for size, _ in self.matmul):
            raise ValueError(f"device profile {self.name!r}: every rate and size must be a positive number")
        if [size for size, _ in self.matmul] != sorted({size for size, _ in self.matmul}):
            raise ValueError(f"device profile {self.name!r}: matmul sizes must rise")

    def matmul_rate(self, smallest: int) -> float:
        """FLOP/s of a product whose smallest dimension is ``smallest``: interpolated in log2 of the size
        between the measured sizes; below the first, proportional to the size (too thin to fill the
        device); above the last, the last."""
        sizes = [size for size, _ in self.matmul]
        if smallest <= sizes[0]:
            return self.matmul[0][1] * smallest / sizes[0]
        for (low, low_rate), (high, high_rate) in zip(self.matmul, self.matmul[1:]):
            if smallest <= high:
                share = (math.log2(smallest) - math.log2(low)) / (math.log2(high) - math.log2(low))
                return low_rate + share * (high_rate - low_rate)
        return self.matmul[-1][1]

    def matmul_seconds(self, m: int, n: int, k: int) -> float:
        """One [m, k] x [k, n] product."""
        return 2 * m * n * k / self.matmul_rate(min(m, n, k))

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "matmul": [list(pair) for pair in self.matmul]}, indent=1)


PROFILES = {
    "a100": DeviceProfile("a100", 312e12, ((256, 95e12), (512, 150e12), (1024, 190e12), (2048, 215e12),
                                           (4096, 225e12)),
                          attention_flops=110e12, memory_bandwidth=1.6e12),
    "h100": DeviceProfile("h100", 989e12, ((256, 210e12), (512, 380e12), (1024, 560e12), (2048, 650e12),
                                           (4096, 700e12)),
                          attention_flops=420e12, memory_bandwidth=2.9e12),
    "h200": DeviceProfile("h200", 989e12, ((256, 220e12), (512, 400e12), (1024, 580e12), (2048, 670e12),
                                           (4096, 720e12)),
                          attention_flops=440e12, memory_bandwidth=4.2e12),
}


# the links of each built-in device's DGX node (per direction): a GPU to another of its node over NVLink, and
# the node to the others over its eight InfiniBand adapters (HDR 200 Gbit/s on A100, NDR 400 Gbit/s after);
# ``launch.plan --device NAME`` uses them where no bandwidth is given
DGX_LINKS = {"a100": (300e9, 8 * 200e9 / 8), "h100": (450e9, 8 * 400e9 / 8), "h200": (450e9, 8 * 400e9 / 8)}


def load_profile(name_or_path: str) -> DeviceProfile:
    """A built-in profile by name, or a profile file (JSON, as ``gpu_check --sections rates`` writes it).
    Raises ValueError naming what is wrong with it."""
    if name_or_path.lower() in PROFILES:
        return PROFILES[name_or_path.lower()]
    try:
        with open(name_or_path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise ValueError(f"{name_or_path!r} is neither a built-in device ({', '.join(PROFILES)}) nor a "
                         "file") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"device profile {name_or_path}: not a JSON file ({error})") from None
    known = {field.name for field in fields(DeviceProfile)}
    if not isinstance(data, dict) or set(data) - known or {"name", "peak_flops", "matmul", "attention_flops",
                                                            "memory_bandwidth"} - set(data):
        raise ValueError(f"device profile {name_or_path}: expected a JSON object of the fields "
                         f"{', '.join(sorted(known))}")
    try:
        return DeviceProfile(str(data["name"]), float(data["peak_flops"]),
                             tuple((int(size), float(rate)) for size, rate in data["matmul"]),
                             float(data["attention_flops"]), float(data["memory_bandwidth"]),
                             float(data.get("quantize_rate", DeviceProfile.quantize_rate)))
    except (TypeError, ValueError) as error:
        raise ValueError(f"device profile {name_or_path}: {error}") from None


def layer_forward_seconds(config: GPTConfig, tokens: int, tp: int, context: int,
                          profile: DeviceProfile) -> tuple[float, float]:
    """(attention's, MLP's) forward seconds of one transformer layer on one rank for ``tokens`` tokens of
    sequences ``context`` tokens long (the keys each query sees), split over ``tp``: the products at the
    rate of their shapes, the attention kernel at its rate, the element-wise passes (norms, residuals,
    biases, activation: each element read and written) at the bandwidth."""
    h, d, f = config.hidden_size, config.head_dim, config.ffn_size
    heads = config.num_attention_heads
    element = 2  # 16-bit activations
    if config.multi_latent_attention:
        attention = _latent_seconds(config, tokens, tp, context, profile)
    else:
        attention = (profile.matmul_seconds(tokens, config.attention_projection_rows // tp, h)
                     + profile.matmul_seconds(tokens, h, heads * d // tp)
                     + 4 * tokens * context * heads * d / tp / profile.attention_flops)
    attention += 6 * tokens * h * element / profile.memory_bandwidth
    up = f * (2 if config.gated else 1) // tp
    mlp = (profile.matmul_seconds(tokens, up, h) + profile.matmul_seconds(tokens, h, f // tp)
           + (6 * tokens * h + 2 * tokens * (up + f // tp)) * element / profile.memory_bandwidth)
    return attention, mlp


def mamba_forward_seconds(config: GPTConfig, tokens: int, tp: int, profile: DeviceProfile) -> float:
    """A Mamba-2 layer's forward seconds on one rank (``_mixer_seconds``; its scan's recurrence 5 I N FLOPs
    a token, ``models.layers.registry.mamba_flops``)."""
    return _mixer_seconds(config, tokens, tp, profile, config.mamba_projection_rows, config.mamba_inner,
                          config.mamba_conv_channels, mamba_flops(config))


def gated_delta_forward_seconds(config: GPTConfig, tokens: int, tp: int, profile: DeviceProfile) -> float:
    """A gated delta net layer's forward seconds on one rank (``_mixer_seconds``; its delta rule's FLOPs,
    ``models.layers.registry.gated_delta_flops``)."""
    return _mixer_seconds(config, tokens, tp, profile, config.gdn_projection_rows, config.gdn_value_width,
                          config.gdn_conv_channels, gated_delta_flops(config))


def kimi_delta_forward_seconds(config: GPTConfig, tokens: int, tp: int, profile: DeviceProfile) -> float:
    """A Kimi delta attention layer's forward seconds on one rank (``_mixer_seconds``, the rule's FLOPs as
    a gated delta net's; its low-rank decay and gate projections, d / h of the input projection's
    products each, left out)."""
    return _mixer_seconds(config, tokens, tp, profile, config.kda_projection_rows, config.gdn_value_width,
                          config.kda_conv_channels, kimi_delta_flops(config))


def _mixer_seconds(config: GPTConfig, tokens: int, tp: int, profile: DeviceProfile, rows: int, width: int,
                   channels: int, mixing_flops: float) -> float:
    """A linear-time mixer's forward on one rank: its input projection (``rows``) and output projection
    (from ``width``) at the rate of their shapes, its recurrence (``mixing_flops`` a token) at the fused
    kernels' rate, and the element-wise passes (norms, convolution over ``channels``, gate, residual) at
    the bandwidth."""
    h, element = config.hidden_size, 2
    rows, width, channels = rows // tp, width // tp, channels // tp
    return (profile.matmul_seconds(tokens, rows, h) + profile.matmul_seconds(tokens, h, width)
            + tokens * mixing_flops / tp / profile.attention_flops
            + (6 * tokens * h + 2 * tokens * (rows + 2 * channels + 3 * width)) * element
            / profile.memory_bandwidth)


def _latent_seconds(config: GPTConfig, tokens: int, tp: int, context: int, profile: DeviceProfile) -> float:
    """Latent attention's products (the down projections whole on every rank, the up and output
    projections split by head) and its kernel (query/key and value widths of their own)."""
    heads, rank = config.num_attention_heads // tp, config.q_lora_rank
    query_key, value, h = config.query_key_channels, config.value_channels, config.hidden_size
    latent = config.kv_lora_rank + config.qk_pos_emb_head_dim + (rank or 0)
    queries = (profile.matmul_seconds(tokens, heads * query_key, rank) if rank
               else profile.matmul_seconds(tokens, heads * query_key, h))
    return (profile.matmul_seconds(tokens, latent, h) + queries
            + profile.matmul_seconds(tokens, heads * (config.qk_head_dim + value), config.kv_lora_rank)
            + profile.matmul_seconds(tokens, h, heads * value)
            + 2 * tokens * context * heads * (query_key + value) / profile.attention_flops)


def compute_seconds(config: GPTConfig, tp: int, cp: int, micro_batch_size: int, entries: tuple[str, ...],
                    micro_batches: int, recompute: str | None, recompute_modules: tuple[str, ...],
                    last_stage: bool, parameters: float, profile: DeviceProfile) -> float:
    """A step's compute on one rank of a stage of layers of registry ``entries``: every micro-batch's
    forward and backward (backward twice the forward's products; full recompute one forward more, selective
    recompute of an MLP or Mamba mixer its forward again), the output layer and loss on the last stage, and
    the optimizer step over the rank's ``parameters`` (its shard) at the bandwidth. No bubble, no
    communication."""
    tokens = micro_batch_size * config.seq_length // cp
    attention, mlp = layer_forward_seconds(config, tokens, tp, config.seq_length, profile)
    seconds = {"attention": attention, "mlp": mlp, "moe": mlp,
               "mamba": mamba_forward_seconds(config, tokens, tp, profile),
               "gdn": gated_delta_forward_seconds(config, tokens, tp, profile),
               "kda": kimi_delta_forward_seconds(config, tokens, tp, profile)}
    redone = set(seconds) if recompute == "full" else (
        {part for part, name in RECOMPUTED_WHOLE.items() if name in recompute_modules}
        if recompute == "selective" else set())
    per_micro_batch = sum(3 * seconds[part] + (seconds[part] if part in redone else 0.0)
                          for entry in entries for part in SUBLAYERS[entry])
    if last_stage:
        vocab = -(-config.vocab_size // tp)
        per_micro_batch += 3 * profile.matmul_seconds(tokens, vocab, config.hidden_size) \
            + 4 * tokens * vocab * 4 / profile.memory_bandwidth  # the loss's fp32 passes over the logits
    optimizer = parameters * OPTIMIZER_BYTES_PER_ELEMENT / profile.memory_bandwidth
    return per_micro_batch * micro_batches + optimizer
