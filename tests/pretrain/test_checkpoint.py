"""Checkpoints: exact resume in the 3D grid for every ZeRO stage, and refusal of damaged files."""

import json
import math
import os

import pytest
import torch

from pretrain.checkpoint.catalog import CheckpointError, read_manifest
from tests.parity import assert_trajectory_close
from tests.pretrain.checkpoint_checks import assert_dcp_holds_the_native_states, assert_same_states
from tests.pretrain.test_trainer import _pp, _tp, _train
from tests.world import run_world

GRID = [*_pp(2), *_tp(2, "--sequence-parallel"), "--lr-decay-iters", "20",
        "--zero-persistence-threshold", "0"]


def _runs(stage, directory, half=3):
    """Straight to 2 * half iterations; to half, saved; loaded and on to 2 * half."""
    stage_flags = ["--zero-stage", str(stage)]
    return [GRID + stage_flags + ["--train-iters", str(2 * half)],
            GRID + stage_flags + ["--train-iters", str(half), "--save", directory],
            GRID + stage_flags + ["--train-iters", str(2 * half), "--load", directory]]


@pytest.mark.parity
def test_three_then_resume_three_equals_six_straight_for_every_stage(stdlib_corpus, tmp_path):
    """Bit for bit: a resumed run executes the straight run's kernels on the same values in the same
    order, so no rounding can differ. Three iterations on each side cross warm-up (two) and decay. In
    memory the straight run saves at iteration 3 as it goes and a new run resumes that checkpoint (a run
    stopped at 3 would have saved the same states: ``_runs``' first half, which the swap-file and
    background saves below run)."""
    layouts = []
    for stage in (0, 1, 2, 3):
        straight, _, resumed = _runs(stage, str(tmp_path / f"stage{stage}"))
        layouts += [straight + ["--save", str(tmp_path / f"stage{stage}"), "--save-interval", "3"],
                    resumed + ["--ckpt-step", "3"]]
    (tmp_path / "swap").mkdir()
    nvme = ["--offload-optimizer", "nvme", "--nvme-path",
            str(tmp_path / "swap")]  # the default cut, as in memory
    for stage in (2, 3):  # optimizer states (stage 3: and parameter shards) in swap files: saved from them,
        infinity = ["--offload-param", "nvme"] if stage == 3 else []  # loaded back into them
        layouts += [run + nvme + infinity for run in _runs(stage, str(tmp_path / f"nvme{stage}"))[1:]]
    for stage in (1, 3):  # saved in the background (at 2 while 3 trains, then at 3), resumed
        first, resumed = _runs(stage, str(tmp_path / f"async{stage}"))[1:]
        layouts += [first + ["--async-save", "--save-interval", "2"], resumed]
    for rank_results in run_world(8, _train, layouts, stdlib_corpus, timeout_s=600):
        for stage in range(4):
            straight, resumed = rank_results[2 * stage:2 * stage + 2]
            assert resumed[0] == straight[0][3:], stage  # bit for bit: the same floats
            assert resumed[1] == straight[1][3:], stage
        for index, stage in enumerate((2, 3)):
            straight, (first, resumed) = rank_results[2 * stage], rank_results[8 + 2 * index:10 + 2 * index]
            assert first[0] + resumed[0] == straight[0], ("nvme", stage)  # as in memory, bit for bit
        for index, stage in enumerate((1, 3)):  # the asynchronous save: the synchronous trajectory
            straight, (first, resumed) = rank_results[2 * stage], rank_results[12 + 2 * index:14 + 2 * index]
            assert first[0] + resumed[0] == straight[0] and resumed[1] == straight[1][3:], ("async", stage)
    assert os.listdir(tmp_path / "swap") == []  # swap files are scratch, removed at the end
    checkpoint, manifest = read_manifest(str(tmp_path / "stage3"), 3)
    assert manifest["iteration"] == 3 and manifest["states"]["progress"]["consumed_samples"] == 24
    assert manifest["layout"] == {"world_size": 8, "tp": 2, "pp": 2, "dp": 2, "zero_stage": 3}
    assert sorted(manifest["files"]) == [f"rank_{r:05d}.pt" for r in range(8)]
    for stage in (1, 3):  # the synchronous save's states, bit for bit (torch.save stamps each file with
        background, foreground = (read_manifest(str(tmp_path / name), 3)  # an id of its own: not the bytes)
                                  for name in (f"async{stage}", f"stage{stage}"))
        assert background[1]["files"].keys() == foreground[1]["files"].keys()
        for entry in foreground[1]["files"]:
            assert_same_states(*(torch.load(os.path.join(path, entry), weights_only=True)
                            for path in (background[0], foreground[0])), entry)
        assert sorted(os.listdir(tmp_path / f"async{stage}")) == ["iter_0000002", "iter_0000003", "latest"]


