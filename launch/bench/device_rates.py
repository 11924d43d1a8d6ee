"""The achieved rates of the device this runs on, written as a profile for ``launch.plan --device FILE``.

    python -m launch.bench.device_rates [--output runs/bench/device_profile.json] [--smoke]

Matrix products of square shapes from 256 to 8192 (16-bit on a GPU, fp32 on the CPU), the attention kernel
(torch's scaled-dot-product attention, causal, forward and backward, counted as Megatron counts it), and
a large copy's bytes read and written per second; each the median of timed repetitions after a warm-up.
The fields are ``launch.tools.planning.devices.DeviceProfile``'s. ``--smoke`` takes small sizes (the CPU
check that keeps this from rotting).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from launch.help_text import help_description


def _timed(run, device: torch.device, repeats: int) -> float:
    """Median seconds of ``run()`` over ``repeats`` calls after two warm-up calls."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        run()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(device: torch.device, smoke: bool = False, repeats: int = 5):
    """This device's ``DeviceProfile``."""
    from launch.tools.planning.devices import DeviceProfile
    from pretrain.observability.metrics import peak_flops

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = (64, 128, 256) if smoke else (256, 512, 1024, 2048, 4096, 8192)
    matmul = []
    for size in sizes:
        a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
        matmul.append((size, 2 * size ** 3 / _timed(lambda: a @ b, device, repeats)))
    batch, heads, length, head_dim = (1, 2, 128, 32) if smoke else (4, 16, 2048, 128)
    q, k, v = (torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def attention():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    attention_flops = 3 * 4 * batch * heads * length ** 2 * head_dim / _timed(attention, device, repeats)
    elements = (1 << 20) if smoke else (1 << 28)
    source = torch.empty(elements, device=device, dtype=torch.float32)
    target = torch.empty_like(source)
    bandwidth = 2 * 4 * elements / _timed(lambda: target.copy_(source), device, repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_flops(device, dtype) or max(rate for _, rate in matmul)
    return DeviceProfile(name, peak, tuple(matmul), attention_flops, bandwidth)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m launch.bench.device_rates",
                                     description=help_description(__doc__))
    parser.add_argument("--output", default="runs/bench/device_profile.json")
    parser.add_argument("--smoke", action="store_true", help="small sizes (a check, not a profile)")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    profile = measure(device, args.smoke)
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as handle:
        handle.write(profile.to_json() + "\n")
    largest = profile.matmul[-1]
    print(f"device rates ({profile.name}): matmul {largest[1] / 1e12:.1f} TFLOP/s at {largest[0]}, attention "
          f"{profile.attention_flops / 1e12:.1f} TFLOP/s, copy {profile.memory_bandwidth / 1e9:.0f} GB/s -> "
          f"{args.output} (launch.plan --device {args.output})", flush=True)
    return profile


if __name__ == "__main__":
    main()
