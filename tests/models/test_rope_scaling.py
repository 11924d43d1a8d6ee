"""Rotary scaling equals transformers' own rotary embedding for every rope_type it defines."""

import pytest
import torch

from models.config import GPTConfig
from models.rotary import rotary_tables

ORIGINAL, LENGTH, BASE = 32, 96, 10000.0  # a trained length beyond the original: every kind changes


def _ours(kind: str, **fields) -> GPTConfig:
    config = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=LENGTH,
                       position_embedding_type="rope", rotary_base=BASE, rope_scaling_type=kind,
                       rope_scaling_factor=4.0, rope_original_max_position_embeddings=ORIGINAL, **fields)
    config.validate(1)
    return config


CASES = {
    "linear": ({}, {"factor": 4.0}),
    "dynamic": ({}, {"factor": 4.0}),
    "yarn": ({"rope_beta_fast": 16.0, "rope_beta_slow": 2.0},
             {"factor": 4.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 16.0,
              "beta_slow": 2.0}),
    "llama3": ({"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0},
               {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL}),
    "longrope": ({"rope_short_factor": [1.0 + i / 10 for i in range(8)],
                  "rope_long_factor": [2.0 + i for i in range(8)]},
                 {"factor": 4.0, "short_factor": [1.0 + i / 10 for i in range(8)],
                  "long_factor": [2.0 + i for i in range(8)], "original_max_position_embeddings": ORIGINAL}),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_rotary_tables_equal_transformers_rotary_embedding(kind):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    fields, parameters = CASES[kind]
    # dynamic scales against max_position_embeddings in transformers, the others against the original
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                     max_position_embeddings=ORIGINAL if kind == "dynamic" else LENGTH,
                     rope_parameters={"rope_type": kind, "rope_theta": BASE, **parameters})
    embedding = LlamaRotaryEmbedding(hf)
    positions = torch.arange(LENGTH).unsqueeze(0)
    cos, sin = embedding(torch.zeros(1, LENGTH, 16), positions)  # [b, s, d]
    ours_cos, ours_sin = rotary_tables(_ours(kind, **fields), positions)  # [s, b, 1, d]
    torch.testing.assert_close(ours_cos[:, 0, 0], cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_sin[:, 0, 0], sin[0], rtol=1e-6, atol=1e-6)
    plain_cos, _ = rotary_tables(_ours("none"), positions)
    assert (ours_cos - plain_cos).abs().max() > 1e-3  # the scaling changes the frequencies here
    if kind in ("dynamic", "longrope"):  # an input within the original length: its own regime, as theirs
        short = positions[:, :ORIGINAL // 2]
        cos, _ = LlamaRotaryEmbedding(hf)(torch.zeros(1, short.shape[1], 16), short)
        short_cos, _ = rotary_tables(_ours(kind, **fields), short)
        torch.testing.assert_close(short_cos[:, 0, 0], cos[0], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(short_cos, ours_cos[:short.shape[1]])  # another regime than the long input


def test_use_rope_scaling_is_llama3_and_bad_longrope_factors_are_named():
    assert GPTConfig(use_rope_scaling=True).rope_scaling == "llama3"
    with pytest.raises(ValueError, match="--rope-short-factor needs one factor per rotary channel pair"):
        _ours("longrope", rope_long_factor=[1.0] * 8)
    with pytest.raises(ValueError, match="--rope-low-freq-factor"):
        _ours("llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0)
