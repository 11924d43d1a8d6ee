"""A Megatron-LM run with the distributed optimizer continues here on its own trajectory, at another dp.

megatron-core trains its Llama-class GPTModel at tp2 x dp2 (its DDP with ``--overlap-grad-reduce`` in
buckets of 3400 elements, its DistributedOptimizer, Adam, clipping, its cosine scheduler) on the
micro-batches our data pipeline reads, saves Megatron-LM's legacy files with ``distrib_optim.pt`` (its
own ``save_parameter_state``) and torch_dist with its default ``dp_reshardable`` states (each bucket's)
after iteration 4 and trains on to iteration 7; a second run in one bucket
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
from pretrain.interop.convert import main as convert
from tests.pretrain.megatron_oracle import HIDDEN, HEADS, LAYERS, SEQ, VOCAB
from tests.pretrain.megatron_training import TRAINING, resume_megatron, train_megatron
from tests.world import run_world

pytest.importorskip("megatron.core")
STOP, ITERATIONS, BUCKET = 4, 7, 3400
TOTAL = 10  # the data of every run is that of a 10-iteration one: ours exported at 7 goes on to 10


def _flags(cache: str, *extra: str) -> list[str]:
    t = TRAINING
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
            "--micro-batch-size", "1", "--global-batch-size", str(t["global_batch"]),
            "--train-iters", str(TOTAL), "--lr", str(t["lr"]), "--min-lr", str(t["min_lr"]),
            "--lr-warmup-iters", str(t["warmup_iters"]), "--lr-decay-iters", str(t["decay_iters"]),
            "--lr-decay-style", "cosine", "--weight-decay", str(t["weight_decay"]),
            "--adam-beta1", str(t["adam_beta1"]), "--adam-beta2", str(t["adam_beta2"]),
            "--adam-eps", str(t["adam_eps"]), "--clip-grad", str(t["clip_grad"]), "--sample-prompt", "",
            "--make-vocab-size-divisible-by", "16", "--data-cache-path", cache, *extra]


def _micro_batches(cache: str) -> dict[str, torch.Tensor]:
    """The micro-batches of each iteration, as our trainer reads them (one process, in sample order),
    each field stacked [iteration, micro-batch, ...] (one tensor to hand to a world, not hundreds)."""
    config = parse_config(_flags(cache, "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
                                 "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
                                 "--max-position-embeddings", str(SEQ)))
    validate(config, 1)
    samples = TOTAL * TRAINING["global_batch"]
    data = TrainingData(config, samples, 0, 0, 1)
    micro = list(data.batches(data.train, samples, 0))
    return {field: torch.stack([batch[field] for batch in micro]).unflatten(0, (TOTAL, -1))
            for field in micro[0]}


def _iterations(stacked: dict[str, torch.Tensor]) -> list[list[dict]]:
    """The micro-batches of each iteration, as megatron-core's oracle takes them."""
    micro = stacked["tokens"].shape[1]
    return [[{field: values[i, j] for field, values in stacked.items()} for j in range(micro)]
            for i in range(TOTAL)]


def _megatron_runs(rank, world_size, batches, runs, final):
    """megatron-core's run three times, each saving under its own of ``runs``: the distributed optimizer
    in buckets (legacy files; the final weights under ``final``), in one bucket (torch_dist too), and
    the plain optimizer. Returns the first's losses."""
    bucketed, one_bucket, plain = runs
    batches = _iterations(batches)[:ITERATIONS]
    losses = train_megatron(rank, world_size, "llama", 2, batches, STOP, bucketed, final, BUCKET)
    train_megatron(rank, world_size, "llama", 2, batches, STOP, one_bucket, None)
    train_megatron(rank, world_size, "llama", 2, batches, STOP, plain, None, distributed=False)
    return losses


def _megatron_resumes(rank, world_size, batches, directory):
    return resume_megatron(rank, world_size, "llama", 2, _iterations(batches), directory)


def _resumed(rank, world_size, sources, cache, saves):
    """Our run resumed at dp4 ZeRO-1 from each of ``sources`` whole to iteration 7 (saving there under
    ``saves``), the first of those on from 7 to 10, and the first source with a fresh optimizer to 7: each
    one's start and losses."""
    from pretrain.training.trainer import Trainer

    stop = ["--exit-interval", str(ITERATIONS)]
    out = []
    for load, extra in [*((source, ["--save", save, *stop]) for source, save in zip(sources, saves)),
                        (saves[0], []), (sources[0], ["--no-load-optim", *stop])]:
        config = parse_config(_flags(cache, "--load", load, "--zero-stage", "1", *extra))
        trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
        out.append((trainer.start_iteration, trainer.train().losses))
        torch.distributed.barrier()
    return out


def _edit_args(paths: list[str], **changes) -> None:
    """Megatron's saved args in each file of ``paths`` (rank files or common.pt) changed."""
    for path in paths:
        state = torch.load(path, weights_only=False)
        for name, value in changes.items():
            setattr(state["args"], name, value)
        torch.save(state, path)