@pytest.mark.parity
def test_a_checkpoint_resumes_in_other_layouts_and_stages(stdlib_corpus, tmp_path):
    """Saved at tp2 x dp2 with ZeRO-2, resumed at pp2 x dp2 with ZeRO-3 (optimizer and parameters on
    NVMe), at dp4 with ZeRO-1, at pp2 (interleaved, v = 2) x tp2 with ZeRO-0, at dp4 with ZeRO-3 in shard
    groups of 2, and in its own layout with other buckets and master pieces; saved at pp2 x tp2 and
    resumed with v = 2 (the same sizes); saved at dp4 in shard groups of 2 and resumed at plain ZeRO-3:
    each continues the original run's trajectory. And saved as a PyTorch Distributed Checkpoint
    (--ckpt-format torch_dcp) by the original run, resumed at pp2 x dp2 ZeRO-3 too."""
    saved = str(tmp_path / "tp2dp2")
    original = [*_tp(2), "--zero-stage", "2", "--lr-decay-iters", "20"]
    (tmp_path / "swap").mkdir()
    infinity = ["--offload-optimizer", "nvme", "--offload-param", "nvme", "--nvme-path",
                str(tmp_path / "swap"),
                "--zero-sub-group-size", "5000"]  # the re-cut states go into swap files
    others = [[*_pp(2), "--zero-stage", "3", "--zero-persistence-threshold", "0", *infinity],
              ["--zero-stage", "1"],
              [*_pp(2, "interleaved", "--virtual-pipeline-size", "2"), *_tp(2)],
              # the same layout cut into other buckets and master pieces: re-cut, not refused
              [*original, "--zero-bucket-size", "3000", "--zero-sub-group-size", "700"]]
    # the straight run saves as a PyTorch Distributed Checkpoint at 10 (and 20); resumed at pp2 ZeRO-3
    dcp = str(tmp_path / "dcp")
    layouts = [original + ["--train-iters", "20", "--save", dcp, "--save-interval", "10", "--ckpt-format",
                           "torch_dcp"],
               original + ["--train-iters", "10", "--save", saved]]
    layouts += [other + ["--lr-decay-iters", "20", "--train-iters", "20", "--load", saved]
                for other in others]
    # the same sizes and stage, only the virtual stages change: other layers sit on each rank, re-cut too
    pipeline, interleaved = str(tmp_path / "pp2tp2"), [*_pp(2, "interleaved", "--virtual-pipeline-size", "2")]
    layouts += [[*_pp(2), *_tp(2), "--lr-decay-iters", "20", "--train-iters", "10", "--save", pipeline],
                [*interleaved, *_tp(2), "--lr-decay-iters", "20", "--train-iters", "20", "--load", pipeline]]
    # MiCS / HSDP at dp 4: shard groups of 2 resume the ZeRO-2 checkpoint; one saved with shard groups
    # resumes at plain ZeRO-3
    mics, shard_groups = str(tmp_path / "mics"), ["--zero-stage", "3", "--zero-persistence-threshold", "0"]
    layouts += [[*shard_groups, "--zero-shard-size", "2", "--lr-decay-iters", "20", "--train-iters", "20",
                 "--load", saved],
                [*shard_groups, "--zero-shard-size", "2", "--lr-decay-iters", "20", "--train-iters", "10",
                 "--save", mics],
                [*shard_groups, "--lr-decay-iters", "20", "--train-iters", "20", "--load", mics],
                [*_pp(2), "--zero-stage", "3", "--zero-persistence-threshold", "0", "--lr-decay-iters", "20",
                 "--train-iters", "20", "--load", dcp, "--ckpt-step", "10"]]
    for rank_results in run_world(4, _train, layouts, stdlib_corpus, timeout_s=600):
        straight = rank_results[0]
        for resumed in rank_results[2:6] + rank_results[7:9] + rank_results[10:]:  # another summation order
            assert_trajectory_close(resumed[0], straight[0][10:], "re-cut: loss")
            assert_trajectory_close(resumed[1], straight[1][10:], "re-cut: grad norm")
        assert_trajectory_close(rank_results[9][0], straight[0][:10], "shard groups: loss")
    assert_dcp_holds_the_native_states(os.path.join(dcp, "iter_0000010"), saved, tmp_path)


