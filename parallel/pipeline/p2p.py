"""Point-to-point exchange of activations and their gradients between neighbouring pipeline stages.

Shapes are known in advance (every stage computes them from the config), so no shape handshake is
sent. Sends are posted asynchronously and only waited for at the end of the step, receives block:
with schedules whose per-pair send and receive orders agree, a rank only ever waits for a tensor its
neighbour is certain to send, so neighbours never deadlock. The stages form a ring: the last stage's
"next" is stage 0, which the interleaved schedule uses to pass chunk c's output to chunk c + 1.
"""

from __future__ import annotations

import time

import torch

from parallel import comm
from parallel.comm import AxisGroup

# With two stages the ring makes both neighbours the same rank, so activations and gradients can
# travel the same direction between one pair (interleaving): separate streams by tag.
_FORWARD, _BACKWARD = 1, 2


class StageExchange:
    """Sends and receives of one pipeline rank over its pp group.

    Owns the in-flight send handles (and the tensors they read, kept alive until sent). Never
    computes anything and never sends to a rank outside its pipeline group.
    """

    def __init__(self, pp: AxisGroup, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.pp, self.shape, self.dtype, self.device = pp, shape, dtype, device
        index = pp.rank
        self.prev_rank = pp.ranks[(index - 1) % pp.size]
        self.next_rank = pp.ranks[(index + 1) % pp.size]
        self._pending: list[tuple[object, torch.Tensor]] = []
        self.wait_seconds = 0.0  # time blocked on neighbours: the pipeline bubble plus transfer time

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        for handle in comm.batch_isend_irecv([(tensor, dst)], [], self.pp, tag=tag):
            self._pending.append((handle, tensor))

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        started = time.perf_counter()
        for handle in comm.batch_isend_irecv([], [(buffer, src)], self.pp, tag=tag):
            handle.wait()
        self.wait_seconds += time.perf_counter() - started
        return buffer

    def send_forward(self, activation: torch.Tensor) -> None:
        self._send(activation, self.next_rank, _FORWARD)

    def recv_forward(self) -> torch.Tensor:
        return self._recv(self.prev_rank, _FORWARD)

    def send_backward(self, grad: torch.Tensor) -> None:
        self._send(grad, self.prev_rank, _BACKWARD)

    def recv_backward(self) -> torch.Tensor:
        return self._recv(self.next_rank, _BACKWARD)

    def wait_sends(self) -> None:
        """Block until every posted send has been delivered (end of a step)."""
        started = time.perf_counter()
        for handle, _ in self._pending:
            handle.wait()
        self._pending.clear()
        self.wait_seconds += time.perf_counter() - started
