"""ZeRO stages 0-3 against torch DDP, ZeroRedundancyOptimizer and FSDP2, in one run.

    python -m launch.bench_zero [--dp 2 4] [--steps 8] [--output runs/bench/zero.md]

For each data-parallel size, one torchrun world trains the same GPT (fp32, AdamW) on the same
synthetic batches with each system in turn and measures per rank: median step time (forward,
backward, optimizer step), tokens/s, model-state bytes (parameters, gradients, optimizer states:
the distinct storages of those tensors), the bytes the process wrote to its sockets per step (read
from /proc/self/io: what gloo really sent, the same instrument for every system), our collectives'
ring-model count, and the final loss (all systems must agree). The table reports step time as a
ratio to DDP measured in the same world.
"""

from __future__ import annotations

import argparse
import statistics
import time

from launch.bench_world import add_worker_arguments, run_world, write_result, write_table


def _written_bytes() -> int:
    with open("/proc/self/io") as handle:
        for line in handle:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from models.config import GPTConfig
    from models.gpt import GPTModel
    from parallel import zero
    from parallel.zero.memory import storage_bytes
    from parallel.process_groups import create_process_groups, init_distributed, shutdown_distributed
    from parallel.topology import Topology

    init_distributed()
    groups = create_process_groups(Topology(dist.get_world_size()))
    config = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8, seq_length=args.seq,
                       vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.micro_batch * groups.dp.size, args.seq), generator=generator)
               for _ in range(args.steps + 2)]
    bucket_elements = args.bucket_mb * 2**20 // 4

    def adamw(param_groups):
        return torch.optim.AdamW(param_groups, lr=1e-4, foreach=True)

    def ours(stage):
        model = GPTModel(config, groups.tp, seed=0)
        _, optimizer = zero.initialize(model, adamw, stage=stage, group=groups.dp, bucket_size=bucket_elements,
                                       unit_modules=list(model.layers))
        return model, model, optimizer, lambda: optimizer.model_state_bytes()

    def fsdp2():
        from torch.distributed.fsdp import fully_shard

        model = GPTModel(config, groups.tp, seed=0)
        for block in model.layers:
            fully_shard(block, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        optimizer = adamw(model.parameters())

        def state_bytes():
            local = [p.to_local() for p in model.parameters()]
            local += [p.grad.to_local() for p in model.parameters() if p.grad is not None]
            local += [t.to_local() if hasattr(t, "to_local") else t for s in optimizer.state.values()
                      for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
            return storage_bytes(local)
        return model, model, optimizer, state_bytes

    def torch_ddp(sharded):
        model = GPTModel(config, groups.tp, seed=0)
        wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4) if sharded \
            else adamw(model.parameters())
        local = optimizer.optim if sharded else optimizer

        def state_bytes():
            tensors = [p.data for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
            tensors += [t for s in local.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
            return storage_bytes(tensors)
        return model, wrapped, optimizer, state_bytes

    systems = {"torch DDP": lambda: torch_ddp(False), "torch ZeroRedundancyOptimizer": lambda: torch_ddp(True),
               "ours stage 0": lambda: ours(0), "ours stage 1": lambda: ours(1), "ours stage 2": lambda: ours(2),
               "torch FSDP2 (per block)": fsdp2, "ours stage 3": lambda: ours(3)}
    built = {name: build() for name, build in systems.items()}
    positions = torch.arange(args.seq).expand(args.micro_batch, args.seq)
    measured = {name: {"times": [], "written": [], "counted": []} for name in built}
    # steps of the systems alternate, so a slow spell of the machine hits all of them alike
    for step, batch in enumerate(batches):
        tokens = batch.chunk(groups.dp.size)[groups.dp.rank]
        for name, (model, runner, optimizer, state_bytes) in built.items():
            dist.barrier()
            groups.stats.reset()
            started, start_bytes = time.perf_counter(), _written_bytes()
            loss = runner(tokens, positions, labels=tokens).mean()
            loss.backward()
            optimizer.step()
            elapsed, sent = time.perf_counter() - started, _written_bytes() - start_bytes
            record = measured[name]
            record["held"] = state_bytes()  # parameters, gradients and states all alive, before zero_grad
            record["loss"] = loss.item()
            optimizer.zero_grad()
            if step >= 2:  # two warm-up steps: allocations, optimizer states, connections
                record["times"].append(elapsed)
                record["written"].append(sent)
                record["counted"].append(groups.stats.total_bytes())
    results = {name: {"step_s": statistics.median(r["times"]), "state_bytes": r["held"],
                      "written": statistics.median(r["written"]), "counted": statistics.median(r["counted"]),
                      "loss": r["loss"], "params": sum(p.numel() for p in GPTModel(config, groups.tp, seed=0)
                                                       .parameters())}
               for name, r in measured.items()}
    write_result(args.worker_output, groups.rank, results)
    shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench_zero", description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=2, help="samples per rank per step")
    parser.add_argument("--bucket-mb", type=int, default=25, help="fused bucket size, the same for DDP and ours")
    parser.add_argument("--output", default="runs/bench/zero.md")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    forwarded = ["--worker", "--steps", str(args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
                 "--seq", str(args.seq), "--vocab", str(args.vocab), "--micro-batch", str(args.micro_batch),
                 "--bucket-mb", str(args.bucket_mb)]
    rows = ["| dp | system | median step s | vs DDP | tokens/s | model-state MiB/rank | socket MiB/rank/step "
            "| counted MiB/rank/step | final loss |", "|---|---|---|---|---|---|---|---|---|"]
    for dp in args.dp:
        ranks = run_world("launch.bench_zero", dp, forwarded)
        ddp = statistics.mean(r["torch DDP"]["step_s"] for r in ranks)
        for name in ranks[0]:
            step = statistics.mean(r[name]["step_s"] for r in ranks)
            tokens = args.micro_batch * dp * args.seq
            rows.append(f"| {dp} | {name} | {step:.3f} | {step / ddp:.3f}x | {tokens / step:,.0f} | "
                        f"{max(r[name]['state_bytes'] for r in ranks) / 2**20:.1f} | "
                        f"{statistics.mean(r[name]['written'] for r in ranks) / 2**20:.1f} | "
                        f"{statistics.mean(r[name]['counted'] for r in ranks) / 2**20:.1f} | "
                        f"{ranks[0][name]['loss']:.6f} |")
            print(rows[-1], flush=True)
    params = ranks[0]["torch DDP"]["params"]
    rows.append(f"\n{params:,} parameters, fp32; DDP's ring all-reduce needs 2P(N-1)/N x 4 bytes "
                f"= {2 * params * 4 * 0.5 / 2**20:.1f} MiB at dp 2")
    write_table(args.output, rows)


if __name__ == "__main__":
    main()
