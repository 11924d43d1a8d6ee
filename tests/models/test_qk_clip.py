"""QK-clip's rule on one process: after a clip, each clipped query group (grouped attention) or head (latent
attention) reaches the threshold exactly on the same input, the others are untouched."""

import pytest
import torch

from models.config import GPTConfig
from models.gpt import GPTModel
from parallel.comm import DetachedGroup

GROUPED = dict(group_query_attention=True, num_query_groups=2)
LATENT = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
              qk_pos_emb_head_dim=4, v_head_dim=12)


@pytest.mark.parametrize("kind", [GROUPED, LATENT], ids=["grouped", "latent"])
def test_a_clip_brings_the_largest_logit_of_each_clipped_head_to_the_threshold(kind):
    config = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                       position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0, **kind)
    torch.manual_seed(0)
    gpt = GPTModel(config, DetachedGroup("tp", 1), seed=0).train()
    core = gpt.layers[0].attention
    with torch.no_grad():  # logits well above 1, spread over the heads
        for weight, factor in zip(core.clip_factors(torch.full((4,), 2.0), 1.0, 0.5), (6.0, 6.0)):
            weight.mul_(factor)
    core.track_logits()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)

    def maxima() -> torch.Tensor:
        with torch.no_grad():
            gpt(tokens, positions)
        found = core.take_max_logits()
        return found.view(2, 2).amax(dim=1) if kind is GROUPED else found  # a group shares its key

    before = maxima()
    threshold = float(before.sort().values[len(before) // 2 - 1] + before.sort().values[len(before) // 2]) / 2
    assert core.clip_factors(torch.full((4,), threshold / 2), threshold, 0.5) == {}
    per_head = _per_head(before, kind)
    with torch.no_grad():
        for weight, factor in core.clip_factors(per_head, threshold, 0.3).items():
            weight.mul_(factor.view(-1, *[1] * (weight.ndim - 1)))
    after = maxima()
    clipped = before > threshold
    assert clipped.any() and not clipped.all() and per_head.numel() == 4
    assert torch.allclose(after[clipped], torch.full_like(after[clipped], threshold), rtol=1e-5)
    assert torch.equal(after[~clipped], before[~clipped])


def _per_head(maxima: torch.Tensor, kind) -> torch.Tensor:
    """Per-head maxima whose group maxima are ``maxima`` (grouped: each head of a group at its group's)."""
    return maxima.repeat_interleave(2) if kind is GROUPED else maxima
