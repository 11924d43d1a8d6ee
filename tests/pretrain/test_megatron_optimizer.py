"""A Megatron-LM run with the distributed optimizer continues here on its own trajectory, at another dp.

megatron-core trains its Llama-class GPTModel at tp2 x dp2 (its DDP with ``--overlap-grad-reduce`` in
buckets of 3400 elements, its DistributedOptimizer, Adam, clipping, its cosine scheduler) on the
micro-batches our data pipeline reads, saves Megatron-LM's legacy files with ``distrib_optim.pt`` (its
own ``save_parameter_state``) after iteration 4 and trains on to iteration 7; a second run in one bucket
saves torch_dist with the distributed optimizer's ``fully_reshardable`` states (megatron-core 0.16.1
misplaces those when buckets are cut), a third with the plain optimizer its legacy files (Adam's states in
torch's state dict). Resumed here at dp4 x tp1 ZeRO-1 from iteration 4, from any of them,
our losses of iterations 5-7 and final weights are megatron-core's within the bound of our own resumes in
another layout; with a fresh optimizer (--no-load-optim) they are not. The bucket size makes the buffer's
layout differ from one bucket's, so a reader that ignored the bucketing flags would read the moments at
the wrong places; args that name other flags are refused by name.
"""

import os
import shutil

import pytest
import torch

from pretrain import load_model
from pretrain.config.arguments import parse_config
from pretrain.startup.validation import validate
from pretrain.training.training_data import TrainingData
from tests.parity import TRAJECTORY_RTOL, assert_tensors_close, assert_trajectory_close
from tests.pretrain.megatron_oracle import HIDDEN, HEADS, LAYERS, SEQ, TRAINING, VOCAB, train_megatron
from tests.world import run_world

pytest.importorskip("megatron.core")
STOP, ITERATIONS, BUCKET = 4, 7, 3400


def _flags(cache: str, *extra: str) -> list[str]:
    t = TRAINING
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
            "--micro-batch-size", "1", "--global-batch-size", str(t["global_batch"]),
            "--train-iters", str(ITERATIONS), "--lr", str(t["lr"]), "--min-lr", str(t["min_lr"]),
            "--lr-warmup-iters", str(t["warmup_iters"]), "--lr-decay-iters", str(t["decay_iters"]),
            "--lr-decay-style", "cosine", "--weight-decay", str(t["weight_decay"]),
            "--adam-beta1", str(t["adam_beta1"]), "--adam-beta2", str(t["adam_beta2"]),
            "--adam-eps", str(t["adam_eps"]), "--clip-grad", str(t["clip_grad"]), "--sample-prompt", "",
            "--data-cache-path", cache, *extra]


def _micro_batches(cache: str) -> list[list[dict]]:
    """The micro-batches of each iteration, as our trainer reads them (one process, in sample order)."""
    config = parse_config(_flags(cache, "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
                                 "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
                                 "--max-position-embeddings", str(SEQ)))
    validate(config, 1)
    samples = ITERATIONS * TRAINING["global_batch"]
    data = TrainingData(config, samples, 0, 0, 1)
    micro = list(data.batches(data.train, samples, 0))
    return [micro[i:i + TRAINING["global_batch"]] for i in range(0, samples, TRAINING["global_batch"])]


def _megatron_runs(rank, world_size, batches, runs, final):
    """megatron-core's run three times, each saving under its own of ``runs``: the distributed optimizer
    in buckets (legacy files; the final weights under ``final``), in one bucket (torch_dist too), and
    the plain optimizer. Returns the first's losses."""
    bucketed, one_bucket, plain = runs
    losses = train_megatron(rank, world_size, "llama", 2, batches, STOP, bucketed, final, BUCKET)
    train_megatron(rank, world_size, "llama", 2, batches, STOP, one_bucket, None)
    train_megatron(rank, world_size, "llama", 2, batches, STOP, plain, None, distributed=False)
    return losses


def _resumed(rank, world_size, sources, cache, saves):
    """Our run resumed at dp4 ZeRO-1 from each of ``sources`` whole (saving under ``saves``), and from the
    first with a fresh optimizer: each one's start and losses."""
    from pretrain.training.trainer import Trainer

    out = []
    for load, extra in [*((source, ["--save", save]) for source, save in zip(sources, saves)),
                        (sources[0], ["--no-load-optim"])]:
        config = parse_config(_flags(cache, "--load", load, "--zero-stage", "1", "--save-interval",
                                     str(ITERATIONS), *extra))
        trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
        out.append((trainer.start_iteration, trainer.train().losses))
        torch.distributed.barrier()
    return out


@pytest.mark.parity
def test_megatron_distributed_optimizer_resumes_on_its_trajectory_at_another_dp(tmp_path):
    cache, final = str(tmp_path / "cache"), str(tmp_path / "megatron-final")
    runs = [str(tmp_path / name) for name in ("megatron", "one-bucket", "plain-optimizer")]
    theirs = run_world(4, _megatron_runs, _micro_batches(cache), runs, final, timeout_s=300)[0]
    sources = {"legacy, distributed optimizer in buckets": os.path.join(runs[0], "torch"),
               "torch_dist, fully_reshardable": os.path.join(runs[1], "torch_dist"),
               "legacy, plain optimizer": os.path.join(runs[2], "torch")}
    ours = [str(tmp_path / f"ours-{number}") for number in range(len(sources))]
    *whole, (_, fresh) = run_world(4, _resumed, list(sources.values()), cache, ours, timeout_s=300)[0]
    megatron = runs[0]
    want = dict(load_model(os.path.join(final, "torch")).named_parameters())
    names = sorted(want)
    for kind, (start, losses), saved in zip(sources, whole, ours):
        assert start == STOP
        assert_trajectory_close(losses, theirs[STOP:], f"Megatron's run ({kind}) resumed here at dp4: losses")
        got = dict(load_model(saved).named_parameters())
        assert_tensors_close([got[name][:want[name].shape[0]] for name in names],
                             [want[name] for name in names],
                             f"Megatron's run ({kind}) resumed here at dp4: weights after iteration 7")
    # a fresh optimizer leaves the trajectory: the moments read are what kept it
    drift = max(abs(a - b) / b for a, b in zip(fresh[1:], theirs[STOP + 1:]))
    assert drift > 100 * TRAJECTORY_RTOL, drift

    # args that name another bucketing than the one that laid the buffer out are refused by name (a
    # resume with a fresh optimizer still takes the weights)
    other = shutil.copytree(os.path.join(megatron, "torch"), tmp_path / "other-buckets")
    folder = os.path.join(other, f"iter_{STOP:07d}")
    for rank_folder in sorted(os.listdir(folder)):
        path = os.path.join(folder, rank_folder, "model_optim_rng.pt")
        state = torch.load(path, weights_only=False)
        state["args"].ddp_bucket_size = None
        torch.save(state, path)
    with pytest.raises(ValueError, match=r"distrib_optim\.pt: chunk 0's buffer holds 17952 elements; the "
                                         r"model its args describe lays out 17984 \(bucketing flags"):
        validate(parse_config(_flags(cache, "--load", str(other))), 4)
    validate(parse_config(_flags(cache, "--load", str(other), "--no-load-optim")), 4)
