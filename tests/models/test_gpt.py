"""The GPT on its own (tp = 1): causality, shapes, parameter count, the loss, sampling."""

import math

import pytest
import torch
import torch.nn.functional as F

from models.config import GPTConfig
from models.counting import num_parameters
from models.generate import generate, single_stage_logits
from models.gpt import GPTModel
from parallel.comm import AxisGroup, CommStats
from tests.parity import NO_DROPOUT


def _alone() -> AxisGroup:
    return AxisGroup("tp", (0,), None, CommStats())


VARIANTS = [("learned", "LayerNorm"), ("rope", "RMSNorm")]


@pytest.mark.parametrize("positions, norm", VARIANTS)
def test_changing_token_t_changes_no_logit_before_t(positions, norm):
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=200,
                       position_embedding_type=positions, normalization=norm, **NO_DROPOUT)
    model = GPTModel(config, _alone(), seed=0)
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(16).expand(2, 16)
    before = model(tokens, position_ids)
    for t in (0, 7, 15):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % 200
        after = model(changed, position_ids)
        assert torch.equal(before[:t], after[:t])
        assert not torch.allclose(before[t:], after[t:])


@pytest.mark.parametrize("positions, norm", VARIANTS)
def test_parameter_count_and_loss_at_init(positions, norm):
    config = GPTConfig(num_layers=3, hidden_size=48, num_attention_heads=4, seq_length=16, vocab_size=300,
                       position_embedding_type=positions, normalization=norm, **NO_DROPOUT)
    model = GPTModel(config, _alone(), seed=0)
    assert sum(p.numel() for p in model.parameters()) == num_parameters(config)
    assert config.padded_vocab_size(1) == 384 and config.padded_vocab_size(4) == 512
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    loss = model(tokens, torch.arange(16).expand(2, 16), labels=labels)
    logits = model(tokens, torch.arange(16).expand(2, 16))[..., :300]
    reference = F.cross_entropy(logits.reshape(-1, 300), labels.t().reshape(-1),
                                reduction="none").view(16, 2).t()
    torch.testing.assert_close(loss, reference)
    assert abs(loss.mean().item() - math.log(300)) < 0.5  # near-uniform prediction at init


def test_initialisation_depends_on_seed_and_name_only():
    config = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=128,
                       **NO_DROPOUT)
    whole = dict(GPTModel(config, _alone(), seed=3).named_parameters())
    last_two = GPTModel(config, _alone(), seed=3, layer_indices=[2, 3], pre_process=False)
    for name, param in last_two.named_parameters():
        if name.startswith("layers."):
            local, rest = name.split(".", 2)[1:]
            assert torch.equal(param, whole[f"layers.{int(local) + 2}.{rest}"])
    assert torch.equal(last_two.output_layer.weight, whole["word_embedding.weight"])


def test_greedy_generation_is_deterministic_and_sampling_follows_the_seed():
    config = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8, vocab_size=64,
                       **NO_DROPOUT)
    logits = single_stage_logits(GPTModel(config, _alone(), seed=0).eval())
    greedy = generate(logits, [1, 2, 3], 12, window=8)
    assert greedy == generate(logits, [1, 2, 3], 12, window=8) and len(greedy) == 12
    assert all(0 <= t < 64 for t in greedy)
    sampled = generate(logits, [1, 2, 3], 12, window=8, temperature=1.0, top_k=5, seed=1)
    assert sampled == generate(logits, [1, 2, 3], 12, window=8, temperature=1.0, top_k=5, seed=1)
    assert sampled != greedy


def test_rms_norm_keeps_less_and_computes_torchs_rms_norm():
    from models.norms import Norm

    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    norm = Norm("RMSNorm", 8, 1e-5).double()
    torch.nn.init.normal_(norm.weight)
    assert torch.autograd.gradcheck(norm, (x,))
    torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, 1e-5))
    # the call of torch's fused kernels (GPUs), here on its composite CPU path: the same norm and gradient
    fused = x.detach().clone().requires_grad_()
    torch._fused_rms_norm(fused, [8], norm.weight, 1e-5)[0].sum().backward()
    norm(x).sum().backward()
    torch.testing.assert_close(fused.grad, x.grad)
    one_plus = Norm("LayerNorm", 8, 1e-5, one_plus=True).double()  # weights start at 0: a scale of 1
    assert not one_plus.weight.any()
    torch.testing.assert_close(one_plus(x), F.layer_norm(x, (8,), eps=1e-5))


@pytest.mark.parametrize("positions, norm", VARIANTS)
def test_packed_documents_give_the_loss_of_each_document_alone(positions, norm):
    """--reset-attention-mask and --reset-position-ids: three documents packed into one sequence (each
    ended by its end-of-document token) have, token for token, the loss each has run on its own."""
    from data.gpt_dataset import document_ids

    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, vocab_size=200,
                       position_embedding_type=positions, normalization=norm, **NO_DROPOUT)
    model = GPTModel(config, _alone(), seed=0)
    eod, generator = 199, torch.Generator().manual_seed(3)
    lengths = (7, 11, 6)
    pieces = [torch.cat([torch.randint(0, 199, (n - 1,), generator=generator), torch.tensor([eod])])
              for n in lengths]
    tokens = torch.cat(pieces).unsqueeze(0)
    labels = torch.randint(0, 199, tokens.shape, generator=generator)
    documents = document_ids(tokens, eod)
    assert documents.tolist() == [[0] * 7 + [1] * 11 + [2] * 6]
    restarted = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = model(tokens, restarted, labels=labels, documents=documents)
    alone, start = [], 0
    for n in lengths:
        alone.append(model(tokens[:, start:start + n], torch.arange(n).unsqueeze(0),
                           labels=labels[:, start:start + n]))
        start += n
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-6, atol=1e-6)
    crossing = model(tokens, torch.arange(24).unsqueeze(0), labels=labels)  # one 24-token document
    assert not torch.allclose(packed[:, 7:], crossing[:, 7:])
