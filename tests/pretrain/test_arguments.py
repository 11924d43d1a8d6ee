"""Config from flags and YAML, and the errors bad input gets before any process group exists."""

import os
import subprocess
import sys

import pytest

from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32"]


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("hidden_size: 128\nlr: 1.0e-3\ndata_path: [a, b]\nsequence_parallel: true\n"
                           "recompute_granularity: selective\n")
    config = parse_config(["--config", str(config_file), "--lr", "5e-4"])
    assert config.model.hidden_size == 128
    assert config.optimizer.lr == 5e-4
    assert config.data.data_path == ["a", "b"]
    assert config.parallel.sequence_parallel is True
    assert config.model.num_layers == 4  # default
    assert parse_config(["--config", str(config_file),
                         "--no-sequence-parallel"]).parallel.sequence_parallel is False
    # a YAML choice turned off from the command line (a preset's recompute, say)
    assert config.recompute.recompute_granularity == "selective"
    assert parse_config(["--config", str(config_file), "--recompute-granularity",
                         "none"]).recompute.recompute_granularity is None


def test_unknown_yaml_keys_and_flags_are_named_with_the_nearest_valid_name(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("hidden_size: 128\nhiden_size: 3\nnum-layers: 2\nzzz_qqq: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'hiden_size' \(did you mean 'hidden_size'\?\), "
                       r"'num-layers' \(did you mean 'num_layers'\?\), 'zzz_qqq';"):
        parse_config(["--config", str(config_file)])
    with pytest.raises(ConfigError, match=r"^unknown flag --hiden-size \(did you mean --hidden-size\?\); "):
        parse_config(["--hiden-size", "64"])
    with pytest.raises(ConfigError, match=r"^argument --train-iters: invalid int value: 'x'"):
        parse_config(["--train-iters", "x"])


def test_wrong_yaml_type_is_named(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("train_iters: ten\n")
    with pytest.raises(ConfigError, match="train_iters: 'ten' is not a valid int for --train-iters"):
        parse_config(["--config", str(config_file)])


@pytest.mark.parametrize("flags, world, message", [
    (["--tensor-model-parallel-size", "3"], 3,
     "--tensor-model-parallel-size 3 does not divide --num-attention-heads 8"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], 1,
     "--seq-length 64 is beyond --max-position-embeddings 32"),
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 2,
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4"),
    (["--tensor-model-parallel-size", "2"], 3,
     "world size 3 is not divisible by --tensor-model-parallel-size 2"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "33",
      "--max-position-embeddings", "64"], 2, "--sequence-parallel needs --seq-length 33 divisible"),
    (["--data-path", "/nonexistent/corpus", "--tokenizer-model", "x.model"], 1,
     "--data-path /nonexistent/corpus: no /nonexistent/corpus.bin found; run python -m data.preprocess"),
    (["--data-path", "corpus_text_document.bin", "--tokenizer-model", "x.model"], 1,
     "--data-path corpus_text_document.bin: give the prefix of the .bin/.idx pair, --data-path "
     "corpus_text_document (Megatron's convention)"),
    (["--zero-stage", "3", "--zero-persistence-threshold", "-1"], 1, "--zero-persistence-threshold and"),
    (["--bf16", "--fp16"], 1, "--bf16 and --fp16 exclude each other"),
    (["--async-save", "--ckpt-format", "torch_dcp"], 1, "--async-save writes native checkpoints"),
    (["--lr-decay-style", "WSD"], 1, "--lr-decay-style WSD decays over the last --lr-wsd-decay-iters"),
    (["--lr-wsd-decay-iters", "3"], 1, "belong to --lr-decay-style WSD, not"),
    (["--start-weight-decay", "0.1"], 1, "set an increasing weight decay: add --weight-decay-incr-style"),
    (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.2", "--end-weight-decay", "0.1"], 1,
     "needs --start-weight-decay and --end-weight-decay with 0 <= start <= end"),
    (["--partition-activations"], 1, "add --recompute-granularity full or selective"),
    (["--pipeline-model-parallel-size", "4", "--num-layers", "6"], 4,
     "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved",
      "--virtual-pipeline-size", "2",
      "--global-batch-size", "4", "--micro-batch-size", "4", "--num-layers", "4"], 2,
     "--pipeline-schedule interleaved needs the micro-batches per step (1 = --global-batch-size"),
    (["--virtual-pipeline-size", "2"], 1, "--virtual-pipeline-size needs --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--virtual-pipeline-size", "1",
      "--untie-embeddings-and-output-weights"], 2, "--virtual-pipeline-size must be 2 (or left out), got 1"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--virtual-pipeline-size", "2",
      "--num-layers", "4"], 2, "--virtual-pipeline-size 2 runs 2 model chunks per stage: it needs "
                               "--pipeline-schedule interleaved (or zbv for 2), not zb-h1"),
    (["--offload-optimizer", "cpu"], 1, "--offload-optimizer cpu needs --zero-stage 1, 2 or 3"),
    (["--zero-stage", "2", "--offload-optimizer", "nvme"], 1, "NVMe offload needs --nvme-path DIR"),
    (["--zero-stage", "2", "--offload-optimizer", "nvme", "--nvme-path", "/nonexistent/nvme"], 1,
     "--nvme-path /nonexistent/nvme does not exist or is not a directory"),
    (["--zero-stage", "2", "--offload-optimizer", "nvme", "--nvme-path", "/", "--num-layers", "256",
      "--hidden-size", "8192", "--num-attention-heads", "64"], 1, "GiB free but the swapped states need"),
    (["--zero-stage", "2", "--nvme-path", "/tmp"], 1,
     "--nvme-path is only used with --offload-optimizer nvme"),
    (["--zero-stage", "2", "--offload-param", "nvme", "--nvme-path", "/tmp"], 1,
     "--offload-param nvme needs --zero-stage 3"),
    (["--zero-stage", "3", "--offload-param", "cpu"], 1,
     "--offload-param cpu is not available in this build"),
    (["--zero-quantized-weights"], 2, "--zero-quantized-weights needs --zero-stage 1, 2 or 3"),
    (["--zero-stage", "3", "--zero-hpz-partition-size", "3"], 4,
     "--zero-hpz-partition-size 3 must divide the data-parallel size 4"),
    (["--zero-stage", "2", "--zero-hpz-partition-size", "2"], 4,
     "--zero-hpz-partition-size 2 needs --zero-stage 3"),
    (["--zero-stage", "1", "--zero-quantized-gradients"], 2,
     "--zero-quantized-gradients needs --zero-stage 2 or 3"),
    (["--zero-stage", "3", "--zero-shard-size", "3"], 4,
     "--zero-shard-size 3 must divide the data-parallel size 4"),
    (["--zero-shard-size", "2"], 4, "--zero-shard-size 2 needs --zero-stage 1, 2 or 3"),
    (["--zero-stage", "3", "--zero-shard-size", "2", "--zero-hpz-partition-size", "2"], 4,
     "--zero-shard-size 2 is not combined with --zero-hpz-partition-size"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], 1, "need 0 <= min-lr <= lr"),
    (["--global-batch-size", "8", "--step-batch-size-schedule", "0:4 1K:8"], 1,
     "--step-batch-size-schedule sets the global batch at every step: drop --global-batch-size"),
    (["--global-batch-size", "16", "--micro-batch-size", "2", "--rampup-batch-size", "2", "2", "64"], 2,
     "--rampup-batch-size: a global batch of 2 is not divisible by --micro-batch-size 2 x "
     "data-parallel size 2"),
    (["--global-batch-size", "16", "--rampup-batch-size", "4", "5", "64"], 1,
     "from 4 in steps of 5 it must reach --global-batch-size 16"),
    (["--train-iters", "10", "--train-samples", "100"], 1,
     "--train-iters and --train-samples both set the run's"),
    (["--train-samples", "100", "--lr-decay-iters", "10"], 1, "use --lr-decay-samples / --lr-warmup-samples"),
    (["--train-iters", "10", "--lr-warmup-samples", "10"], 1, "use --lr-decay-iters / --lr-warmup-iters"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], 1, "are two warm-ups: give one"),
    (["--num-layers-per-virtual-pipeline-stage", "3", "--pipeline-model-parallel-size", "2",
      "--num-layers", "4"], 2,
     "--num-layers-per-virtual-pipeline-stage 3: --num-layers 4 is not pipeline stages 2 x chunks of 3"),
    (["--mock-data", "--data-path", "x"], 1, "--data-path and --mock-data are two sources of data"),
    (["--context-parallel-size", "3"], 3,
     "--seq-length 32 is not a multiple of 2 x --context-parallel-size 3"),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"], 6,
     "world size 6 is not divisible by --tensor-model-parallel-size 2 x --context-parallel-size 2 x "
     "--pipeline-model-parallel-size 1 = 4"),
    (["--context-parallel-size", "4", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--seq-length", "24"], 16, "each rank's 6 tokens must divide by --tensor-model-parallel-size 4"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--group-query-attention",
      "--num-query-groups", "2"], 4, "the 8 query heads and 2 key/value groups per tensor-parallel rank must "
                                     "divide by --context-parallel-size 4"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], 2,
     "--cp-comm-type a2a+p2p / --hierarchical-context-parallel-sizes: hierarchical context parallelism "
     "is not"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a", "p2p"], 2,
     "--cp-comm-type has 3 values: give one, or one per layer (--num-layers 2)"),
    (["--recompute-modules", "mlp"], 1, "--recompute-modules chooses what --recompute-granularity selective "
                                        "recomputes: add it"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "moe_act", "mla_up_proj"], 1,
     "--recompute-modules moe_act mla_up_proj: this model has no such part; its modules are core_attn, "
     "layernorm, mlp"),
    # pipeline refusals name the flag that was given, not one derived from it
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
      "--num-layers-per-virtual-pipeline-stage", "2", "--num-layers", "4"], 2,
     "--num-layers-per-virtual-pipeline-stage 2 makes 1 chunk(s) per stage; --pipeline-schedule zbv runs two "
     "in a V: give 1"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
      "--decoder-first-pipeline-num-layers", "1"], 2,
     "--decoder-first-pipeline-num-layers 1: a stage of 1 layers does not cut into its 2 virtual chunks"),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
      "--account-for-loss-in-pipeline-split"], 2,
     "--decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split both cut"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--account-for-loss-in-pipeline-split"], 2,
     "--account-for-loss-in-pipeline-split: --num-layers 4 + 1 = 5 is not divisible by "
     "--pipeline-model-parallel-size 2 x 1 chunks"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--virtual-pipeline-size", "2",
      "--pipeline-model-parallel-layout", "Et|tttL"], 2,
     "--pipeline-model-parallel-layout has 1 virtual stage(s) per pipeline stage, the schedule runs 2"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--pipeline-model-parallel-layout",
      "Et|t*99999999L"], 2, "--pipeline-model-parallel-layout 'Et|t*99999999L': its repeats make more than"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--pipeline-model-parallel-layout",
      "Et|tx|ttL"], 2, "--pipeline-model-parallel-layout 'Et|tx|ttL': 'x' is not a layer"),
    (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1", "--num-layers", "4"],
     3,
     "--decoder-first-pipeline-num-layers 1: the other 2 of 3 stages cannot split the remaining 3 layers"),
    (["--decoder-last-pipeline-num-layers", "2"], 1,
     "--decoder-last-pipeline-num-layers 2 sets the first or last pipeline stage's layers: it needs "
     "--pipeline-model-parallel-size >= 2"),
    (["--sft", "--data-path", "x.jsonl", "--reset-attention-mask"], 1,
     "--reset-attention-mask act on packed pretraining documents; --sft puts one"),
])
def test_bad_settings_name_the_flag(flags, world, message):
    config = parse_config(TINY + flags)
    with pytest.raises(ConfigError) as error:
        validate(config, world)
    assert message in str(error.value)


