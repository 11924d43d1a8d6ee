"""Megatron-LM's --hybrid-layer-pattern: its grammar (megatron-core 0.16.1's allocation as the oracle for
M * - E), the layers and pipeline cut a run derives from it, and every refusal in one line before any
process group exists."""

import logging
import re

import pytest

from models.hybrid.pattern import parse_pattern
from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate
from tests.pretrain.test_trainer import TINY

MAMBA = ["--mamba-head-dim", "16", "--mamba-num-groups", "2", "--mamba-state-dim", "16"]


@pytest.mark.parametrize("pattern", ["M", "M*M-", "MEM*E-", "*-*-", "MMMM*-MM*E"])
def test_the_layers_are_megatron_cores_allocation(pattern):
    from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers

    logging.getLogger("megatron.core.ssm.mamba_hybrid_layer_allocation").setLevel(logging.WARNING)
    assert list(parse_pattern(pattern).layers) == allocate_layers(len(pattern), 0.0, 0.0, pattern)


def test_pipe_and_mtp_parts():
    parsed = parse_pattern("M-M*|M-|*E/M-/M-")
    assert (parsed.layers, parsed.segments, parsed.mtp, parsed.depths) == ("M-M*M-*E", ("M-M*", "M-", "*E"),
                                                                          "M-", 2)
    assert parsed.uncut == "M-M*M-*E/M-/M-" and parsed.cut and not parse_pattern("M*").cut
    assert parse_pattern("M*//").depths == 0  # empty depths: no multi-token prediction


@pytest.mark.parametrize("pattern, message", [
    ("M*x-", "'x' is not a layer symbol; the symbols are M (Mamba-2), G (gated delta net), K (Kimi delta "
     "attention), * (attention)"),
    ("M* ", "' ' is not a layer symbol"),
    ("M*/M|-", "a multi-token-prediction depth (after /) holds no pipeline cut"),
    ("M*/M-/-M", "its multi-token-prediction depths ['M-', '-M'] differ"),
    ("*+-", "'*' (attention) beside '+' (latent attention): a model has one kind of attention"),
    ("|/M", "the main part (before any /) holds no layer"),
])
def test_a_bad_pattern_is_named(pattern, message):
    with pytest.raises(ValueError, match=re.escape(f"--hybrid-layer-pattern {pattern!r}: {message}")):
        parse_pattern(pattern)


def _validated(flags, world=1):
    config = parse_config(TINY + MAMBA + flags)
    validate(config, world)
    return config


def test_a_run_takes_its_layers_and_pipeline_cut_from_the_pattern():
    config = _validated(["--hybrid-layer-pattern", "M*M-"])
    assert config.model.num_layers == 4 and config.notes == []  # TINY's --num-layers 4 agrees
    config = _validated(["--hybrid-layer-pattern", "M*M-M-"])  # Megatron: told, and the pattern wins
    assert config.model.num_layers == 6
    assert config.notes == ["--hybrid-layer-pattern is set; ignoring --num-layers (4), using the pattern's 6 "
                            "layers"]
    config = _validated(["--hybrid-layer-pattern", "M*-|M-", "--pipeline-model-parallel-size", "2"], 2)
    assert config.parallel.pipeline_layers_per_stage == [3, 2]
    assert config.parallel.virtual_pipeline_size is None
    config = _validated(["--hybrid-layer-pattern", "M*|M-|M|*-", "--pipeline-model-parallel-size", "2"], 2)
    assert config.parallel.pipeline_layers_per_stage == [2, 2, 1, 2]
    assert config.parallel.virtual_pipeline_size == 2 and config.parallel.pipeline_schedule == "interleaved"
    config = _validated(["--hybrid-override-pattern", "M*M-"])
    assert config.model.hybrid_layer_pattern == "M*M-"
    assert config.notes == ["--hybrid-override-pattern is deprecated. Use --hybrid-layer-pattern instead."]
    config = _validated(["--hybrid-layer-pattern", "M+M-", "--kv-lora-rank", "16", "--qk-head-dim", "8",
                         "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--position-embedding-type",
                         "rope"])
    assert config.model.multi_latent_attention
    # Megatron's GPT path to gated delta nets: each layer a gated delta net (attention every 2nd) and its MLP
    # or experts (--moe-layer-freq), made the pattern that is then the whole model
    gdn = ["--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "8",
           "--linear-value-head-dim", "8", "--normalization", "RMSNorm"]
    config = _validated(["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq",
                         "2", "--num-experts", "4", "--moe-layer-freq", "[1,0,0,1]", *gdn])
    assert (config.model.hybrid_layer_pattern, config.model.num_layers) == ("GE*-G-*E", 8)
    assert config.notes == ["--experimental-attention-variant gated_delta_net: the layers are "
                            "--hybrid-layer-pattern 'GE*-G-*E'"]


