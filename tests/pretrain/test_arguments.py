"""Config from flags and YAML, and the errors bad input gets before any process group exists."""

import os
import subprocess
import sys

import pytest

from pretrain.arguments import ConfigError, parse_config
from pretrain.validation import validate

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32"]


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("hidden_size: 128\nlr: 1.0e-3\ndata_path: [a, b]\nsequence_parallel: true\n")
    config = parse_config(["--config", str(config_file), "--lr", "5e-4"])
    assert config.model.hidden_size == 128
    assert config.optimizer.lr == 5e-4
    assert config.data.data_path == ["a", "b"]
    assert config.parallel.sequence_parallel is True
    assert config.model.num_layers == 4  # default
    assert parse_config(["--config", str(config_file), "--no-sequence-parallel"]).parallel.sequence_parallel is False


def test_unknown_yaml_key_is_named(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("hidden_size: 128\nhiden_size: 3\nnum-layers: 2\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'hiden_size', 'num-layers' \(did you mean 'num_layers'\?\)"):
        parse_config(["--config", str(config_file)])


def test_wrong_yaml_type_is_named(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("train_iters: ten\n")
    with pytest.raises(ConfigError, match="train_iters: 'ten' is not a valid int for --train-iters"):
        parse_config(["--config", str(config_file)])


@pytest.mark.parametrize("flags, world, message", [
    (["--tensor-model-parallel-size", "3"], 3,
     "--tensor-model-parallel-size 3 does not divide --num-attention-heads 8"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], 1, "--seq-length 64 is beyond --max-position-embeddings 32"),
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 2,
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible by --tensor-model-parallel-size 2"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "33",
      "--max-position-embeddings", "64"], 2, "--sequence-parallel needs --seq-length 33 divisible"),
    (["--data-path", "/nonexistent/corpus", "--tokenizer-model", "x.model"], 1,
     "--data-path /nonexistent/corpus: /nonexistent/corpus.bin is missing"),
    (["--zero-stage", "3", "--zero-persistence-threshold", "-1"], 1, "--zero-persistence-threshold and"),
    (["--bf16", "--fp16"], 1, "--bf16 and --fp16 exclude each other"),
    (["--partition-activations"], 1, "add --recompute-granularity full or selective"),
    (["--pipeline-model-parallel-size", "4", "--num-layers", "6"], 4,
     "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved", "--virtual-pipeline-size", "2",
      "--global-batch-size", "4", "--micro-batch-size", "4", "--num-layers", "4"], 2,
     "--pipeline-schedule interleaved needs the micro-batches per step (1 = --global-batch-size"),
    (["--virtual-pipeline-size", "2"], 1, "--virtual-pipeline-size needs --pipeline-model-parallel-size > 1"),
    (["--offload-optimizer", "cpu"], 1, "--offload-optimizer cpu needs --zero-stage 1, 2 or 3"),
    (["--zero-stage", "2", "--offload-optimizer", "nvme"], 1, "NVMe offload needs --nvme-path DIR"),
    (["--zero-stage", "2", "--offload-optimizer", "nvme", "--nvme-path", "/nonexistent/nvme"], 1,
     "--nvme-path /nonexistent/nvme does not exist or is not a directory"),
    (["--zero-stage", "2", "--offload-optimizer", "nvme", "--nvme-path", "/", "--num-layers", "256",
      "--hidden-size", "8192", "--num-attention-heads", "64"], 1, "GiB free but the swapped states need"),
    (["--zero-stage", "2", "--nvme-path", "/tmp"], 1, "--nvme-path is only used with --offload-optimizer nvme"),
    (["--zero-stage", "2", "--offload-param", "nvme", "--nvme-path", "/tmp"], 1,
     "--offload-param nvme needs --zero-stage 3"),
    (["--zero-stage", "3", "--offload-param", "cpu"], 1, "--offload-param cpu is not available in this build"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], 1, "need 0 <= min-lr <= lr"),
])
def test_bad_settings_name_the_flag(flags, world, message):
    config = parse_config(TINY + flags)
    with pytest.raises(ConfigError) as error:
        validate(config, world)
    assert message in str(error.value)


def test_tokenizer_that_does_not_fit_vocab_size(stdlib_corpus):
    prefix, tokenizer = stdlib_corpus
    config = parse_config(TINY + ["--data-path", prefix, "--tokenizer-model", tokenizer, "--vocab-size", "100"])
    with pytest.raises(ConfigError, match="--vocab-size 100 is smaller than the tokenizer's vocabulary 512"):
        validate(config, 1)


def test_every_rank_refuses_bad_input_before_any_group_exists(tmp_path):
    """Each rank validates alone: started as ranks 0 and 1 of a world of 2 with no peer listening,
    both exit with code 2 and the message (a rank that tried to form a group would hang instead)."""
    command = [sys.executable, "-m", "pretrain", *TINY, "--global-batch-size", "3"]
    runs = [subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", RANK=str(rank),
                                      LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="1"))
            for rank in (0, 1)]
    for run in runs:
        _, stderr = run.communicate(timeout=60)
        assert run.returncode == 2
        assert "error: --global-batch-size 3 is not divisible by --micro-batch-size 4 x data-parallel size 2" in stderr


def test_torchrun_job_with_bad_input_exits_non_zero(tmp_path):
    command = [sys.executable, "-m", "launch.torchrun", "--nproc", "2", *TINY, "--global-batch-size", "3"]
    run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode != 0
    assert "error: --global-batch-size 3 is not divisible" in run.stdout + run.stderr
