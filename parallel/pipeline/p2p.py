"""Point-to-point exchange of activations and their gradients between pipeline stages.

Shapes are known in advance (every stage computes them from the config), so no shape handshake is
sent. Each exchange posts its sends and its receives as one batch (``post``); the executor waits for it
(``wait``) when it needs what the batch receives, or, for a batch that only sends, at its next exchange,
which frees the sent tensors then. Which transfers form a batch is decided by
``parallel.pipeline.timeline``: both sides of a transfer post it in their batch of the same tick. That
matters on NCCL, where a rank's point-to-point operations run in posting order on one stream and a send
completes only when the peer receives it: a send posted on its own ahead of a receive can wait for a
peer that is itself waiting in a send, and both stall.

The stages form a ring: the last stage's "next" is stage 0, which the interleaved schedule uses to
pass chunk c's output to chunk c + 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from parallel import comm
from parallel.comm import AxisGroup

# With two stages the ring makes both neighbours the same rank, so activations and gradients can
# travel the same direction between one pair (interleaving): gloo matches on the tag. NCCL ignores it
# and matches in posting order, which the fixed order of a batch (forward first) keeps consistent.
FORWARD, BACKWARD = 1, 2


@dataclass
class PostedBatch:
    """One posted batch of sends and receives: its handles, the sent tensors (alive until it completes)
    and the buffers it receives into."""

    handles: list
    sent: list[torch.Tensor]
    received: list[torch.Tensor]


class StageExchange:
    """Sends and receives of one pipeline rank over its pp group.

    Owns the receive buffers it allocates and the time spent waiting on neighbours. Never computes
    anything, never keeps a sent tensor after its batch's ``wait``, and never sends to a rank outside
    its pipeline group.
    """

    def __init__(self, pp: AxisGroup, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.pp, self.shape, self.dtype, self.device = pp, shape, dtype, device
        self.wait_seconds = 0.0  # time blocked on neighbours: the pipeline bubble plus transfer time

    def post(self, sends: list[tuple[torch.Tensor, int, int]],
             receives: list[tuple[int, int]]) -> PostedBatch:
        """Start one batch: ``sends`` (tensor, pipeline index of the peer, tag) and ``receives`` (pipeline
        index of the peer, tag) of tensors of this exchange's shape. The batch keeps the sent tensors until
        ``wait``; its received tensors are valid after it."""
        ranks = self.pp.ranks
        outgoing = [(tensor.detach().contiguous(), ranks[peer], tag) for tensor, peer, tag in sends]
        received = [torch.empty(self.shape, dtype=self.dtype, device=self.device) for _ in receives]
        incoming = [(buffer, ranks[peer], tag) for buffer, (peer, tag) in zip(received, receives)]
        handles = comm.batch_isend_irecv(outgoing, incoming, self.pp) if outgoing or incoming else []
        return PostedBatch(handles, [tensor for tensor, _, _ in outgoing], received)

    def wait(self, batch: PostedBatch) -> None:
        """Block until ``batch`` has completed (counted as waiting on neighbours); drop its sent tensors."""
        if batch.handles:
            started = time.perf_counter()
            for handle in batch.handles:
                handle.wait()
            self.wait_seconds += time.perf_counter() - started
        batch.handles, batch.sent = [], []
