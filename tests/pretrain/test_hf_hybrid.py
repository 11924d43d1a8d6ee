"""The hybrid families against transformers' own code (its PyTorch path on the CPU): Nemotron-H (Mamba-2,
attention, relu2 MLP and sigmoid-routed experts with a shared one), Mamba2, Granite 4.0-H with experts and
without, Qwen3-Next (gated delta nets, gated attention, experts beside a gated shared one), Kimi Linear
(Kimi delta attention, latent attention without positions, sigmoid-routed experts), OLMo hybrid (gated
delta nets with beta up to 2, post-norm attention without positions); and the keys that do not map,
refused by name."""

import re

import pytest

from launch.examples.hf_families import HYBRID_FAMILIES
from pretrain.interop.hf_config import config_from_hf
from pretrain.interop.hf_positions import HFMappingError
from tests.pretrain.test_hf_families import check_load_and_export, made_families

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    return made_families(tmp_path_factory, HYBRID_FAMILIES)


def test_load_model_gives_transformers_logits_and_the_export_round_trips_bit_for_bit(hybrids, tmp_path):
    check_load_and_export(hybrids, tmp_path)


def test_kimi_linears_latent_norms_keep_transformers_epsilon(hybrids):
    """Kimi Linear's norms take rms_norm_eps (1e-5 here, Kimi-Linear-48B's), its latent norms transformers'
    1e-6 whatever it says (--latent-norm-epsilon): asked directly, the test model's logits being too little
    moved by it to show."""
    from pretrain import load_model

    model = load_model(hybrids["kimi-linear"][0]).gpt
    latent = model.layers[2].attention
    assert (model.final_norm.eps, latent.kv_latent_norm.eps) == (1e-5, 1e-6)
    assert model.layers[0].kda.out_norm.eps == 1e-5


NEMOTRON = {"model_type": "nemotron_h", "hidden_size": 32, "vocab_size": 100, "num_attention_heads": 4,
            "layers_block_type": ["mamba", "attention", "mlp"], "mamba_num_heads": 4, "mamba_head_dim": 16,
            "ssm_state_size": 8, "n_groups": 2, "intermediate_size": 48, "layer_norm_epsilon": 1e-5}


@pytest.mark.parametrize("hf, message", [
    ({"model_type": "falcon_h1"}, "model_type 'falcon_h1': attention and Mamba-2 side by side in one layer "
     "(mamba_d_ssm) does not map onto a hybrid pattern"),
    ({"model_type": "jamba"}, "model_type 'jamba': Mamba-1 layers (mamba_dt_rank)"),
    ({**NEMOTRON, "moe_latent_size": 16}, "nemotron_h with moe_latent_size=16: only None maps"),
    ({**NEMOTRON, "time_step_limit": [0.0, 0.1]}, "nemotron_h with time_step_limit=[0.0, 0.1]: dt is "
     "unclamped here (Megatron's), only (0, inf) maps"),
    ({**NEMOTRON, "layer_norm_epsilon": 1e-6}, "nemotron_h with layer_norm_epsilon=1e-06: its Mamba-2 gated "
     "norm takes the same epsilon, megatron-core's is 1e-05"),
    ({**NEMOTRON, "mlp_hidden_act": "silu"}, "nemotron_h with mlp_hidden_act='silu': its MLPs are not gated"),
    ({**NEMOTRON, "conv_kernel": 3}, "nemotron_h with conv_kernel=3: only 4 maps"),
    ({**NEMOTRON, "layers_block_type": ["mamba", "sliding"]}, "nemotron_h with layers_block_type=['mamba', "
     "'sliding']: each must be one of"),
    ({"model_type": "granitemoehybrid", "residual_multiplier": 0.2}, "granitemoehybrid with "
     "residual_multiplier=0.2: only 1.0 maps"),
    ({"model_type": "mamba2", "use_bias": True}, "mamba2 with use_bias=True: only False maps"),
    ({"model_type": "kimi_linear", "hidden_act": "gelu"}, "kimi_linear with hidden_act=gelu: only silu maps"),
    ({"model_type": "olmo_hybrid", "hidden_act": "gelu"}, "olmo_hybrid with hidden_act=gelu: only silu maps"),
    ({"model_type": "olmo_hybrid", "num_hidden_layers": 2, "layer_types": ["linear_attention", "mamba"]},
     "olmo_hybrid with layer_types=['linear_attention', 'mamba']: each must be one of"),
    ({"model_type": "qwen3_next", "attention_bias": True},
     "qwen3_next with attention_bias=True: only False maps"),
    ({"model_type": "qwen3_next", "num_hidden_layers": 2,
      "layer_types": ["linear_attention", "sliding_attention"]},
     "qwen3_next with layer_types=['linear_attention', 'sliding_attention']: each must be one of"),
    ({"model_type": "granitemoehybrid", "hidden_size": 32, "vocab_size": 100, "num_attention_heads": 4,
      "shared_intermediate_size": 0, "rms_norm_eps": 1e-5, "num_hidden_layers": 2},
     "granitemoehybrid with shared_intermediate_size=0: a shared MLP of no width"),
])
def test_what_does_not_map_is_refused_by_its_key(hf, message):
    with pytest.raises(HFMappingError, match=re.escape(message)):
        config_from_hf(hf)


