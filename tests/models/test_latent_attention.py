"""Multi-head latent attention on one process: DeepSeek's uncompressed-query form with plain (not
interleaved) rotary pairs against transformers' own DeepSeek-V3 code, and the key/value cache a token costs
as the layers hold it. (Its layouts: tests/pretrain/test_moe.py; the query latent under yarn against
transformers: tests/pretrain/test_hf_moe.py.)"""

import pytest
import torch

from models.config import GPTConfig
from models.counting import kv_cache_values_per_token, stage_model

transformers = pytest.importorskip("transformers")


def test_uncompressed_queries_and_plain_rotary_pairs_give_transformers_logits(tmp_path):
    from pretrain.interop.load_model import load_model

    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=8,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10, rope_interleave=False,
        max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.add_(torch.randn(param.shape) * 0.1)
    theirs.save_pretrained(str(tmp_path))
    batch = torch.tensor([list(range(3, 23)), list(range(40, 60))])
    with torch.no_grad():
        want = theirs(batch).logits
        ours = load_model(str(tmp_path))
        got = ours(batch)
    assert ours.config.q_lora_rank is None and not ours.config.rotary_interleaved
    assert ((got - want).norm() / want.norm()).item() < 1e-5  # the interop bound (tests/pretrain)


def test_the_key_value_cache_per_token_is_what_the_layers_hold():
    """Latent attention keeps a token's key/value latent and shared rotary key (kv_down's output); grouped-
    query attention every group's key and value (the K and V rows of the fused projection)."""
    latent = GPTConfig(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=100,
                       multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                       v_head_dim=8, position_embedding_type="rope")
    grouped = GPTConfig(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=100,
                        group_query_attention=True, num_query_groups=2)
    chunk = stage_model(latent)[0]
    assert kv_cache_values_per_token(latent) == sum(layer.attention.kv_down.weight.shape[0]
                                                    for layer in chunk.layers) == 3 * 20
    chunk = stage_model(grouped)[0]
    queries = grouped.num_attention_heads * grouped.head_dim
    assert kv_cache_values_per_token(grouped) == sum(layer.attention.qkv.weight.shape[0] - queries
                                                     for layer in chunk.layers) == 3 * 2 * 2 * 16