def _load_only(rank, world_size, directory, corpus):
    from pretrain.config.arguments import ConfigError, parse_config
    from pretrain.training.trainer import Trainer
    from pretrain.startup.validation import validate
    from tests.pretrain.test_trainer import TINY

    prefix, tokenizer = corpus
    config = parse_config(TINY + ["--data-path", prefix, "--tokenizer-model", tokenizer, "--data-cache-dir",
                                  f"{prefix}-cache", "--load", directory])
    try:  # a manifest is read at validation (the architecture it records), the shards when the trainer loads
        Trainer(config, validate(config, world_size), torch.device("cpu"))
    except (CheckpointError, ConfigError) as error:
        return str(error)
    return "loaded"


def test_damaged_checkpoints_are_refused_naming_the_file(stdlib_corpus, tmp_path):
    directory = str(tmp_path / "ckpt")
    run_world(1, _train, [["--train-iters", "2", "--lr-decay-iters", "10", "--save", directory,
                           "--save-interval", "1"]], stdlib_corpus)  # loaded by a run of 10
    checkpoint, manifest = read_manifest(directory)
    shard = os.path.join(checkpoint, "rank_00000.pt")
    assert run_world(1, _load_only, directory, stdlib_corpus) == ["loaded"]
    original = open(shard, "rb").read()

    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(damaged))
    message, = run_world(1, _load_only, directory, stdlib_corpus)  # found as its piece is read
    assert "rank_00000.pt: piece" in message and "differs from its sha256 in the manifest" in message

    open(shard, "wb").write(original[:100])
    assert "differs from the manifest" in run_world(1, _load_only, directory, stdlib_corpus)[0]

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    torch.save({"evil": Evil()}, shard)
    manifest_path = os.path.join(checkpoint, "manifest.json")
    forged = json.load(open(manifest_path))
    import hashlib
    forged["files"]["rank_00000.pt"] = {"bytes": os.path.getsize(shard),
                                        "sha256": hashlib.sha256(open(shard, "rb").read()).hexdigest()}
    json.dump(forged, open(manifest_path, "w"))
    assert "refused by torch.load(weights_only=True)" in run_world(1, _load_only, directory, stdlib_corpus)[0]

    older = {key: value for key,
             value in forged.items() if key != "format"}  # a rank-file format 1 checkpoint
    json.dump(older, open(manifest_path, "w"))
    assert "rank files are in format 1 and this version reads formats 2, 3 and 4" in \
        run_world(1, _load_only, directory, stdlib_corpus)[0]

    open(manifest_path, "w").write("{not json")
    message = run_world(1, _load_only, directory, stdlib_corpus)[0]
    assert "unreadable manifest" in message and message.endswith(
        f"the newest intact checkpoint is {directory}/iter_0000001: resume from it with --ckpt-step 1")


