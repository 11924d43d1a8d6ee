"""The per-micro-batch path never makes the host wait for the device.

On a GPU every ``.item()``, ``bool(tensor)``, ``float(tensor)`` or ``.tolist()`` blocks the host until
the device has caught up, which empties the launch queue. They are counted here with patched tensor
methods over one training step: the count must not grow with the number of micro-batches (the step
itself reads three numbers once: the loss, the gradient norm and whether to skip).
"""

import os
import sys

import torch

from pretrain.config.arguments import parse_config
from pretrain.startup.validation import validate
from tests.pretrain.test_trainer import TINY
from tests.world import run_world

READS = ("item", "tolist", "__bool__", "__float__", "__int__")


def _syncs_per_step(rank, world_size, corpus, layouts):
    from pretrain.training.trainer import Trainer

    prefix, tokenizer = corpus
    counts = []
    for flags in layouts:
        config = parse_config(TINY + ["--data-path", prefix, "--tokenizer-model", tokenizer,
                                      "--data-cache-dir", f"{prefix}-cache", "--micro-batch-size", "1"]
                              + flags)
        trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
        batches = trainer._batches(trainer.data.train, 64, 0)
        trainer.train_step(batches)  # the first step records the stage-3 order and checks it
        calls = {"n": 0}
        originals = {name: getattr(torch.Tensor, name) for name in READS}

        def counting(original):
            def read(self, *args, **kwargs):
                # torch.optim reads its step counters, which it keeps in host memory (no device wait)
                if f"torch{os.sep}optim" not in sys._getframe(1).f_code.co_filename:
                    calls["n"] += 1
                return original(self, *args, **kwargs)
            return read

        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        try:
            trainer.train_step(batches)
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        counts.append(calls["n"])
    return counts


def test_host_reads_per_step_do_not_grow_with_the_micro_batches(stdlib_corpus):
    layouts = {
        "pp2 1f1b, per-token loss": ["--pipeline-model-parallel-size", "2", "--calculate-per-token-loss"],
        "pp2 interleaved, ZeRO-2": ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-size", "2",
                                    "--zero-stage", "2"],
        "dp2 ZeRO-3 bf16": ["--zero-stage", "3", "--bf16"],
        "dp2 ZeRO-1 fp16 (overflow checks)": ["--zero-stage", "1", "--fp16"],
    }
    runs = [flags + ["--global-batch-size", str(size)] for flags in layouts.values() for size in (4, 16)]
    for rank, counts in enumerate(run_world(2, _syncs_per_step, stdlib_corpus, runs)):
        for index, name in enumerate(layouts):
            few, many = counts[2 * index], counts[2 * index + 1]
            assert few == many, f"rank {rank}, {name}: {few} host reads with global batch 4, {many} with 16"
            assert many <= 3, f"rank {rank}, {name}: {many} host reads in one step"
