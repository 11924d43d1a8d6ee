"""Point-to-point exchange of activations and their gradients between pipeline stages.

Shapes are known in advance (every stage computes them from the config), so no shape handshake is
sent. Each exchange posts its sends and its receives as one batch and waits for all of them. Which
transfers form a batch is decided by ``parallel.pipeline.timeline``: both sides of a transfer post it
in their batch of the same tick. That matters on NCCL, where a rank's point-to-point operations run in
posting order on one stream and a send completes only when the peer receives it: a send posted on
its own ahead of a receive can wait for a peer that is itself waiting in a send, and both stall.
Waiting for the sends also frees every sent tensor as soon as it has arrived, so a stage holds no
boundary tensor beyond the activations its schedule keeps.

The stages form a ring: the last stage's "next" is stage 0, which the interleaved schedule uses to
pass chunk c's output to chunk c + 1.
"""

from __future__ import annotations

import time

import torch

from parallel import comm
from parallel.comm import AxisGroup

# With two stages the ring makes both neighbours the same rank, so activations and gradients can
# travel the same direction between one pair (interleaving): gloo matches on the tag. NCCL ignores it
# and matches in posting order, which the fixed order of a batch (forward first) keeps consistent.
FORWARD, BACKWARD = 1, 2


class StageExchange:
    """Sends and receives of one pipeline rank over its pp group.

    Owns the receive buffers it allocates and the time spent waiting on neighbours. Never computes
    anything, never keeps a sent tensor after its exchange returns, and never sends to a rank outside
    its pipeline group.
    """

    def __init__(self, pp: AxisGroup, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.pp, self.shape, self.dtype, self.device = pp, shape, dtype, device
        self.wait_seconds = 0.0  # time blocked on neighbours: the pipeline bubble plus transfer time

    def exchange(self, send_forward: torch.Tensor | None = None, send_backward: torch.Tensor | None = None,
                 recv_forward: bool = False, recv_backward: bool = False) -> tuple[torch.Tensor | None, ...]:
        """One batch: send an activation to the next stage and/or a gradient to the previous one, receive
        the activation from the previous stage and/or the gradient from the next one; return the
        received (forward input, backward gradient), None where not asked for."""
        index, size = self.pp.rank, self.pp.size
        sends = [(tensor, peer, tag) for tensor, peer, tag in
                 ((send_forward, (index + 1) % size, FORWARD), (send_backward, (index - 1) % size, BACKWARD))
                 if tensor is not None]
        wanted = [(peer, tag) for peer, tag, asked in
                  (((index - 1) % size, FORWARD, recv_forward), ((index + 1) % size, BACKWARD, recv_backward))
                  if asked]
        received = dict(zip((tag for _, tag in wanted), self.transfer(sends, wanted)))
        return received.get(FORWARD), received.get(BACKWARD)

    def transfer(self, sends: list[tuple[torch.Tensor, int, int]],
                 receives: list[tuple[int, int]]) -> list[torch.Tensor]:
        """One batch: ``sends`` (tensor, pipeline index of the peer, tag) and ``receives`` (pipeline index of
        the peer, tag) of tensors of this exchange's shape; returns the received tensors in order. Blocks
        until every operation of the batch has completed."""
        ranks = self.pp.ranks
        outgoing = [(tensor.detach().contiguous(), ranks[peer], tag) for tensor, peer, tag in sends]
        received = [torch.empty(self.shape, dtype=self.dtype, device=self.device) for _ in receives]
        incoming = [(buffer, ranks[peer], tag) for buffer, (peer, tag) in zip(received, receives)]
        if outgoing or incoming:
            started = time.perf_counter()
            for handle in comm.batch_isend_irecv(outgoing, incoming, self.pp):
                handle.wait()
            self.wait_seconds += time.perf_counter() - started
        return received
