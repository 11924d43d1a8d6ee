"""Context parallelism's attention against full attention on one process, its bytes against the planner's
formula, and its sequence cut."""

import pytest
import torch

from launch.tools.planning.layout import Layout
from launch.tools.planning.layout_price import context_bytes
from models.config import GPTConfig
from parallel.context import ContextParallel, ScoreOptions, context_attention, shard_sequence, token_indices
from parallel.context.sharding import unshard_sequence
from parallel.process_groups import create_process_groups
from parallel.saved_activations import SavedActivationMeter
from parallel.topology import Topology
from tests.parity import ONE_STEP_RTOL, assert_tensors_close
from tests.world import run_world

BF16_RTOL = 3e-2  # bf16 inputs and outputs: a few of bf16's 2^-8 steps of the largest entry


def test_zigzag_cut_balances_causal_work_and_round_trips():
    assert token_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert token_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    whole = torch.arange(48).view(2, 24)
    pieces = [shard_sequence(whole, 3, rank) for rank in range(3)]
    assert torch.equal(unshard_sequence(pieces), whole)
    for cp in (2, 4, 8):  # every rank attends to the same number of (query, key) chunk pairs
        work = {sum(chunk + 1 for chunk in (rank, 2 * cp - 1 - rank)) for rank in range(cp)}
        assert work == {2 * cp + 1}
    with pytest.raises(ValueError,
                       match="--seq-length 30 is not a multiple of 2 x --context-parallel-size 4"):
        token_indices(30, 4, 0)


def _documents(batch: int, length: int, generator) -> torch.Tensor:
    """Each token's document: a few random boundaries per sequence."""
    starts = torch.rand(batch, length, generator=generator) < 0.15
    starts[:, 0] = False
    return starts.long().cumsum(dim=1)


