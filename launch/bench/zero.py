"""ZeRO stages 0-3 against torch DDP, ZeroRedundancyOptimizer and FSDP2, in one run.

    python -m launch.bench.zero [--dp 2 4] [--rounds 3] [--model plain|ours] [--worlds one|separate]
                                [--output runs/bench/zero.md]

Every system trains the same GPT (fp32, AdamW) on the same synthetic batches and is measured per
rank: median step time (forward, backward, optimizer step) after the warm-up steps, tokens/s,
model-state bytes (parameters, gradients, optimizer states: the distinct storages of those tensors),
the bytes the process wrote to its sockets per step (read from /proc/self/io: what gloo really sent,
the same instrument for every system), our collectives' ring-model count, and the final loss (all
systems must agree). Step time is a ratio to DDP (and to FSDP2) measured in the same round; with
``--rounds N`` every system is measured N times, the systems alternating, and each figure is the median
over the rounds (of the round's ratio, for the ratios), so that the machine's drift cancels.

``--model plain`` (the default) is a GPT that is not the project's (``launch.bench.plain_gpt``: what a
newcomer writes in plain torch), wrapped by each system from outside; ``--model ours`` is
``models.gpt``. ``--worlds separate`` runs each system in its own torchrun world, one after the other,
as a user would, and also reports each rank's peak resident memory (every byte the process ever
held: one system per process); ``--worlds one`` alternates the systems step by step inside one world,
so a slow spell of the machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from launch.bench.world import add_worker_arguments, run_world, write_result, write_table
from launch.help_text import help_description


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

    from launch.bench.plain_gpt import PlainGPT
    from models.config import GPTConfig
    from models.gpt import GPTModel
    from parallel import zero
    from parallel.zero.memory import storage_bytes
    from parallel.process_groups import create_process_groups, init_distributed, shutdown_distributed
    from parallel.topology import Topology

    init_distributed()
    groups = create_process_groups(Topology(dist.get_world_size()))
    config = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.global_batch, args.seq), generator=generator)
               for _ in range(args.steps + args.warmup)]
    positions = torch.arange(args.seq).expand(args.global_batch // groups.dp.size, args.seq)

    def adamw(param_groups):
        return torch.optim.AdamW(param_groups, **ADAMW)

    sizes = []  # parameters of the model as built, before any system shards it

    def new_model():
        """(the model, its repeated blocks, the loss of a batch given the callable that runs the model)."""
        if args.model == "plain":
            model = PlainGPT(args.vocab, args.hidden, args.layers, args.heads, args.seq, seed=0)
            blocks, loss = list(model.blocks), lambda run, tokens: run(tokens, tokens)
        else:
            model = GPTModel(config, groups.tp, seed=0)
            blocks, loss = (list(model.layers),
                            lambda run, tokens: run(tokens, positions, labels=tokens).mean())
        sizes.append(sum(p.numel() for p in model.parameters()))
        return model, blocks, loss

    def ours(stage):
        model, blocks, loss = new_model()
        # the library's defaults, which are the trainer's: what a user who calls zero.initialize gets
        _, optimizer = zero.initialize(model, adamw, zero.ZeroOptions(stage=stage), groups.dp,
                                       unit_modules=blocks)
        return model, lambda tokens: loss(model, tokens), optimizer, lambda: optimizer.model_state_bytes()

    def fsdp2():
        from torch.distributed.fsdp import fully_shard

        model, blocks, loss = new_model()
        for block in blocks:
            fully_shard(block, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        optimizer = adamw(model.parameters())

        def state_bytes():
            local = [p.to_local() for p in model.parameters()]
            local += [p.grad.to_local() for p in model.parameters() if p.grad is not None]
            local += [t.to_local() if hasattr(t, "to_local") else t for s in optimizer.state.values()
                      for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
            return storage_bytes(local)
        return model, lambda tokens: loss(model, tokens), optimizer, state_bytes

    def torch_ddp(sharded):
        model, _, loss = new_model()
        wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW) if sharded \
            else adamw(model.parameters())
        local = optimizer.optim if sharded else optimizer

        def state_bytes():
            tensors = ([p.data for p in model.parameters()]
                       + [p.grad for p in model.parameters() if p.grad is not None])
            tensors += [t for s in local.state.values() for t in s.values()
                        if torch.is_tensor(t) and t.numel() > 1]
            return storage_bytes(tensors)
        return model, lambda tokens: loss(wrapped, tokens), optimizer, state_bytes

    systems = {"torch DDP": lambda: torch_ddp(False),
               "torch ZeroRedundancyOptimizer": lambda: torch_ddp(True),
               "ours stage 0": lambda: ours(0), "ours stage 1": lambda: ours(1),
               "ours stage 2": lambda: ours(2),
               "torch FSDP2 (per block)": fsdp2, "ours stage 3": lambda: ours(3)}
    built = {name: systems[name]() for name in args.systems}
    measured = {name: {"times": [], "written": [], "counted": []} for name in built}
    # steps of the systems alternate, so a slow spell of the machine hits all of them alike
    for step, batch in enumerate(batches):
        tokens = batch.chunk(groups.dp.size)[groups.dp.rank]
        for name, (model, runner, optimizer, state_bytes) in built.items():
            dist.barrier()
            groups.stats.reset()
            started, start_bytes = time.perf_counter(), _written_bytes()
            loss = runner(tokens)
            loss.backward()
            optimizer.step()
            elapsed, sent = time.perf_counter() - started, _written_bytes() - start_bytes
            record = measured[name]
            record["held"] = state_bytes()  # parameters, gradients and states all alive, before zero_grad
            record["loss"] = loss.item()
            optimizer.zero_grad()
            if step >= args.warmup:  # warm-up steps: allocations, optimizer states, connections
                record["times"].append(elapsed)
                record["written"].append(sent)
                record["counted"].append(groups.stats.total_bytes())
    results = {name: {"step_s": statistics.median(r["times"]), "state_bytes": r["held"],
                      "written": statistics.median(r["written"]), "counted": statistics.median(r["counted"]),
                      "loss": r["loss"], "params": sizes[0],
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
               for name, r in measured.items()}
    write_result(args.worker_output, groups.rank, results)
    shutdown_distributed()


ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "foreach": True}
SYSTEMS = ["torch DDP", "torch ZeroRedundancyOptimizer", "ours stage 0", "ours stage 1", "ours stage 2",
           "torch FSDP2 (per block)", "ours stage 3"]


def _round(dp: int, args: argparse.Namespace, forwarded: list[str]) -> list[dict]:
    """One measurement of every system at ``dp`` ranks: per rank, {system: its results}. Separate worlds run
    one after another in the order given (DDP, ours, FSDP2, ours, ...), so that rounds repeated alternate
    them and a slow spell of the machine falls on all of them."""
    if args.worlds == "one":
        return run_world("launch.bench.zero", dp, forwarded + ["--systems", *args.systems])
    ranks = [{} for _ in range(dp)]
    for name in args.systems:
        for mine, theirs in zip(ranks, run_world("launch.bench.zero", dp, forwarded + ["--systems", name])):
            mine.update(theirs)
    return ranks


def _step(ranks: list[dict], name: str) -> float:
    """A system's median step time in one round, averaged over the ranks."""
    return statistics.mean(r[name]["step_s"] for r in ranks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.zero",
                                     description=help_description(__doc__))
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", choices=["plain", "ours"], default="plain",
                        help="plain: launch.bench.plain_gpt, a GPT that is not ours; ours: models.gpt")
    parser.add_argument("--worlds", choices=["one", "separate"], default="separate",
                        help="separate: each system in its own torchrun world; one: all alternating in one")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS, metavar="SYSTEM")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measure every system this many times, alternating; report the medians")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step over all ranks")
    parser.add_argument("--bucket-mb", type=int, default=25,
                        help="DDP's bucket_cap_mb (its default); ours run zero.ZeroOptions' defaults")
    parser.add_argument("--output", default="runs/bench/zero.md")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    forwarded = ["--worker", "--model", args.model, "--warmup", str(args.warmup), "--steps", str(args.steps),
                 "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
                 "--seq", str(args.seq), "--vocab", str(args.vocab), "--global-batch", str(args.global_batch),
                 "--bucket-mb", str(args.bucket_mb)]
    rows = [f"model {args.model}, worlds {args.worlds}, {args.warmup} warm-up + {args.steps} timed steps, "
            f"global batch {args.global_batch} x {args.seq} tokens, median of {args.rounds} round(s)\n",
            "| dp | system | median step s | vs DDP | vs FSDP2 | tokens/s | model-state MiB/rank "
            "| peak RSS MiB/rank | socket MiB/rank/step | counted MiB/rank/step | final loss |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for dp in args.dp:
        rounds = [_round(dp, args, forwarded) for _ in range(args.rounds)]
        ranks = rounds[-1]
        for name in args.systems:
            step = statistics.median(_step(ranks, name) for ranks in rounds)
            versus = {peer: f"{statistics.median(_step(r, name) / _step(r, peer) for r in rounds):.3f}x"
                      if peer in ranks[0] else "-" for peer in ("torch DDP", "torch FSDP2 (per block)")}
            rss = (f"{max(r[name]['peak_rss'] for r in ranks) / 2**20:.0f}" if args.worlds == "separate"
                   else "-")
            rows.append(f"| {dp} | {name} | {step:.3f} | {versus['torch DDP']} | "
                        f"{versus['torch FSDP2 (per block)']} | {args.global_batch * args.seq / step:,.0f} | "
                        f"{max(r[name]['state_bytes'] for r in ranks) / 2**20:.1f} | {rss} | "
                        f"{statistics.mean(r[name]['written'] for r in ranks) / 2**20:.1f} | "
                        f"{statistics.mean(r[name]['counted'] for r in ranks) / 2**20:.1f} | "
                        f"{ranks[0][name]['loss']:.6f} |")
            print(rows[-1], flush=True)
    params = ranks[0][args.systems[0]]["params"]
    needs = ", ".join(f"{2 * params * 4 * (dp - 1) / dp / 2**20:.1f} MiB at dp {dp}" for dp in args.dp)
    rows.append(f"\n{params:,} parameters, fp32; DDP's ring all-reduce needs 2P(N-1)/N x 4 bytes = {needs}")
    write_table(args.output, rows)


if __name__ == "__main__":
    main()
