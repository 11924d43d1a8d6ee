"""--fp8-format through torchao's float8 training, emulated on the CPU: the layers' fp8 product is torchao's
own, and a run in fp8 follows its bf16 run within ``FP8_LOSS_RTOL`` over 100 iterations in every layout."""

import pytest
import torch

from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate
from tests.parity import FP8_LOSS_RTOL, assert_trajectory_close
from tests.pretrain.test_trainer import COMPILED, TINY, _train
from tests.world import run_world

pytest.importorskip("torchao")


@pytest.mark.parametrize("recipe", [("hybrid", "tensorwise"), ("e4m3", "rowwise")])
def test_the_layers_fp8_product_is_torchaos(recipe):
    """A column-parallel layer in fp8 computes exactly what torchao's float8 linear computes from the same
    weight, forward and backward (input, weight and bias gradients)."""
    from torchao.float8 import convert_to_float8_training

    from parallel.comm import AxisGroup, CommStats
    from parallel.tensor.fp8 import Fp8Recipe
    from parallel.tensor.layers import ColumnParallelLinear, use_fp8
    from parallel.tensor.weight_init import WeightInit

    torch.manual_seed(0)
    ours = ColumnParallelLinear(64, 48, AxisGroup("tp", (0,), None, CommStats()), WeightInit(1, "w", 0.02),
                                dtype=torch.bfloat16)
    assert use_fp8(ours, Fp8Recipe(*recipe, emulate=True)) == (1, 0)
    theirs = torch.nn.Sequential(torch.nn.Linear(64, 48, dtype=torch.bfloat16))
    theirs[0].load_state_dict(ours.state_dict())
    convert_to_float8_training(theirs, config=Fp8Recipe(*recipe, emulate=True).torchao_config())
    x = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    assert torch.equal(y_ours, y_theirs)
    grad = torch.randn_like(y_ours)
    y_ours.backward(grad)
    y_theirs.backward(grad)
    assert torch.equal(x_ours.grad, x_theirs.grad)
    assert torch.equal(ours.weight.grad, theirs[0].weight.grad)
    assert torch.equal(ours.bias.grad, theirs[0].bias.grad)


def test_fp8_flags_are_refused_by_name_where_they_cannot_run():
    base = TINY + ["--fp8-format", "hybrid"]
    for flags, message in (([], "add --bf16"),
                           (["--bf16"], "capability 8.9 or newer .* there is no GPU here; --fp8-emulate"),
                           (["--bf16", "--fp8-emulate", "--fp8-recipe", "delayed"],
                            "--fp8-recipe delayed: the scales here are computed from each tensor")):
        with pytest.raises(ConfigError, match=message):
            validate(parse_config(base + flags), 1)
    with pytest.raises(ConfigError, match="--fp8-emulate sets up fp8 training: give --fp8-format"):
        validate(parse_config(TINY + ["--fp8-emulate"]), 1)


HUNDRED = ["--num-layers", "2", "--train-iters", "100", "--lr-decay-iters", "100", "--log-interval", "50",
           "--bf16"]
FP8 = ["--fp8-emulate", "--fp8-format"]


@pytest.mark.parity
def test_fp8_follows_bf16_for_100_iterations_in_every_layout(stdlib_corpus):
    """bf16 at dp2 against fp8 at dp2 ZeRO-3 with --compile (e4m3, rowwise), tp2 + SP (hybrid, rowwise) and
    pp2 (hybrid, tensorwise): every iteration's loss within the fp8 bound."""
    layouts = [HUNDRED,
               HUNDRED + FP8 + ["e4m3", "--fp8-recipe", "rowwise", "--zero-stage", "3",
                                "--zero-persistence-threshold", "0", *COMPILED],
               HUNDRED + FP8 + ["hybrid", "--fp8-recipe", "rowwise", "--tensor-model-parallel-size", "2",
                                "--sequence-parallel"],
               HUNDRED + FP8 + ["hybrid", "--pipeline-model-parallel-size", "2"]]
    bf16, *fp8 = run_world(2, _train, layouts, stdlib_corpus, timeout_s=600)[-1]
    for result, name in zip(fp8, ("ZeRO-3 compiled e4m3 rowwise", "tp2+SP hybrid rowwise", "pp2 hybrid")):
        assert_trajectory_close(result[0], bf16[0], f"fp8 {name}: loss", rtol=FP8_LOSS_RTOL)
        assert not result[5], (name, result[5])
