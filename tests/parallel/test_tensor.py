"""Tensor and sequence parallelism against the tp = 1 model and torch's own ops."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models.config import GPTConfig
from models.gpt import GPTModel
from models.layers.block import TransformerBlock
from parallel.tensor.random import model_parallel_tracker
from parallel.comm import AxisGroup, CommStats
from parallel.process_groups import create_process_groups
from parallel.saved_activations import SavedActivationMeter
from parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from parallel.topology import Topology
from parallel.zero.grad_sync import ModelParallelGroups, reduce_model_parallel_grad
from tests.parity import NO_DROPOUT, ONE_STEP_RTOL, assert_within
from tests.world import run_world

CONFIG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
              vocab_size=500, **NO_DROPOUT)


def _alone() -> AxisGroup:
    return AxisGroup("tp", (0,), None, CommStats())


def _cross_entropy_against_torch(rank, world_size, tp):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 3, 512, generator=generator, dtype=torch.float64)
    target = torch.randint(0, 500, (8, 3), generator=generator)
    full = logits.clone().requires_grad_()
    reference = F.cross_entropy(full[..., :500].reshape(-1, 500), target.reshape(-1),
                                reduction="none").view(8, 3)
    reference.sum().backward()
    group = create_process_groups(Topology(4, tp=tp)).tp
    shard = logits.chunk(tp, dim=-1)[group.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, group, valid_vocab=500)
    loss.sum().backward()
    return ((loss - reference).abs().max().item(),
            (shard.grad - full.grad.chunk(tp, dim=-1)[group.rank]).abs().max().item())


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_tensor_in_loss(rank, world_size, tp):
    group = create_process_groups(Topology(4, tp=tp)).tp
    config = GPTConfig(**{**CONFIG, "vocab_size": 512})
    model = GPTModel(config, group, seed=0)
    tokens = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(32).expand(4, 32)
    with _LargestTensor() as mode:
        model(tokens, positions, labels=tokens).mean().backward()
    return mode.largest


def _gathered(param: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """The full gradient of a tensor-parallel slice, concatenated along its partition dim."""
    from parallel.param_meta import meta
    from parallel.tensor.mappings import all_gather_dim0

    if not meta(param).tensor_parallel:
        return param.grad
    dim = meta(param).partition_dim
    return all_gather_dim0(param.grad.movedim(dim, 0).contiguous(), group).movedim(0, dim)


LLAMA = dict(normalization="RMSNorm", swiglu=True, ffn_hidden_size=96, position_embedding_type="rope",
             rotary_base=500000.0, group_query_attention=True, untie_embeddings_and_output_weights=True,
             disable_bias_linear=True, qk_layernorm=True, apply_layernorm_1p=True)
ARCHITECTURES = {"learned": {}, "rope": {"position_embedding_type": "rope"},
                 "llama, 2 groups": {**LLAMA, "num_query_groups": 2},  # SwiGLU's gate and up split alike
                 "llama, 8 heads in 4 groups": {**LLAMA, "num_attention_heads": 8, "num_query_groups": 4,
                                                "kv_channels": 16, "rotary_percent": 0.5}}


def _gradients_match_tp1(rank, world_size, tp, sequence_parallel, architecture):
    config = GPTConfig(**{**CONFIG, **ARCHITECTURES[architecture]})
    tokens = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(32).expand(2, 32)
    reference = GPTModel(config, _alone(), seed=3)
    ref_loss = reference(tokens, positions, labels=tokens).mean()
    ref_loss.backward()
    groups = create_process_groups(Topology(4, tp=tp))
    model = GPTModel(config, groups.tp, seed=3, sequence_parallel=sequence_parallel)
    loss = model(tokens, positions, labels=tokens).mean()
    loss.backward()
    for param in model.parameters():
        reduce_model_parallel_grad(param, param.grad, ModelParallelGroups(tp=groups.tp))
    worst = 0.0
    ref_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        want = ref_grads[name].grad
        got = _gathered(param, groups.tp)
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return abs(loss.item() - ref_loss.item()) / ref_loss.item(), worst


def _saved_bytes_per_layer(rank, world_size, tp, sequence_parallel):
    s, b, h, a = 64, 2, 128, 4
    config = GPTConfig(num_layers=1, hidden_size=h, num_attention_heads=a, seq_length=s, vocab_size=512,
                       **NO_DROPOUT)
    group = create_process_groups(Topology(4, tp=tp)).tp
    block = TransformerBlock(config, 0, group, 0, sequence_parallel, model_parallel_tracker(0, group.rank))
    x = torch.randn(s // tp if sequence_parallel else s, b, h, requires_grad=True)
    meter = SavedActivationMeter()
    with meter.recording():
        block(x).sum().backward()
    return meter.peak_bytes, s * b * h


def _each(rank, world_size, fn, cases):
    """Run ``fn`` for every case in one world (starting a world costs seconds)."""
    return [fn(rank, world_size, *case) for case in cases]


def test_vocab_parallel_cross_entropy_equals_torch():
    for per_case in run_world(4, _each, _cross_entropy_against_torch, [(2,), (4,)]):
        for loss_error, grad_error in per_case:
            assert loss_error < 1e-12 and grad_error < 1e-12


class _FreshBuffers(TorchDispatchMode):
    """Counts the [s, b, vocab] buffers the ops make (outputs of ``numel`` elements that reuse no input)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.made = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.numel() == self.numel
                    and t.untyped_storage().data_ptr() not in inputs):
                self.made.append((str(func), t.dtype))
        return out