@pytest.mark.parametrize("flags, world, message", [
    (["--hybrid-layer-pattern", "MG*-"], 1, "--normalization LayerNorm with gated delta nets (G): their "
     "output norm is built as an RMSNorm only"),
    (["--hybrid-layer-pattern", "MG*-", "--linear-num-key-heads", "3", "--linear-num-value-heads", "4",
      "--normalization", "RMSNorm"], 1,
     "--linear-num-value-heads 4 is not a multiple of --linear-num-key-heads 3"),
    (["--hybrid-layer-pattern", "G*G-", "--tensor-model-parallel-size", "4", "--linear-num-key-heads", "2",
      "--linear-num-value-heads", "4", "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
      "--normalization", "RMSNorm"], 4,
     "--tensor-model-parallel-size 4 does not divide --linear-num-key-heads 2"),
    (["--hybrid-layer-pattern", "G*G-", "--context-parallel-size", "4", "--linear-num-key-heads", "2",
      "--normalization", "RMSNorm"], 4,
     "--context-parallel-size 4 does not divide a tensor-parallel rank's 2 key heads"),
    (["--hybrid-layer-pattern", "K*K-"], 1, "--normalization LayerNorm with Kimi delta attention (K)"),
    (["--hybrid-layer-pattern", "K*K-", "--tensor-model-parallel-size", "4", "--linear-num-value-heads", "6",
      "--normalization", "RMSNorm"], 4,
     "--tensor-model-parallel-size 4 does not divide --linear-num-value-heads 6 (Kimi delta attention's"),
    (["--hybrid-layer-pattern", "K*K-", "--context-parallel-size", "4", "--linear-num-value-heads", "2",
      "--normalization", "RMSNorm"], 4,
     "--context-parallel-size 4 does not divide a tensor-parallel rank's 2 Kimi delta attention heads"),
    (["--experimental-attention-variant", "gdn", "--linear-attention-freq", "0"], 1,
     "--linear-attention-freq 0: give N >= 1 or one entry per layer"),
    (["--experimental-attention-variant", "gdn", "--linear-attention-freq", "2", "--num-layers", "3",
      "--pipeline-model-parallel-size", "2"], 2,
     "--pipeline-model-parallel-size 2 does not divide --num-layers 3 with --experimental-attention-variant"),
    (["--experimental-attention-variant", "gdn", "--linear-attention-freq", "2",
      "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"], 2,
     "--decoder-first-pipeline-num-layers with --experimental-attention-variant gdn: its layers split "
     "evenly"),
    (["--experimental-attention-variant", "gdn"], 1, "--experimental-attention-variant gdn needs "
     "--linear-attention-freq"),
    (["--experimental-attention-variant", "gdn", "--linear-attention-freq", "[1,0]"], 1,
     "--linear-attention-freq [1,0]: give N >= 1 or one entry per layer (--num-layers 4)"),
    (["--experimental-attention-variant", "gdn", "--linear-attention-freq", "2", "--hybrid-layer-pattern",
      "G*G-"], 1, "--experimental-attention-variant gdn beside --hybrid-layer-pattern: the variant builds"),
    (["--hybrid-layer-pattern", "MD-"], 1, "'D' (DeepSeek sparse attention): DeepSeek sparse attention (its "
     "indexer) is not built: use + (latent attention)"),
    (["--hybrid-layer-pattern", "M*M-/*-", "--mtp-num-layers", "2"], 1, "--mtp-num-layers 2 beside "
     "--hybrid-layer-pattern 'M*M-/*-' (1 depths after /): a hybrid's depths are the pattern's parts "
     "after /"),
    (["--hybrid-layer-pattern", "M-M-/D-"], 1, "'D' (DeepSeek sparse attention): DeepSeek sparse attention"),
    (["--hybrid-layer-pattern", "M*Mq"], 1, "'q' is not a layer symbol"),
    (["--hybrid-layer-pattern", "M*|M-|M-", "--pipeline-model-parallel-size", "2"], 2,
     "--hybrid-layer-pattern 'M*|M-|M-' has 3 pipeline segments, not a multiple of "
     "--pipeline-model-parallel-size 2"),
    (["--hybrid-layer-pattern", "M*||M-", "--pipeline-model-parallel-size", "3"], 3,
     "segment 1 (between its |) holds no layer"),
    (["--hybrid-layer-pattern", "M*|M-", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "1"], 2, "--decoder-first-pipeline-num-layers beside "
     "--hybrid-layer-pattern 'M*|M-': its | cut the pipeline"),
    (["--hybrid-layer-pattern", "M*M-", "--pipeline-model-parallel-size", "2", "--virtual-pipeline-size",
      "2"], 2, "--virtual-pipeline-size beside --hybrid-layer-pattern 'M*M-'"),
    (["--hybrid-layer-pattern", "M*M-", "--pipeline-model-parallel-layout", "Et|tL",
      "--pipeline-model-parallel-size", "2"], 2, "--pipeline-model-parallel-layout beside"),
    (["--hybrid-layer-pattern", "M*ME"], 1, "--hybrid-layer-pattern 'M*ME': E (mixture of experts) needs "
     "--num-experts"),
    (["--hybrid-layer-pattern", "M*M-", "--num-experts", "4"], 1, "--num-experts 4: --hybrid-layer-pattern "
     "'M*M-' has no E (mixture of experts) layer"),
    (["--hybrid-layer-pattern", "M*ME", "--num-experts", "4", "--moe-layer-freq", "2"], 1,
     "--moe-layer-freq beside --hybrid-layer-pattern 'M*ME': its E symbols place the experts"),
    (["--hybrid-layer-pattern", "M*M-", "--hybrid-override-pattern", "M*M-"], 1,
     "--hybrid-override-pattern and --hybrid-layer-pattern are one setting"),
    (["--hybrid-layer-pattern", "M*M-", "--norm-placement", "sandwich"], 1,
     "--norm-placement sandwich: a pattern's layers each have one norm, before their sublayer (or after it: "
     "--post-norm-layers)"),
    (["--hybrid-layer-pattern", "M*M-", "--post-norm-layers", "1", "4"], 1,
     "--post-norm-layers 1 4: give distinct layers of --hybrid-layer-pattern 'M*M-', 0 to 3"),
    (["--post-norm-layers", "1"], 1, "--post-norm-layers places the norms of a --hybrid-layer-pattern's "
     "layers; a GPT's blocks take --norm-placement"),
    (["--hybrid-layer-pattern", "M*M-", "--tensor-model-parallel-size", "4"], 4,
     "--tensor-model-parallel-size 4 does not divide --mamba-num-groups 2"),
    (["--hybrid-layer-pattern", "M*M-", "--mamba-num-heads", "3"], 1,
     "--mamba-num-groups 2 does not divide the 3 Mamba heads"),
    (["--hybrid-layer-pattern", "M*M-", "--mamba-head-dim", "24"], 1,
     "--mamba-head-dim 24 does not divide the inner width 2 x --hidden-size = 128"),
    (["--hybrid-layer-pattern", "M*M-", "--context-parallel-size", "4", "--mamba-num-heads", "6"], 4,
     "--context-parallel-size 4 does not divide a tensor-parallel rank's 6 Mamba heads (--mamba-num-heads 6 "
     "/ --tensor-model-parallel-size 1)"),
    (["--hybrid-layer-pattern", "M*M-", "--recompute-granularity", "selective", "--recompute-modules",
      "moe"], 1, "--recompute-modules moe: this model has no such part; its modules are core_attn, "
     "layernorm, mlp, mamba"),
])
def test_bad_hybrid_settings_name_the_flag(flags, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _validated(flags, world)


def test_a_pattern_without_attention_checks_no_heads():
    """An all-Mamba model (an imported Mamba2 says one attention head) splits over tp by its groups alone."""
    from models.config import GPTConfig

    config = GPTConfig(hybrid_layer_pattern="MM-", hidden_size=64, num_attention_heads=1, vocab_size=100,
                       mamba_head_dim=16, mamba_num_groups=2)
    assert not config.has_attention and GPTConfig(hybrid_layer_pattern="M*").has_attention
    config.validate(2)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 4 does not divide --mamba-num-groups"):
        config.validate(4)
