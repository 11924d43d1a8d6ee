"""What crosses a link, beside what ``parallel.comm`` counts: each collective of a ZeRO step run by four
ranks on two emulated nodes of two (``launch.bench.netns_link``), node 0's end of the link read before
and after it.

    sudo python -m launch.bench.wire_bytes [--mib 8] [--rate 10gbit]

Per operation, over the world's data-parallel group of 4 (and point-to-point to the other node): the
frames node 0 sent (its veth statistics), their TCP payload (the frame bytes less ``HEADER`` bytes a
frame: Ethernet 14, IPv4 20, TCP 20 and its 12 bytes of timestamp options; an ack-only frame is all
header), and the bytes node 0's ranks counted as crossing (``CommStats``' inter-node counts). What the
payload holds beyond the count is gloo's own framing of its messages; the two barriers inside each
reading (every rank waits while the counters are read) are measured alone first and taken off.
``measure`` is what ``launch.bench.slow_link`` and the tests call.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from launch.help_text import help_description

HEADER = 14 + 20 + 20 + 12
RANKS, PER_NODE = 4, 2


def _operations(groups, numel: int) -> dict:
    """name -> a callable running that collective of ``numel`` fp32 elements (per rank) and waiting it."""
    import torch

    from parallel import comm
    from parallel.quantization import quantized_all_gather, quantized_reduce_scatter_add

    dp, n, rank = groups.dp, groups.dp.size, groups.rank
    values = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    other = (rank + PER_NODE) % RANKS

    def exchange():
        received = torch.empty_like(values)
        for handle in comm.batch_isend_irecv([(values, other, 0)], [(received, other, 0)], groups.world):
            handle.wait()

    return {
        "barrier": lambda: None,
        "all_reduce": lambda: comm.all_reduce(values.clone(), dp),
        "reduce_scatter": lambda: comm.reduce_scatter_tensor(torch.empty(numel // n), values, dp),
        "all_gather": lambda: comm.all_gather_into_tensor(torch.empty(numel), values[:numel // n], dp),
        "all_to_all": lambda: comm.all_to_all_single(torch.empty(numel), values, dp),
        "broadcast": lambda: comm.broadcast(values.clone(), 0, dp),
        "p2p": exchange,
        "all_gather (qwZ)": lambda: quantized_all_gather(torch.empty(numel), values[:numel // n], dp),
        "all_to_all (qgZ)": lambda: quantized_reduce_scatter_add(torch.zeros(numel // n), values, [dp]),
    }


def _worker(directory: str, numel: int) -> None:
    from launch.bench.netns_link import link_sent
    from launch.bench.world import write_result
    from parallel import comm
    from parallel.process_groups import create_process_groups, init_distributed, shutdown_distributed
    from parallel.topology import Topology

    init_distributed()
    groups = create_process_groups(Topology(RANKS, gpus_per_node=PER_NODE))
    interface = os.environ["GLOO_SOCKET_IFNAME"]
    results = {}
    for name, run in _operations(groups, numel).items():
        run()  # once to open its connections (gloo connects lazily), then measured
        comm.barrier(groups.world)
        groups.stats.reset()
        before = link_sent(interface)
        comm.barrier(groups.world)  # no rank starts before the counters are read, nor goes on before
        run()
        comm.barrier(groups.world)
        after = link_sent(interface)
        comm.barrier(groups.world)
        results[name] = {"bytes": after[0] - before[0], "frames": after[1] - before[1],
                         "counted": sum(groups.stats.inter_node_bytes_by_operation().values())}
    write_result(directory, groups.rank, results)
    shutdown_distributed()


def measure(nodes, numel: int) -> list[dict]:
    """Run every operation on ``nodes`` (a ``TwoNodes``): per operation, node 0's frame bytes, frames,
    payload and counted bytes, the barriers' share taken off."""
    from launch.bench.world import read_results
    from parallel.process_groups import free_port

    with tempfile.TemporaryDirectory() as directory:
        nodes.run_ranks([sys.executable, "-m", "launch.bench.wire_bytes", "--worker-output", directory,
                         "--numel", str(numel)], RANKS, PER_NODE, free_port(), directory)
        ranks = read_results(directory, RANKS)
    # the link counters are the node's: read by each of its ranks alike; the counts are each rank's own
    node0 = ranks[0]
    barrier = node0["barrier"]
    rows = []
    for name in node0:
        if name == "barrier":
            continue
        frames = node0[name]["bytes"] - barrier["bytes"]
        packets = node0[name]["frames"] - barrier["frames"]
        counted = sum(ranks[rank][name]["counted"] for rank in range(PER_NODE))
        rows.append({"operation": name, "frame_bytes": frames, "frames": packets,
                     "payload": payload(frames, packets), "counted": counted})
    return rows


def payload(frame_bytes: int, frames: int) -> int:
    """The TCP payload of ``frames`` frames of ``frame_bytes`` bytes in all."""
    return frame_bytes - HEADER * frames


def table(rows: list[dict]) -> list[str]:
    lines = ["| operation | counted KiB leaving node 0 | on the wire: frames KiB (frames) | payload KiB | "
             "payload / counted |", "|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row['payload'] / row['counted']:.4f}" if row["counted"] else "-"
        lines.append(f"| {row['operation']} | {row['counted'] / 1024:.1f} | {row['frame_bytes'] / 1024:.1f} "
                     f"({row['frames']}) | {row['payload'] / 1024:.1f} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.wire_bytes",
                                     description=help_description(__doc__))
    parser.add_argument("--mib", type=float, default=8.0, help="fp32 MiB each rank's operation holds")
    parser.add_argument("--rate", default="10gbit", help="tc rate of the link")
    parser.add_argument("--output", default="runs/bench/wire_bytes.md")
    parser.add_argument("--worker-output", help="internal: run as one rank, results here")
    parser.add_argument("--numel", type=int, help="internal: elements per operation")
    args = parser.parse_args(argv)
    if args.worker_output:
        _worker(args.worker_output, args.numel)
        return
    from launch.bench.netns_link import LinkSetupError, TwoNodes
    from launch.bench.world import write_table

    numel = int(args.mib * 2**20 / 4) // (RANKS * 256) * RANKS * 256
    try:
        with TwoNodes(args.rate) as nodes:
            rows = measure(nodes, numel)
    except LinkSetupError as error:
        sys.exit(f"error: {error}")
    lines = [f"{numel * 4 / 2**20:.1f} MiB fp32 per rank and operation, dp 4 as two nodes of 2 joined by a "
             f"veth pair at {args.rate}; frames = node 0's veth tx statistics, payload = frames less "
             f"{HEADER} header bytes each", ""] + table(rows)
    write_table(args.output, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
