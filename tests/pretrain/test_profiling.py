"""Megatron's profiling flags: --profile --use-pytorch-profiler writes one Chrome trace per profiled rank
over the steps asked for, which parses as TensorBoard's profiler plugin and Perfetto read it; what the CPU
cannot do is refused by name before anything starts (the CUDA memory history), or said and skipped
(nsys's capture range: Megatron's scripts pass --profile)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate
from tests.world import run_world

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MOCK = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
        "--sample-prompt", "", "--log-interval", "1", "--train-iters", "4"]


def _profiled(rank, world_size, flags):
    import torch

    from pretrain.training.trainer import Trainer

    config = parse_config(MOCK + flags)
    Trainer(config, validate(config, world_size), torch.device("cpu")).train()


def test_the_pytorch_profiler_traces_the_steps_asked_on_the_ranks_asked(tmp_path):
    tensorboard = tmp_path / "tb"
    run_world(2, _profiled, ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                             "--profile-step-end", "3", "--profile-ranks", "1", "--tensorboard-dir",
                             str(tensorboard), "--data-cache-path", str(tmp_path)])
    traces = glob.glob(str(tensorboard / "*.pt.trace.json"))
    assert [os.path.basename(path).split(".")[0] for path in traces] == ["rank1"]  # rank 0 is not traced
    with open(traces[0]) as handle:
        trace = json.load(handle)
    names = {event.get("name", "") for event in trace["traceEvents"]}
    # steps 2 and 3, after step 1 warmed the profiler up (Megatron's schedule)
    assert sorted(name for name in names if name.startswith("ProfilerStep")) == ["ProfilerStep#1",
                                                                                 "ProfilerStep#2"]
    assert {"aten::mm", "aten::scaled_dot_product_attention"} & names  # the steps' own operators


@pytest.mark.parametrize("flags, message", [
    (["--profile", "--use-pytorch-profiler"], "--use-pytorch-profiler writes its traces under "
                                              "--tensorboard-dir: give one"),
    (["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb", "--profile-step-start", "5",
      "--profile-step-end", "5"], "--profile-step-end 5 must be after --profile-step-start 5"),
    (["--record-memory-history"], "--record-memory-history records the CUDA allocator: there is no GPU here"),
])
def test_what_the_cpu_cannot_profile_is_refused_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_config(MOCK + flags), 1)


def test_a_profiled_run_prints_nothing_but_its_own_lines(tmp_path):
    """From the command line, a run traced by torch.profiler from its first step: no kineto lines
    ("USDT: ... profiler_start"), no warning about the warm-up it cannot have, no torchao start-up lines
    (transformers and the fp8 layers import it), only the run's own."""
    job = subprocess.run([sys.executable, "-m", "pretrain", *MOCK, "--profile", "--use-pytorch-profiler",
                          "--profile-step-start", "0", "--profile-step-end", "2", "--tensorboard-dir",
                          str(tmp_path / "tb"), "--data-cache-path", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=REPOSITORY,
                         env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert job.returncode == 0, job.stderr[-2000:]
    assert job.stderr == "", job.stderr
    assert "rank 0: profiler trace written under" in job.stdout
    quiet = subprocess.run([sys.executable, "-c", "from parallel.tensor.fp8 import preload_torchao; "
                            "preload_torchao(); import transformers; transformers.AutoModelForCausalLM"
                            ".from_config(transformers.LlamaConfig(hidden_size=16, intermediate_size=32, "
                            "num_hidden_layers=1, num_attention_heads=2, vocab_size=32))"],
                           capture_output=True, text=True, timeout=300, cwd=REPOSITORY)
    assert quiet.returncode == 0 and "Failed to load" not in quiet.stderr + quiet.stdout, quiet.stderr