@pytest.mark.parity
def test_megatron_distributed_optimizer_resumes_on_its_trajectory_at_another_dp(tmp_path, capsys):
    cache, final = str(tmp_path / "cache"), str(tmp_path / "megatron-final")
    runs = [str(tmp_path / name) for name in ("megatron", "one-bucket", "plain-optimizer")]
    batches = _micro_batches(cache)
    theirs = run_world(4, _megatron_runs, batches, runs, final, timeout_s=300)[0]
    sources = {"legacy, distributed optimizer in buckets": os.path.join(runs[0], "torch"),
               "torch_dist, fully_reshardable": os.path.join(runs[1], "torch_dist"),
               "torch_dist, dp_reshardable in buckets": os.path.join(runs[0], "torch_dist_dp"),
               "legacy, plain optimizer": os.path.join(runs[2], "torch")}
    ours = [str(tmp_path / f"ours-{number}") for number in range(len(sources))]
    *whole, (_, ours_on), (_, fresh) = run_world(4, _resumed, list(sources.values()), cache, ours,
                                                 timeout_s=300)[0]
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
    for kind, source in sources.items():  # and the listing says which states it read
        convert(["--load", source, "--list"])
        said = "distributed optimizer's fp32 masters" if "distributed" in kind or "torch_dist" in kind else (
            "plain optimizer's Adam moments")
        assert f"optimizer states: the {said}" in capsys.readouterr().out, kind
    # a fresh optimizer leaves the trajectory: the moments read are what kept it
    drift = max(abs(a - b) / b for a, b in zip(fresh[1:], theirs[STOP + 1:]))
    assert drift > 100 * TRAJECTORY_RTOL, drift

    # and back: ours at iteration 7 written as Megatron-LM's legacy files at tp2 with the distributed
    # optimizer's distrib_optim.pt; megatron-core loads it as Megatron-LM's load_checkpoint does and trains
    # on at tp2 x dp2 to iteration 10 on the trajectory ours takes from the same checkpoint
    exported = str(tmp_path / "ours-to-megatron")
    convert(["--load", ours[0], "--to", "megatron", "--ckpt-format", "torch", "--target-tensor-parallel-size",
             "2", "--with-optimizer-states", "--output", exported])
    again = run_world(4, _megatron_resumes, batches, exported, timeout_s=300)[0]
    validate(parse_config(_flags(cache, "--load", exported)), 2)  # (and its states read here again)
    assert_trajectory_close(again, ours_on, "ours exported with its optimizer: megatron-core's 8-10")

    # args that name another bucketing than the one that laid the buffer out are refused by name (a
    # resume with a fresh optimizer still takes the weights)
    other = shutil.copytree(os.path.join(megatron, "torch"), tmp_path / "other-buckets")
    folder = os.path.join(other, f"iter_{STOP:07d}")
    _edit_args([os.path.join(folder, name, "model_optim_rng.pt") for name in os.listdir(folder)],
               ddp_bucket_size=None)
    with pytest.raises(ValueError, match=r"distrib_optim\.pt: chunk 0's buffer holds 17952 elements; the "
                                         r"model its args describe lays out 17984 \(bucketing flags"):
        validate(parse_config(_flags(cache, "--load", str(other))), 4)
    validate(parse_config(_flags(cache, "--load", str(other), "--no-load-optim")), 4)
    other = shutil.copytree(os.path.join(megatron, "torch_dist_dp"), tmp_path / "other-buckets-dist")
    common = [os.path.join(other, f"iter_{STOP:07d}", "common.pt")]
    _edit_args(common, ddp_bucket_size=None)
    with pytest.raises(ValueError, match=r"tensor rank 0's dp_reshardable buckets hold 17952 elements; the "
                                         r"model its args describe lays out 17984 \(bucketing flags"):
        validate(parse_config(_flags(cache, "--load", str(other))), 4)
    # and args naming Transformer Engine's spec (another parameter order, as long): its masters show it
    _edit_args(common, ddp_bucket_size=BUCKET, transformer_impl="transformer_engine")
    with pytest.raises(ValueError, match=r"dp_reshardable fp32 masters of decoder\.layers\.self_attention\."
                                         r"linear_qkv\.layer_norm_weight are not its weights"):
        validate(parse_config(_flags(cache, "--load", str(other))), 4)
    # and the bucketed run's torch_dist, whose fully_reshardable states megatron-core misplaced: refused
    # whole, its weights (the model's own tensors) taken with a fresh optimizer
    misplaced = os.path.join(megatron, "torch_dist")
    with pytest.raises(ValueError, match=r"fully_reshardable fp32 masters of decoder\.layers\..* are not its "
                                         r"weights \(megatron-core misplaces"):
        validate(parse_config(_flags(cache, "--load", misplaced)), 4)
    validate(parse_config(_flags(cache, "--load", misplaced, "--no-load-optim")), 4)
    weights = dict(load_model(misplaced).named_parameters())
    saved = dict(load_model(os.path.join(megatron, "torch")).named_parameters())
    assert all(torch.equal(weights[name], saved[name]) for name in saved)