def test_tokenizer_that_does_not_fit_vocab_size(stdlib_corpus):
    prefix, tokenizer = stdlib_corpus
    config = parse_config(TINY + ["--data-path", prefix, "--tokenizer-model", tokenizer,
                                  "--vocab-size", "100"])
    with pytest.raises(ConfigError, match="--vocab-size 100 is smaller than the tokenizer's vocabulary 512"):
        validate(config, 1)


def test_every_rank_refuses_bad_input_before_any_group_exists(tmp_path):
    """Each rank validates alone: started as ranks 0 and 1 of a world of 2 with no peer listening,
    both exit with code 2 (a rank that tried to form a group would hang instead); the message is said
    once per node, by its first local rank."""
    command = [sys.executable, "-m", "pretrain", *TINY, "--global-batch-size", "3"]
    runs = [subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", RANK=str(rank),
                                      LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="1"))
            for rank in (0, 1)]
    said = []
    for run in runs:
        _, stderr = run.communicate(timeout=60)
        assert run.returncode == 2
        said.append(stderr)
    assert said[0].startswith("error: --global-batch-size 3 is not divisible by --micro-batch-size 4 x "
                              "data-parallel "
                              "size 2") and said[0].count("\n") == 1
    assert said[1] == ""


def test_torchrun_job_with_bad_input_exits_non_zero(tmp_path):
    command = [sys.executable, "-m", "launch.torchrun", "--nproc", "2", *TINY, "--global-batch-size", "3"]
    run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode != 0
    assert "error: --global-batch-size 3 is not divisible" in run.stdout + run.stderr