def test_the_loss_works_in_chunks_and_keeps_only_the_logits():
    """Forward makes no [s, b, vocab/tp] buffer at all, in fp32 or bf16: its fp32 temporaries are chunks of
    rows (a quarter of the logits here; it made one fp32 copy of them all before, four before that); what
    backward keeps is the logits (2 bytes per entry under bf16) and the per-token max and sum, and the
    softmax it makes again chunk by chunk gives the very gradient of the fp32 path; a chunk never changes a
    value (one chunk, or many, bit for bit)."""
    s, b, vocab = 32, 4, 512
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(s, b, vocab, generator=generator)
    target = torch.randint(0, 500, (s, b), generator=generator)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        shard = logits.to(dtype, copy=True).requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with _FreshBuffers(s * b * vocab) as forward:
                loss = vocab_parallel_cross_entropy(shard, target, _alone(), valid_vocab=500,
                                                    chunk_elements=s * b * vocab // 4)
        loss.sum().backward()
        whole = shard.detach().clone().requires_grad_()
        unchunked = vocab_parallel_cross_entropy(whole, target, _alone(), valid_vocab=500)
        unchunked.sum().backward()
        assert torch.equal(loss, unchunked) and torch.equal(shard.grad, whole.grad), dtype
        saved_bytes = sum(t.numel() * t.element_size() for t in saved)
        results[dtype] = (forward.made, saved_bytes, shard.grad)
    entries = s * b * vocab
    small = s * b * (8 + 1 + 4 + 4)  # target ids, outside mask, fp32 max and sum
    for dtype, entry_bytes in ((torch.float32, 4), (torch.bfloat16, 2)):
        made, saved_bytes, _ = results[dtype]
        assert made == [], made
        assert entries * entry_bytes <= saved_bytes <= entries * entry_bytes + small, (dtype, saved_bytes)
    grad = results[torch.bfloat16][2]
    fp32_path = logits.to(torch.bfloat16).float().requires_grad_()
    vocab_parallel_cross_entropy(fp32_path, target, _alone(), valid_vocab=500).sum().backward()
    assert torch.equal(grad, fp32_path.grad.to(torch.bfloat16))


def test_no_rank_holds_more_than_a_vocab_slice_of_the_logits():
    largest = run_world(4, _largest_tensor_in_loss, 4)
    s, b, vocab = 32, 4, 512
    assert all(value == s * b * vocab // 4 for value in largest)  # the logits shard is the largest tensor


@pytest.mark.parity
def test_gathered_gradients_match_tp1():
    """One forward and backward: partial sums over tp ranks against whole matmuls. A gradient is
    measured against its largest entry; it comes out of the backward of every layer above it, so it
    gets ten times the loss's one-step bound."""
    cases = [(2, False, "learned"), (4, False, "rope"), (2, True, "learned"), (4, True, "learned"),
             (2, False, "llama, 2 groups"), (2, True, "llama, 2 groups"),
             (4, True, "llama, 8 heads in 4 groups")]
    for per_case in run_world(4, _each, _gradients_match_tp1, cases):
        for case, (loss_error, grad_error) in zip(cases, per_case):
            assert_within(loss_error, f"tp loss {case}", ONE_STEP_RTOL)
            assert_within(grad_error, f"tp gradients {case}", 10 * ONE_STEP_RTOL)


def test_saved_activations_per_layer_follow_korthikanti():
    """Korthikanti et al. count sbh(10 + 24/t + 5as/(ht)) bytes per layer in 16-bit with dropout. Our
    layer in fp32 without dropout, with fused (flash) attention that keeps no s x s matrix, keeps
    4 sbh of replicated tensors (two norm inputs and outputs) and 12 sbh / t of split ones (qkv 3,
    attention output 1, which the projection reads as a view, fc1 output 4, GELU output 4), 4 bytes
    each: 4 sbh (4 + 12/t); with sequence parallelism everything is split: 4 sbh (16/t)."""
    cases = [(1, False), (2, False), (2, True), (4, False), (4, True)]
    measured = {}
    for (tp, sp), (peak, sbh) in zip(cases, run_world(4, _each, _saved_bytes_per_layer, cases)[0]):
        expected = 4 * sbh * (16 / tp if sp else 4 + 12 / tp)
        measured[(tp, sp)] = peak
        assert abs(peak - expected) / expected < 0.03, (tp, sp, peak, expected)
    assert measured[(1, False)] / measured[(2, False)] > 1.4
    assert measured[(1, False)] / measured[(2, True)] > 1.95
