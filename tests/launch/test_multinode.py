"""A two-"node" job on this machine (two launch/multinode.sh, c10d rendezvous over loopback) trains
exactly like the same world on one node."""

import json
import os
import socket
import subprocess
import sys

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
                              env=dict(cluster, NODE_NAME=str(node)), cwd=REPOSITORY,
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
    """Two "nodes" (two launch/multinode.sh) of two ranks; global rank 3 is killed (SIGKILL) as iteration
    3 begins. A survivor on the other node cannot see that process: it names it from the fate its node's
    launcher recorded in the job's store, by rank, pid, host and node; the collateral rank 2, which its
    launcher stopped, is not blamed."""
    prefix, tokenizer = stdlib_corpus
    flags = TINY + _tp(2) + ["--data-path", prefix, "--tokenizer-model", tokenizer, "--data-cache-dir",
                             f"{prefix}-cache", "--train-iters", "6", "--distributed-timeout-s", "30",
                             "--log-interval", "1"]
    cluster = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", NNODES="2", NPROC_PER_NODE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RDZV_ID="loopback-kill",
                   PYTHON=sys.executable, LOG_DIR=str(tmp_path / "logs"),
                   ENTRY="launch.tools.fault_injection",
                   DIE_RANK="3", DIE_AT="iteration:3", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5")
    nodes = [subprocess.Popen(["bash", "launch/multinode.sh", *flags], env=dict(cluster, NODE_NAME=str(node)),
                              cwd=REPOSITORY, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in range(2)]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode != 0 for node in nodes) and "Traceback" not in "".join(logs), logs
    # which log is which node: the one holding global rank 0 prints the progress
    first, second = logs if "iter      2/6" in logs[0] else logs[::-1]
    named = [line for line in first.splitlines() if line.startswith("error: a peer's connection closed")]
    assert len(named) == 1, first[-3000:]
    host = socket.gethostname()
    assert ": rank 3 (pid " in named[0] and (f" on {host}, node 1) died (ended by SIGKILL (kill -9, or the "
                                              "out-of-memory killer), said its node's launcher; ") in named[0]
    assert "rank 2 (" not in named[0], named[0]
    # rank 3's own node's launcher says it too, and what comes next
    assert ") was ended by SIGKILL" in second and "error: attempt 1 failed; the job stops" in second
