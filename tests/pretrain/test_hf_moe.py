"""The mixture-of-experts families the interop maps (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3,
gpt-oss), against
transformers' own code: a tiny random model of each (made by transformers from the family's config class,
every weight perturbed) gives transformers' logits through ``pretrain.load_model``, at ep2 x tp2 + SP and
at ep2 x expert dp 2 ZeRO-3; exports back bit for bit; and a short SFT at ep2 ZeRO-3 lowers transformers'
own loss on held-out examples. A gpt-oss checkpoint with MXFP4 experts dequantizes as transformers does."""


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
                           "score-correction bias, routed scaling, shared expert, dense first layer",
            "gpt-oss": "attention sinks, sliding and full layers alternating, clamped SwiGLU, biases on "
                       "every projection and the router, stacked experts"}


@pytest.mark.parity
def test_every_moe_family_at_ep2_with_tp_and_zero3_and_a_short_fine_tune_lowers_its_loss(moe_families,
                                                                                         tmp_path):
    print("\n" + "\n".join(check_layouts_and_fine_tune(moe_families, tmp_path, MOE_LAYOUTS, FEATURES)))


def test_gpt_oss_with_mxfp4_experts_loads_as_transformers_dequantizes_it(tmp_path):
    """Experts stored as MXFP4 blocks and scales (OpenAI's format): load_model gives the logits of
    transformers' own dequantized model; a lone blocks tensor is refused by name."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from launch.examples.hf_families import make_model
    from pretrain.interop.load_model import load_model
    from tests.parity import assert_within
    from tests.pretrain.test_hf_families import INTEROP_RTOL

    directory = str(tmp_path / "gpt-oss")
    make_model("gpt-oss", 300, hidden_size=64, bos=0, eos=1).save_pretrained(directory)
    tensors = load_file(f"{directory}/model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape  # [E, in, out] from blocks [E, out, in / 32, 16]
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16),
                                                  generator=generator, dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(120, 128, (experts, outputs, inputs // 32),
                                                  generator=generator, dtype=torch.uint8)
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    config = json.load(open(f"{directory}/config.json"))
    config["quantization_config"] = {"quant_method": "mxfp4"}
    json.dump(config, open(f"{directory}/config.json", "w"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    batch = torch.tensor([list(range(3, 23)), list(range(40, 60))])
    with torch.no_grad():
        want, got = theirs(batch).logits, load_model(directory)(batch)
    assert_within(((got - want).norm() / want.norm()).item(), "gpt-oss MXFP4 logits", INTEROP_RTOL)
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.down_proj_blocks"):
        load_model(directory)