def test_what_the_families_cannot_hold_is_named_and_megatrons_hybrid_args_read(tmp_path):
    """A tied all-Mamba model exports as Mamba2 (its output layer the embedding); learned positions, a
    Granite-less pattern name their flags; Megatron's hybrid args give the pattern (0.16's flag, cuts
    dropped) or name what is wrong with it, and its optimizer states are refused on export in one line."""
    import argparse

    from models.config import GPTConfig
    from pretrain.checkpoint.errors import CheckpointError
    from pretrain.checkpoint.foreign.megatron_args import config_of
    from pretrain.checkpoint.foreign.megatron_export import write_megatron
    from pretrain.interop.hf_config import hf_kind
    from pretrain.interop.hf_tensor_plan import rules

    mamba = dict(hidden_size=32, num_attention_heads=1, vocab_size=100, mamba_head_dim=16,
                 mamba_num_groups=2, mamba_state_dim=8, normalization="RMSNorm",
                 position_embedding_type="none", disable_bias_linear=True)
    tied = GPTConfig(hybrid_layer_pattern="MMM", **mamba)
    assert hf_kind(tied) == "mamba2" and "lm_head.weight" not in {t for r in rules(tied) for t in r.theirs}
    learned = GPTConfig(hybrid_layer_pattern="MMM",
                        **{**mamba, "position_embedding_type": "learned_absolute"})
    with pytest.raises(HFMappingError, match="--position-embedding-type learned_absolute"):
        hf_kind(learned)
    with pytest.raises(ValueError, match="--with-optimizer-states: a HybridModel's optimizer states are not "
                                         "written yet"):
        write_megatron(None, tied, {}, str(tmp_path), "torch", with_optimizer=True)
    # Megatron-LM 0.16's deprecated pattern flag, its stages' cuts dropped: the model whatever the layout
    saved = config_of(argparse.Namespace(hybrid_override_pattern="M*|M-", num_layers=4, vocab_size=100),
                      "DIR")
    assert (saved["hybrid_layer_pattern"], saved["num_layers"]) == ("M*M-", 4)
    # 0.16's MambaModel without a pattern or ratios: all Mamba layers; a G model has no Hugging Face class
    saved = config_of(argparse.Namespace(is_hybrid_model=True, num_layers=3, vocab_size=100), "DIR")
    assert saved["hybrid_layer_pattern"] == "MMM"
    gated = GPTConfig(hybrid_layer_pattern="M*G-", linear_num_key_heads=2, linear_num_value_heads=2,
                      linear_key_head_dim=8, linear_value_head_dim=16, **mamba)
    with pytest.raises(HFMappingError, match="Nemotron-H has no G layers"):
        hf_kind(gated)
    with pytest.raises(CheckpointError, match="DIR: --hybrid-layer-pattern 'M\\*X': 'X' is not a layer "
                                              "symbol"):
        config_of(argparse.Namespace(hybrid_layer_pattern="M*X", num_layers=3, vocab_size=100), "DIR")
    # a Llama with Qwen3-Next's output gate has no Hugging Face class (its gates would land in q_proj);
    # latent attention without positions (Kimi Linear's) is no Megatron model, which always rotates
    llama = dict(hidden_size=32, num_attention_heads=4, vocab_size=100, normalization="RMSNorm",
                 swiglu=True, position_embedding_type="rope", disable_bias_linear=True)
    with pytest.raises(HFMappingError, match="--attention-output-gate True"):
        hf_kind(GPTConfig(attention_output_gate=True, **llama))
    nope = GPTConfig(**{**llama, "position_embedding_type": "none"}, multi_latent_attention=True,
                     kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    with pytest.raises(ValueError, match="megatron-core's latent attention always rotates"):
        write_megatron(None, nope, {}, str(tmp_path), "torch")