def test_an_unfinished_save_never_becomes_latest(stdlib_corpus, tmp_path):
    directory = str(tmp_path / "ckpt")
    run_world(1, _train, [["--train-iters", "2", "--lr-decay-iters", "10", "--save", directory]],
              stdlib_corpus)
    os.makedirs(os.path.join(directory, "iter_0000004.tmp"))  # a save that died half-way
    open(os.path.join(directory, "iter_0000004.tmp", "rank_00000.pt"), "wb").write(b"partial")
    checkpoint, manifest = read_manifest(directory)
    assert checkpoint.endswith("iter_0000002") and manifest["iteration"] == 2
    assert run_world(1, _load_only, directory, stdlib_corpus) == ["loaded"]


def _train_saved_as_format_3(rank, world_size, flags, corpus, directory):
    """Train with ``flags`` (saving into ``directory`` at the end), then rewrite the checkpoint as format
    3 wrote it: each rank file's model state its ZeroOptimizer.state_dict() with every master range
    named (every replica's copy), the files' sizes and sha256 in the manifest."""
    import torch.distributed as dist

    from data.file_digest import files_sha256
    from parallel.param_meta import meta
    from pretrain.config.arguments import parse_config
    from pretrain.startup.validation import validate
    from pretrain.training.trainer import Trainer
    from tests.pretrain.test_trainer import TINY

    prefix, tokenizer = corpus
    config = parse_config(TINY + ["--data-path", prefix, "--tokenizer-model", tokenizer,
                                  "--data-cache-dir", f"{prefix}-cache"] + flags)
    trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
    trainer.train()
    optimizer, names, groups = trainer.optimizer, trainer.parameter_names, trainer.groups
    pieces = [{"name": names[piece.param], "master": piece.master, "state": piece.state, "start": piece.start,
               "offset": piece.offset, "length": piece.length, "shape": list(piece.shape),
               "tp_dim": meta(piece.param).partition_dim, "tp_rank": groups.tp_rank,
               "tp_size": groups.topology.tp, "rows": meta(piece.param).unpadded_rows}
              for piece in optimizer.master_pieces()]
    checkpoint, _ = read_manifest(directory)
    path = os.path.join(checkpoint, f"rank_{rank:05d}.pt")
    states = torch.load(path, weights_only=True)["states"]
    torch.save({"states": {**states, "model": {"pieces": pieces, "optimizer": optimizer.state_dict()}}}, path)
    dist.barrier()
    if rank == 0:
        manifest_path = os.path.join(checkpoint, "manifest.json")
        manifest = json.load(open(manifest_path))
        manifest["format"] = 3
        manifest["files"] = {entry: {"bytes": os.path.getsize(os.path.join(checkpoint, entry)),
                                     "sha256": files_sha256(os.path.join(checkpoint, entry))}
                             for entry in manifest["files"]}
        json.dump(manifest, open(manifest_path, "w"))
    dist.barrier()


def _as_format_2(checkpoint: str) -> None:
    """Rewrite a format-3 checkpoint as the release before wrote it: rank files {pieces, optimizer, rng}
    and the data position at the manifest's top level."""
    from data.file_digest import files_sha256

    manifest_path = os.path.join(checkpoint, "manifest.json")
    manifest = json.load(open(manifest_path))
    for entry in manifest["files"]:
        path = os.path.join(checkpoint, entry)
        states = torch.load(path, weights_only=True)["states"]
        torch.save({**states["model"], "rng": states["rng"]}, path)
        manifest["files"][entry] = {"bytes": os.path.getsize(path), "sha256": files_sha256(path)}
    manifest.update(manifest.pop("states")["progress"], format=2)
    json.dump(manifest, open(manifest_path, "w"))


