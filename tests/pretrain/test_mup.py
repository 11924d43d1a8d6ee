"""muP (--use-mup, Megatron-LM's flags): at twice its base width a model starts from Megatron's muP init
(hidden matrices / sqrt(m), embeddings and the output layer as without), scales scores by 1/d and logits by
1/m, and its hidden matrices' AdamW rate and epsilon are / m on megatron-core's own scheduler's schedule
(its per-group max_lr and min_lr); tp2 + SP, pp2 and ZeRO-3 follow one process under muP; the coordinate
check is flat under muP and grows under the standard parametrization."""

import json
import math

import pytest
import torch

from models.config import GPTConfig
from models.gpt import GPTModel
from parallel.comm import AxisGroup, CommStats
from pretrain.config.arguments import parse_config
from pretrain.config.schema import OptimizerConfig
from pretrain.interop.hf_config import HFMappingError, hf_kind
from pretrain.training.batch_schedule import BatchSchedule
from pretrain.training.param_groups import parameter_groups
from pretrain.training.param_scheduler import build_param_scheduler
from tests.parity import NO_DROPOUT, assert_trajectory_close
from tests.pretrain.test_trainer import SHORT, TINY, ZERO3, _pp, _tp, _train
from tests.world import run_world

MUP = ["--use-mup", "--mup-base-hidden-size", "32"]  # TINY's width 64: m = 2


def _model(**mup) -> GPTModel:
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=128,
                       **NO_DROPOUT, **mup)
    return GPTModel(config, AxisGroup("tp", (0,), None, CommStats()), seed=5)


def test_mups_init_scales_and_groups_are_megatrons_at_twice_the_base_width():
    standard, mup = _model(), _model(use_mup=True, mup_base_hidden_size=32)
    assert mup.config.mup_width_mult == 2.0 and mup.config.attention_scale == 1 / 16
    weights = dict(standard.named_parameters())
    for name, param in mup.named_parameters():  # the same draws (seed and name), rescaled
        matrix = param.ndim >= 2 and "embedding" not in name
        torch.testing.assert_close(param, weights[name] / (math.sqrt(2) if matrix else 1.0), rtol=1e-6,
                                   atol=0)
    tokens, positions = torch.randint(0, 128, (2, 16)), torch.arange(16).expand(2, 16)
    hidden = standard.embed(tokens, positions)
    torch.testing.assert_close(mup.logits(hidden), standard.logits(hidden) / 2)  # the same final norm, tied
    assert GPTConfig(use_mup=True, mup_base_hidden_size=32, hidden_size=64, mup_output_mult=0.3,
                     num_attention_heads=4, mup_base_head_dim=4.0).logit_multiplier == 0.3
    with pytest.raises(ValueError, match="--mup-base-hidden-size sets muP up: add --use-mup"):
        GPTConfig(mup_base_hidden_size=32).validate()
    with pytest.raises(HFMappingError, match="gpt2: --use-mup True"):  # no Hugging Face class expresses it
        hf_kind(mup.config)

    # AdamW: the layers' matrices at lr / m and eps / m; embeddings (tied output), norms, biases as without
    adam = OptimizerConfig(lr=1e-3, min_lr=1e-4, adam_eps=1e-8)
    groups = parameter_groups([mup], adam, mup.config.mup_width_mult)
    scaled = {id(p) for g in groups if g.get("lr_scale") == 0.5 and g["eps"] == 5e-9 for p in g["params"]}
    names = {id(p): n for n, p in mup.named_parameters()}
    assert {names[i] for i in scaled} == {n for n, p in mup.named_parameters()
                                          if p.ndim >= 2 and "embedding" not in n}
    sgd = parameter_groups([mup], OptimizerConfig(optimizer="sgd"), 2.0)  # SGD: the vectors' rate x m
    assert {names[id(p)] for g in sgd if g.get("lr_scale") == 2.0 for p in g["params"]} == {
        n for n, p in mup.named_parameters() if p.ndim < 2 or "embedding" in n}
    assert all("lr_scale" not in g for g in parameter_groups([mup], OptimizerConfig(optimizer="muon"), 2.0))

    # each group's rate is megatron-core's scheduler's with that group's max_lr and min_lr (/ m)
    megatron = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    from types import SimpleNamespace

    config = parse_config(["--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--lr-warmup-init",
                           "1e-5", "--lr-decay-iters", "12", "--train-iters", "12", "--lr-decay-style",
                           "cosine", "--global-batch-size", "4"])
    ours = build_param_scheduler(config, BatchSchedule(4, 4))
    theirs = SimpleNamespace(param_groups=[{"max_lr": 1e-3 / 2, "min_lr": 1e-4 / 2}, {}])
    reference = megatron.OptimizerParamScheduler(
        theirs, init_lr=1e-5, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=8, lr_decay_steps=48,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=48, wd_incr_style="constant")
    mine = [{"lr_scale": 0.5}, {}]
    for step in range(14):
        ours.step(mine)
        assert [g["lr"] for g in mine] == [g["lr"] for g in theirs.param_groups], step
        ours.advance(4)
        reference.step(increment=4)


def test_mup_layouts_reproduce_one_process(stdlib_corpus):
    """tp2 + sequence parallelism (the logits scaled on each vocabulary slice, init by the global width),
    pp2 and dp2 ZeRO-3 under muP: each within the fp32 trajectory bound of one process under muP, which
    differs from the standard parametrization's run."""
    base = TINY + SHORT
    reference, standard = run_world(1, _train, [base + MUP, base], stdlib_corpus)[0]
    assert reference[0] != standard[0]
    layouts = {"tp2 + SP": _tp(2, "--sequence-parallel"), "pp2": _pp(2), "dp2 ZeRO-3": ZERO3}
    results = run_world(2, _train, [base + MUP + flags for flags in layouts.values()], stdlib_corpus,
                        timeout_s=300)[-1]
    for name, result in zip(layouts, results):
        for what, got, want in zip(("loss", "grad norm"), result[:2], reference[:2]):
            assert_trajectory_close(got, want, f"muP {name}: {what}")


def test_the_coordinate_check_is_flat_under_mup_and_grows_under_the_standard_parametrization(tmp_path,
                                                                                             capsys):
    """Widths 32 to 128 (m up to 4), three AdamW steps at one rate: every layer's output and the logits at
    the widest width within 0.6-1.6x of the narrowest's under muP, and more than twice under the standard
    parametrization; the command writes its numbers and plot and prints the table."""
    from launch.tools.scaling import scaling_law

    scaling_law.main(["coord-check", "--output", str(tmp_path), "--widths", "32", "64", "128",
                      "--base-width", "32", "--steps", "3"])
    ratios = json.loads((tmp_path / "coord.json").read_text())["growth"]
    for part in ("layer 0", "layer 1", "logits"):
        assert 0.6 < ratios["mup"][part] < 1.6 and ratios["standard"][part] > 2, (part, ratios)
    assert "layer 0 | " in capsys.readouterr().out
    assert (tmp_path / "coord.png").read_bytes()[:4] == b"\x89PNG"
