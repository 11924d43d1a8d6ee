"""A two-"node" job on this machine (two launch/multinode.sh, c10d rendezvous over loopback) trains
exactly like the same world on one node."""

import json
import os
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