def test_checkpoints_of_the_previous_formats_resume_exactly(stdlib_corpus, tmp_path):
    """A format-3 checkpoint (every replica's master ranges in each rank file) saved at dp2 x pp2 ZeRO-2
    resumes bit for bit in its layout (the same losses and gradient norms as the straight run); the same
    checkpoint as format 2 wrote it (before the rank files held named states) is re-cut to dp4."""
    import shutil

    flags = [*_pp(2), "--zero-stage", "2", "--lr-decay-iters", "20"]
    format3, format2 = str(tmp_path / "format3"), str(tmp_path / "format2")
    run_world(4, _train_saved_as_format_3, flags + ["--train-iters", "3", "--save", format3], stdlib_corpus,
              format3)
    shutil.copytree(format3, format2)
    _as_format_2(read_manifest(format2)[0])
    assert [read_manifest(path)[1]["format"] for path in (format3, format2)] == [3, 2]
    dp4 = ["--zero-stage", "1", "--lr-decay-iters", "20", "--train-iters", "6", "--load", format2]
    results = run_world(4, _train, [flags + ["--train-iters", "6"],
                                    flags + ["--train-iters", "6", "--load", format3], dp4], stdlib_corpus)
    losses = next(rank[0][0] for rank in results if rank[0][0])  # the last stage's
    for straight, same, recut in results:
        assert same[0] == straight[0][3:] and same[1] == straight[1][3:]
        assert_trajectory_close(recut[0], losses[3:], "format 2 re-cut to dp4: loss")


def test_fine_tuning_flags_load_weights_only_or_keep_the_position(stdlib_corpus, tmp_path):
    """--finetune and --pretrained-checkpoint start at iteration 0 from the saved weights with a fresh
    optimizer; --no-load-optim keeps the position; --load of an empty directory falls back to
    --pretrained-checkpoint (a fine-tune that restarts itself)."""
    saved = str(tmp_path / "saved")
    layouts = [["--train-iters", "4", "--save", saved],
               ["--train-iters", "3", "--load", saved, "--finetune"],
               ["--train-iters", "3", "--load", str(tmp_path / "empty"), "--pretrained-checkpoint", saved],
               ["--train-iters", "6", "--load", saved, "--no-load-optim", "--no-load-rng"],
               ["--train-iters", "6", "--load", saved, "--override-opt_param-scheduler"],
               ["--train-iters", "3"]]
    (pretrained, finetuned, fallback, kept, resumed, fresh), = run_world(1, _train, layouts, stdlib_corpus)
    assert len(finetuned[0]) == len(fallback[0]) == 3 and finetuned[0] == fallback[0]
    assert finetuned[0][0] < fresh[0][0] - 0.1  # the trained weights, on the run's first batch again
    assert len(kept[0]) == 2  # iterations 5 and 6
    # the same weights and batch at iteration 5; then Adam's fresh moments take another step than the saved
    assert kept[1][0] == resumed[1][0] and kept[0][1] != resumed[0][1]


def test_a_shape_flag_that_contradicts_the_checkpoint_is_refused(stdlib_corpus, tmp_path):
    from pretrain.config.arguments import ConfigError, parse_config
    from pretrain.startup.validation import validate
    from tests.pretrain.test_trainer import TINY

    saved = str(tmp_path / "saved")
    run_world(1, _train, [["--train-iters", "1", "--save", saved]], stdlib_corpus)
    prefix, tokenizer = stdlib_corpus
    config = parse_config(TINY + ["--data-path", prefix, "--tokenizer-model", tokenizer, "--load", saved,
                                  "--hidden-size", "128"])
    with pytest.raises(ConfigError,
                       match=f"--hidden-size 128 contradicts the checkpoint {saved}/iter_0000001, "
                                          "whose model has 64"):
        validate(config, 1)
    inherited = parse_config(["--data-path", prefix, "--tokenizer-model", tokenizer, "--load", saved,
                              "--use-checkpoint-opt_param-scheduler"])  # its rates, not the defaults
    validate(inherited, 1)
    assert (inherited.model.hidden_size, inherited.model.num_layers) == (64, 4)  # no shape flags needed