def _reference(q, k, v, grad, documents, window=None, softcap=None):
    """Full attention on one process, written out: scores, cap, causal / window / document mask."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    b, heads, length, d = q.shape
    grouped = q.view(b, k.shape[1], heads // k.shape[1], length, d)
    scores = torch.einsum("bgqsd,bgtd->bgqst", grouped, k) * d ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    mask = (j <= i) & ((i - j < window) if window is not None else True)
    if documents is not None:
        mask = mask & (documents[:, :, None] == documents[:, None, :])[:, None, None]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = torch.einsum("bgqst,bgtd->bgqsd", probs, v).reshape(b, heads, length, d)
    out.backward(grad)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


# (dtype, packed documents, sliding window, soft-capping) of each case
CASES = ((torch.float32, False, None, None), (torch.float32, True, None, None),
         (torch.bfloat16, False, None, None), (torch.float32, True, 6, None), (torch.float32, False, 11, 3.0))


def _attention_against_one_process(rank, world_size):
    """Output and input gradients of every comm type at cp 2 and 4 equal full attention's on this rank's
    tokens: causal, grouped queries, an uneven head count, packed documents, a sliding window (cutting and
    skipping chunk pairs), soft-capped scores, fp32 and bf16."""
    checked, kept = [], {}
    for cp in (2, 4):
        group = create_process_groups(Topology(world_size, cp=cp)).cp
        for kind in ("p2p", "a2a", "allgather"):
            for heads, groups in ((8, 8), (8, 4), (6, 3), (6, 2)):
                if kind == "a2a" and groups % cp:
                    continue  # refused: the key/value groups do not divide by cp
                for dtype, documents_on, window, softcap in CASES:
                    generator = torch.Generator().manual_seed(heads * 10 + groups)
                    b, length, d = 2, 32, 16
                    q = torch.randn(b, heads, length, d, generator=generator).to(dtype)
                    k, v = (torch.randn(b, groups, length, d, generator=generator).to(dtype) for _ in "kv")
                    grad = torch.randn(b, heads, length, d, generator=generator).to(dtype)
                    documents = _documents(b, length, generator) if documents_on else None
                    want = _reference(q.float(), k.float(), v.float(), grad.float(), documents, window,
                                      softcap)
                    mine = [shard_sequence(t, cp, group.rank, dim=2).clone().requires_grad_()
                            for t in (q, k, v)]
                    group.stats.reset()
                    meter = SavedActivationMeter()
                    with meter.recording():
                        out = context_attention(*mine, ContextParallel(group, (kind,)), 0,
                                                ScoreOptions(d ** -0.5, window, softcap), documents=documents)
                    kept[kind, cp, heads, groups, dtype, documents_on, window, softcap] = meter.peak_bytes
                    out.backward(shard_sequence(grad, cp, group.rank, dim=2))
                    sent = group.stats.bytes_by_axis()["cp"]
                    config = GPTConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                                       group_query_attention=groups < heads, num_query_groups=groups,
                                       seq_length=length)  # what the planner prices this attention at
                    predicted = sum(context_bytes(config, Layout(1, 1, 1, 0, micro_batch_size=b, cp=cp),
                                                  q.element_size(), kind))
                    assert sent == pytest.approx(predicted, rel=1e-9), (kind, cp, sent, predicted)
                    got = [out.detach(), *(t.grad for t in mine)]
                    assert all(t.dtype == dtype for t in got)
                    what = (f"cp {cp} {kind} heads {heads}/{groups} {dtype} documents {documents_on} "
                            f"window {window} softcap {softcap}")
                    assert_tensors_close([t.float() for t in got],
                                         [shard_sequence(t, cp, group.rank, dim=2) for t in want], what,
                                         ONE_STEP_RTOL if dtype == torch.float32 else BF16_RTOL)
                    checked.append(what)
        if cp == 4:
            q, k = torch.zeros(1, 6, 8, 4), torch.zeros(1, 2, 8, 4)
            with pytest.raises(ValueError,
                               match="2 key/value groups per tensor-parallel rank do not divide by "
                                                 "--context-parallel-size 4"):
                context_attention(q, k, k, ContextParallel(group, ("a2a",)), 0, ScoreOptions(0.5))
    return len(checked), kept


def test_context_attention_equals_full_attention():
    """Every kind equals full attention, sends the bytes the planner prices, and keeps about 1/cp of the
    sequence for backward: all-gather attention gathers the keys and values again in backward rather than
    keep them (at most 1.1x of ring attention's bytes, which keeps its output and log-sum-exp besides)."""
    (count, kept), *_ = run_world(4, _attention_against_one_process, timeout_s=300)
    assert count == 2 * (3 * 4 - 1) * len(CASES) - len(CASES)  # cp 4 skips a2a at 6/2 too
    for (kind, *case), held in kept.items():
        if kind == "allgather":
            assert held <= 1.1 * kept[("p2p", *case)], (case, held, kept[("p2p", *case)])


def _replayed_keep_mask(cp, length, shape, dropout, seed):
    """The whole [b, G, Q, S, S] mask of kept attention probabilities that ring attention draws on every
    cp rank (rank r's stream seeded seed + r), replayed in its order of steps and chunk pairs."""
    from parallel.context.zigzag_blocks import _pairs
    from parallel.context.sharding import chunk_ids
    from parallel.tensor.random import TENSOR_PARALLEL_STREAM, RNGTracker

    chunk = length // (2 * cp)
    keep = torch.zeros(*shape, length, length, dtype=torch.bool)
    for rank in range(cp):
        tracker = RNGTracker()
        tracker.add(TENSOR_PARALLEL_STREAM, seed + rank)
        mine = chunk_ids(cp, rank)
        for step in range(cp):
            theirs = chunk_ids(cp, (rank - step) % cp)
            for a, b, _, _ in _pairs(mine, theirs, chunk, None, None, "cpu"):
                with tracker.fork(TENSOR_PARALLEL_STREAM):
                    drawn = torch.rand(*shape, chunk, chunk) >= dropout
                rows, cols = mine[a] * chunk, theirs[b] * chunk
                keep[..., rows:rows + chunk, cols:cols + chunk] = drawn
    return keep


def _ring_dropout_against_its_replay(rank, world_size):
    """Ring and all-gather attention with attention dropout: output and gradients equal the explicit
    attention of one process under the same kept probabilities (each cp rank's stream replayed: both meet
    the blocks in the same order)."""
    from parallel.tensor.random import TENSOR_PARALLEL_STREAM, RNGTracker

    for cp in (2, 4):
        group = create_process_groups(Topology(world_size, cp=cp)).cp
        generator = torch.Generator().manual_seed(7)
        b, heads, groups, length, d, dropout = 1, 4, 2, 16, 8, 0.3
        q = torch.randn(b, heads, length, d, generator=generator)
        k, v = (torch.randn(b, groups, length, d, generator=generator) for _ in "kv")
        grad = torch.randn(b, heads, length, d, generator=generator)
        keep = _replayed_keep_mask(cp, length, (b, groups, heads // groups), dropout, seed=100)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        grouped = full[0].view(b, groups, heads // groups, length, d)
        scores = torch.einsum("bgqsd,bgtd->bgqst", grouped, full[1]) * d ** -0.5
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1) * keep / (1 - dropout)
        want = torch.einsum("bgqst,bgtd->bgqsd", probs, full[2]).reshape(b, heads, length, d)
        want.backward(grad)
        for kind in ("p2p", "allgather"):
            tracker = RNGTracker()
            tracker.add(TENSOR_PARALLEL_STREAM, 100 + group.rank)
            mine = [shard_sequence(t, cp, group.rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
            out = context_attention(*mine, ContextParallel(group, (kind,)), 0, ScoreOptions(d ** -0.5),
                                    dropout=dropout, rng=tracker)
            out.backward(shard_sequence(grad, cp, group.rank, dim=2))
            assert_tensors_close([out.detach(), *(t.grad for t in mine)],
                                 [shard_sequence(t, cp, group.rank, dim=2)
                                  for t in (want.detach(), *(t.grad for t in full))],
                                 f"cp {cp} {kind} attention with dropout", ONE_STEP_RTOL)
    return True


def test_ring_and_allgather_attention_dropout_follows_each_cp_ranks_stream():
    assert all(run_world(4, _ring_dropout_against_its_replay))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on the CPU
def test_flexattention_block_masks_equal_the_dense_document_mask(monkeypatch):
    """``DocumentBlocks`` (FlexAttention's block masks, used on GPUs) computes what the dense document mask
    computes: the kernel alone (grouped queries, global and windowed) and a whole model's logits. Forward
    only: on the CPU FlexAttention has no backward (the GPU check runs both)."""
    from models.gpt import GPTModel
    from parallel import context
    from parallel.comm import AxisGroup, CommStats
    from parallel.context import DocumentBlocks, attend, sequence_mask

    generator = torch.Generator().manual_seed(3)
    documents = _documents(2, 128, generator)
    q = torch.randn(2, 4, 128, 16, generator=generator)
    k, v = (torch.randn(2, 2, 128, 16, generator=generator) for _ in range(2))
    blocks = DocumentBlocks(documents, {None, 40})
    with torch.no_grad():
        for window in (None, 40):
            mask = sequence_mask(128, window, documents, q.device)
            dense = attend(q, k, v, ScoreOptions(0.25, window), mask)
            assert_tensors_close([blocks.attend(q, k, v, window, 0.25)], [dense], f"flex window {window}",
                                 ONE_STEP_RTOL)
        config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                           group_query_attention=True, seq_length=128, vocab_size=96, hidden_dropout=0.0,
                           attention_dropout=0.0, position_embedding_type="rope", window_size=[39, 0],
                           window_attn_skip_freq=[2])
        model = GPTModel(config, AxisGroup("tp", (0,), None, CommStats()), seed=1).eval()
        tokens = torch.randint(0, 96, (2, 128), generator=generator)
        positions = torch.arange(128).expand(2, 128)
        dense = model(tokens, positions, documents=documents)
        monkeypatch.setattr(context.document_blocks, "DEVICES", ("cpu",))
        windows = []
        original = DocumentBlocks.attend
        monkeypatch.setattr(DocumentBlocks, "attend",
                            lambda self, *args: windows.append(args[3]) or original(self, *args))
        flex = model(tokens, positions, documents=documents)
    assert windows == [40, None]  # both layers through the block masks: the windowed one, the global one
    assert_tensors_close([flex], [dense], "model logits through block masks", ONE_STEP_RTOL)
