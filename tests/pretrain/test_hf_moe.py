"""The mixture-of-experts families the interop maps (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3), against
transformers' own code: a tiny random model of each (made by transformers from the family's config class,
every weight perturbed) gives transformers' logits through ``pretrain.load_model``, at ep2 x tp2 + SP and
at ep2 x expert dp 2 ZeRO-3; exports back bit for bit; and a short SFT at ep2 ZeRO-3 lowers transformers'
own loss on held-out examples."""


import pytest

from launch.examples.hf_families import MOE_FAMILIES
from tests.pretrain.test_hf_families import check_layouts_and_fine_tune, check_load_and_export, made_families

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_families(tmp_path_factory):
    return made_families(tmp_path_factory, MOE_FAMILIES)


@pytest.mark.parity
def test_load_model_gives_transformers_logits_and_the_export_round_trips_bit_for_bit(moe_families, tmp_path):
    check_load_and_export(moe_families, tmp_path)


# each family's logits at ep2 x tp2 + SP (alltoall), then at ep2 x expert dp 2 (allgather) with its SFT
MOE_LAYOUTS = (("ep2 x tp2 + SP", ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                   "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall"]),
               ("ep2 x expert dp 2 ZeRO-3", ["--expert-model-parallel-size", "2"]))
FEATURES = {"mixtral": "every layer MoE, renormalised top-2",
            "qwen2-moe": "dense first layer, gated shared expert, q/k/v biases, raw top-k",
            "qwen3-moe": "per-head q/k norms, renormalised top-k",
            "olmoe": "q/k norms over the projection, raw top-k",
            "deepseek-v3": "latent attention (yarn, query latent), sigmoid group-limited top-2 with the "
                           "score-correction bias, routed scaling, shared expert, dense first layer"}


@pytest.mark.parity
def test_every_moe_family_at_ep2_with_tp_and_zero3_and_a_short_fine_tune_lowers_its_loss(moe_families,
                                                                                         tmp_path):
    print("\n" + "\n".join(check_layouts_and_fine_tune(moe_families, tmp_path, MOE_LAYOUTS, FEATURES)))