def _resumed_schedules(rank, world_size, cache, directory):
    """A run on the built-in corpus (vocabulary 512), saved at 4 of 8 iterations, resumed as a user would:
    without repeating its corpus flag, with another --lr (refused, then taken from the checkpoint or from
    the flags as Megatron's two flags say). Returns each run's (losses, learning rates) and the refusals."""
    from pretrain.config.arguments import ConfigError, parse_config
    from pretrain.startup.validation import validate
    from pretrain.training.trainer import Trainer
    from tests.pretrain.test_trainer import TINY

    builtin = TINY + ["--default-corpus-max-bytes", "400000", "--data-cache-dir", cache, "--lr-decay-iters",
                      "10", "--log-interval", "1"]
    made = ["--default-corpus-vocab-size", "512"]

    def run(flags, name):
        metrics = f"{directory}-{name}.jsonl"
        config = parse_config(builtin + flags + ["--metrics-file", metrics])
        result = Trainer(config, validate(config, world_size), torch.device("cpu")).train()
        return result.losses, [json.loads(line)["lr"] for line in open(metrics)]

    def refusal(flags):
        try:
            validate(parse_config(builtin + flags), world_size)
        except ConfigError as error:
            return str(error)
        return None

    runs = {"straight": run(made + ["--train-iters", "8"], "straight"),
            "saved": run(made + ["--train-iters", "4", "--save", directory], "saved")}
    resume = ["--train-iters", "8", "--load", directory]
    refusals = [refusal(resume + ["--lr", "1e-2"]), refusal(resume + ["--default-corpus-vocab-size", "4096"]),
                refusal(resume + ["--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"])]
    runs["resumed"] = run(resume, "resumed")  # the corpus flag left out: the checkpoint's vocabulary
    runs["checkpoint's"] = run(resume + ["--lr", "1e-2", "--use-checkpoint-opt_param-scheduler"], "kept")
    runs["flags'"] = run(resume + ["--lr", "1e-2", "--override-opt_param-scheduler"], "overridden")
    return runs, refusals


def test_a_resume_takes_the_checkpoints_schedule_and_corpus_or_names_what_differs(stdlib_corpus, tmp_path):
    """Megatron's scheduler check: a resumed run whose learning-rate schedule differs from the checkpoint's
    is refused naming the flag and both values, unless --use-checkpoint-opt_param-scheduler (the straight
    run's rates and losses, bit for bit) or --override-opt_param-scheduler (the flags' rates) says which to
    take; a built-in-corpus checkpoint resumes without repeating --default-corpus-vocab-size, and a
    vocabulary it cannot read names the flag it was made with."""
    cache = os.path.dirname(os.path.dirname(stdlib_corpus[0]))  # the fixture's corpus, built once
    (runs, refusals), = run_world(1, _resumed_schedules, cache, str(tmp_path / "ckpt"))
    straight_losses, straight_rates = runs["straight"]
    assert runs["saved"][0] == straight_losses[:4]
    for name in ("resumed", "checkpoint's"):
        assert runs[name] == (straight_losses[4:], straight_rates[4:]), name  # bit for bit
    assert refusals[0].startswith(f"the learning-rate schedule differs from the checkpoint's under --load "
                                  f"{tmp_path / 'ckpt'}: --lr: 0.01 (the checkpoint's: 0.003); add "
                                  "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule, "
                                  "or --override-opt_param-scheduler to take these flags'")
    assert refusals[1].endswith("it was made with the built-in corpus with --default-corpus-vocab-size 512: "
                                "give that again")
    assert "choose opposite schedules: give one" in refusals[2]
    # the flags' cosine from 1e-2 over the same warm-up (2 iterations) and decay (10) of batches of 8
    progress = [(8 * step - 16) / (80 - 16) for step in range(4, 8)]
    want = [3e-4 + (1e-2 - 3e-4) * 0.5 * (1 + math.cos(math.pi * p)) for p in progress]
    assert runs["flags'"][1] == pytest.approx(want, rel=1e-9) and runs["flags'"][0] != straight_losses[4:]