def test_launch_torchrun_passes_its_restarts_to_torchrun_and_refuses_a_negative_count(capsys):
    from launch.torchrun import main as launch_main, torchrun_arguments

    assert torchrun_arguments(2, ["--train-iters", "4"], 3) == [
        "--standalone", "--nproc-per-node=2", "--max-restarts=3", "-m", "pretrain", "--train-iters", "4"]
    with pytest.raises(SystemExit):
        launch_main(["--nproc", "2", "--max-restarts", "-1", "--train-iters", "4"])
    assert "--max-restarts must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--mtp-use-repeated-layer"], "--mtp-use-repeated-layer: one layer per multi-token prediction depth is "
     "built"),
    (["--num-experts", "8", "--moe-enable-deepep"],
     "--moe-enable-deepep: the flex dispatcher \\(DeepEP, HybridEP\\) is not built"),
    (["--prompts", "hello"], "--prompts hello: an option of Megatron's inference scripts"),
    (["--hybrid-attention-ratio", "0.25"], "--hybrid-attention-ratio 0.25: Megatron's older placement of "
     "hybrid layers by ratios: give the layers as --hybrid-layer-pattern"),
])
def test_megatron_features_this_build_lacks_are_refused_at_parse(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(TINY + flags)


def test_megatron_spellings_mean_our_settings():
    config = parse_config(TINY + ["--norm-epsilon", "1e-6", "--distributed-timeout-minutes", "2",
                                  "--data-cache-path",
                                  "cache", "--wandb-save-dir", "w", "--use-distributed-optimizer",
                                  "--num-layers", "8",
                                  "--pipeline-model-parallel-size", "2",
                                  "--num-layers-per-virtual-pipeline-stage", "2",
                                  "--context-parallel-size", "1", "--use-mcore-models",
                                  "--global-batch-size", "8"])
    validate(config, 2)
    assert config.model.layernorm_epsilon == 1e-6 and config.parallel.distributed_timeout_s == 120.0
    assert config.data.data_cache_dir == "cache" and config.logging.wandb_dir == "w"
    assert config.zero.zero_stage == 1  # the distributed optimizer is ZeRO-1
    assert config.parallel.virtual_pipeline_size == 2 and config.parallel.pipeline_schedule == "interleaved"
    assert config.ignored_flags == ["--use-mcore-models"]
    assert parse_config(TINY + ["--use-megatron-fsdp"]).zero.zero_stage == 3
    explicit = parse_config(TINY + ["--use-distributed-optimizer", "--zero-stage", "2"])
    validate(explicit, 1)
    assert explicit.zero.zero_stage == 2  # --zero-stage says otherwise
    uneven = parse_config(TINY + ["--num-layers", "8", "--pipeline-model-parallel-size", "3",
                                  "--decoder-first-pipeline-num-layers", "2",
                                  "--decoder-last-pipeline-num-layers", "2"])
    validate(uneven, 3)
    assert uneven.parallel.pipeline_layers_per_stage == [2, 4, 2]
    gpt2 = parse_config(TINY + ["--vocab-file", "v.json", "--merge-file", "m.txt"])
    from pretrain.config.megatron_flags import resolve_settings

    resolve_settings(gpt2, 1)
    assert gpt2.data.tokenizer_type == "GPT2BPETokenizer"  # as pretrain_gpt infers it


def test_ckpt_step_needs_load_and_a_saved_iteration(tmp_path):
    for iteration in (2, 4):
        (tmp_path / f"iter_{iteration:07d}").mkdir()
    (tmp_path / "iter_0000006.tmp").mkdir()  # an unfinished save is not offered
    with pytest.raises(ConfigError, match=r"^--ckpt-step 4 picks a checkpoint under --load: add --load DIR$"):
        validate(parse_config(TINY + ["--ckpt-step", "4"]), 1)
    with pytest.raises(ConfigError,
                       match=f"^--ckpt-step 3: no checkpoint of iteration 3 under --load {tmp_path} "
                       r"\(saved: 2, 4\); give one of those or drop --ckpt-step$"):
        validate(parse_config(TINY + ["--load", str(tmp_path), "--ckpt-step", "3"]), 1)


def test_a_load_of_something_else_than_a_checkpoint_directory_is_refused_in_one_line(tmp_path):
    """A Hugging Face model given to --load (it trained a default GPT from scratch) and one checkpoint's
    own folder (an iter_ directory) are named with what to give instead; a missing --load still starts a
    job that restarts itself from iteration 0."""
    hf = tmp_path / "llama"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    run = subprocess.run([sys.executable, "-m", "pretrain", *TINY, "--load", str(hf)], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 2 and run.stderr == (
        f"error: --load {hf} is a Hugging Face model, not a checkpoint of ours: import it with python -m "
        f"pretrain.convert --from-hf {hf} --output CKPT, then train from it with --pretrained-checkpoint "
        "CKPT\n")
    one = tmp_path / "ck" / "iter_0000004"
    one.mkdir(parents=True)
    (one / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"^--load {one} is one checkpoint: give the directory that holds "
                                          f"it, --load {tmp_path / 'ck'} --ckpt-step 4$"):
        validate(parse_config(TINY + ["--load", str(one)]), 1)
    validate(parse_config(TINY + ["--load", str(tmp_path / "not-yet")]), 1)
