"""The RNG tracker: per-tp-rank streams inside parallel regions, shared ones outside, exact restore."""

import torch

from models.config import GPTConfig
from models.gpt import GPTModel
from parallel.process_groups import create_process_groups
from parallel.tensor.random import RNGTracker, model_parallel_tracker
from parallel.topology import Topology
from tests.world import run_world


def test_fork_leaves_the_default_stream_untouched():
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    tracker = RNGTracker()
    tracker.add("other", 99)
    with tracker.fork("other"):
        inside = torch.rand(4)
    assert torch.equal(torch.rand(4), expected)
    with tracker.fork("other"):
        assert not torch.equal(torch.rand(4), inside)  # the stream advanced


def test_saved_states_redraw_the_same_masks():
    tracker = model_parallel_tracker(seed=5, tp_rank=1)
    states = tracker.state_dict()
    with tracker.fork():
        first = torch.nn.functional.dropout(torch.ones(64), 0.5)
    outside = torch.rand(3)
    tracker.load_state_dict(states)
    with tracker.fork():
        assert torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), first)
    assert torch.equal(torch.rand(3), outside)


def _streams_across_tp(rank, world_size):
    groups = create_process_groups(Topology(world_size, tp=2))
    torch.manual_seed(7)
    tracker = model_parallel_tracker(seed=7, tp_rank=groups.tp_rank)
    with tracker.fork():
        inside = torch.rand(8)
    outside = torch.rand(8)
    config = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8, vocab_size=128,
                       hidden_dropout=0.5, attention_dropout=0.5)
    model = GPTModel(config, groups.tp, seed=1, post_process=False)
    tokens = torch.arange(8).view(1, 8)
    hidden = model(tokens, tokens)  # training mode: both dropouts on
    return inside, outside, hidden


def test_tp_ranks_share_the_default_stream_and_differ_inside_parallel_regions():
    (in0, out0, hidden0), (in1, out1, hidden1) = run_world(2, _streams_across_tp)
    assert not torch.equal(in0, in1)
    assert torch.equal(out0, out1)
    # attention dropout differed per rank (own heads), residual dropout did not: the replicated
    # hidden state after the block is the same on both tp ranks
    assert torch.equal(hidden0, hidden1)
