"""A two-"node" job on this machine (two launch/multinode.sh, c10d rendezvous over loopback) trains
exactly like the same world on one node."""

import json
import os
import re
import socket
import subprocess
import sys
import time

from parallel.process_groups import free_port
from tests.pretrain.test_trainer import TINY, _tp

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


def test_two_nodes_over_loopback_train_like_one_node(stdlib_corpus, tmp_path):
    prefix, tokenizer = stdlib_corpus
    flags = TINY + _tp(2) + ["--data-path", prefix, "--tokenizer-model", tokenizer, "--data-cache-dir",
                             f"{prefix}-cache", "--train-iters", "4", "--log-interval", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    one_node = subprocess.run([sys.executable, "-m", "launch.torchrun", "--nproc", "4",
                               *flags, "--metrics-file",
                               str(tmp_path / "one.jsonl")], env=env, cwd=REPOSITORY,
                              capture_output=True, text=True, timeout=300)
    assert one_node.returncode == 0, one_node.stderr[-3000:]

    cluster = dict(env, NNODES="2", NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   RDZV_ID="loopback", PYTHON=sys.executable, LOG_DIR=str(tmp_path / "logs"))
    nodes = [subprocess.Popen(["bash", "launch/multinode.sh", *flags, "--metrics-file",
                               str(tmp_path / "two.jsonl")],
                              env=dict(cluster, NODE_NAME=str(node), NODE_RANK=str(node)), cwd=REPOSITORY,
                              stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for node in range(2)]
    for node in nodes:
        _, errors = node.communicate(timeout=300)
        assert node.returncode == 0, errors[-3000:]
    assert _losses(tmp_path / "two.jsonl") == _losses(tmp_path / "one.jsonl")  # bit for bit
    # nodes from the launcher's LOCAL_WORLD_SIZE: on one node nothing crosses; on two of two ranks (dp 2 x tp
    # 2) each data-parallel ring joins the nodes, every tensor-parallel ring stays inside one
    for name, crossing in (("one", False), ("two", True)):
        for entry in json.loads(open(tmp_path / f"{name}.jsonl").readline())["per_rank"]:
            inter, sent = entry["comm_bytes_inter_node"], entry["comm_bytes"]
            assert (inter["reduce_scatter"] + inter["all_reduce"] > 0) == crossing, (name, entry)
            assert sum(inter.values()) < sum(sent.values())  # the tp all-reduces never cross
    # one log per node; the node the rendezvous made first holds global rank 0, which prints the progress
    logs = [(tmp_path / "logs" / f"node-{node}.log").read_text() for node in range(2)]
    assert sum("iter      4/4" in log for log in logs) == 1


def test_a_rank_killed_on_another_node_is_named_by_host_and_rank(stdlib_corpus, tmp_path):
    """Two "nodes" (two launch/multinode.sh) of two ranks; the second node's local rank 1 is killed
    (SIGKILL) as iteration 3 begins. A survivor on the other node cannot see that process: it names it
    from the fate its node's launcher recorded in the job's store, by rank, pid, host and node; the
    collateral rank beside it, which its launcher stopped, is not blamed. The first node starts alone
    and hosts the rendezvous, as the node at MASTER_ADDR does on a cluster (a rendezvous host that ends
    takes the other nodes' agents along before their workers can speak)."""
    prefix, tokenizer = stdlib_corpus
    flags = TINY + _tp(2) + ["--data-path", prefix, "--tokenizer-model", tokenizer, "--data-cache-dir",
                             f"{prefix}-cache", "--train-iters", "6", "--distributed-timeout-s", "30",
                             "--log-interval", "1"]
    cluster = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", NNODES="2", NPROC_PER_NODE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RDZV_ID="loopback-kill",
                   PYTHON=sys.executable, LOG_DIR=str(tmp_path / "logs"),
                   ENTRY="launch.tools.faults.fault_injection",
                   DIE_RANK="local:1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5")
    nodes = []
    for node, fault in enumerate(("never:0", "iteration:3")):
        nodes.append(subprocess.Popen(["bash", "launch/multinode.sh", *flags], cwd=REPOSITORY, text=True,
                                      env=dict(cluster, NODE_NAME=str(node), NODE_RANK=str(node),
                                               DIE_AT=fault),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        while not node and not _listening(int(cluster["MASTER_PORT"])):  # the first node's rendezvous
            assert nodes[0].poll() is None, nodes[0].communicate()[0]
            time.sleep(0.2)
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode != 0 for node in nodes) and "Traceback" not in "".join(logs), logs
    # which log is which node: the one holding global rank 0 prints the progress
    first, second = logs
    assert "iter      2/6" in first, first[-3000:]  # the first node got group rank 0
    # the killed rank's own node's launcher names it, and says what comes next
    killed = re.search(r"error: rank (\d+) \(pid (\d+) on [^)]*\) was ended by SIGKILL", second)
    assert killed and "error: attempt 1 failed; the job stops" in second, second[-3000:]
    rank, pid = killed.groups()
    named = [line for line in first.splitlines() if line.startswith("error: a peer's connection closed")]
    assert len(named) == 1, first[-3000:]
    assert (f": rank {rank} (pid {pid} on {socket.gethostname()}, node 1) died (ended by SIGKILL (kill -9, "
            "or the out-of-memory killer), said its node's launcher; ") in named[0], named[0]
    assert f"rank {int(rank) ^ 1} (" not in named[0], named[0]  # its node's other rank: a consequence


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
