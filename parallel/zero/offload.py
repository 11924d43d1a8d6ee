"""ZeRO-Infinity optimizer offload: the optimizer step over states that live in swap files.

The fp32 masters (where they are copies, not the parameters themselves) and every optimizer state
shaped like its master (Adam's two moments, SGD's momentum) are packed into sub-groups of at most
``sub_group_numel`` parameter elements; sub-group g lives in file ``subgroup-g``, one tensor after the
other. A step walks the sub-groups in order: it waits for g's read, starts reading g+1, runs the torch
optimizer on g alone (the others have no gradient, so torch skips them), writes g back behind the next
step, and only then lets its buffer serve another sub-group. At most three sub-group buffers exist
(reading, stepping, writing), host slots of the ZeRO-R pool; between steps nothing of the states is in
memory. The arithmetic is the torch optimizer's own, so a swapped run equals an in-memory run exactly.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future

import torch
from torch import nn

from parallel.buffer_pool import BufferPool
from parallel.muon import Muon
from parallel.zero.swap import SwapSpace


def is_per_element(value) -> bool:
    """An optimizer state with one value per parameter element (Adam's moments), not a scalar (its step)."""
    return torch.is_tensor(value) and value.dim() > 0


SUB_GROUPS = 20  # the default sub-group size cuts a shard into this many: the step's three buffers hold 15%
SUB_GROUP_RANGE = (65_536, 100_000_000)  # elements (DeepSpeed's default sub_group_size is 1e9)


def default_sub_group_size(shard_numel: int) -> int:
    """Elements stepped at a time when none is given: a twentieth of this rank's shard, within
    ``SUB_GROUP_RANGE``, so that offload frees about 85% of the swapped bytes at every model size down to
    a shard of 1.3M elements (below that, a piece of 64K elements is not worth its file operations)."""
    low, high = SUB_GROUP_RANGE
    return max(low, min(high, -(-shard_numel // SUB_GROUPS)))


def _sub_groups(masters: list[nn.Parameter], sub_group_numel: int) -> list[list[int]]:
    """Consecutive masters packed greedily into groups of at most ``sub_group_numel`` elements (a master
    larger than that is a group of its own)."""
    groups, current, size = [], [], 0
    for index, master in enumerate(masters):
        if current and size + master.numel() > sub_group_numel:
            groups.append(current)
            current, size = [], 0
        current.append(index)
        size += master.numel()
    return groups + ([current] if current else [])


class SwappedOptimizerStates:
    """Owns the swap layout of ``optimizer``'s masters and states and runs its step sub-group by
    sub-group. Masters in ``resident`` (views of parameters that stay in memory) are never swapped,
    only their states. It never changes the optimizer's hyper-parameters or arithmetic, and never holds
    more than three sub-groups in memory.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, masters: list[nn.Parameter], resident: set[int],
                 space: SwapSpace, pool: BufferPool, sub_group_numel: int):
        self.optimizer, self.masters, self.space = optimizer, masters, space
        self.swapped_masters = [index not in resident for index in range(len(masters))]
        self.shapes = [master.shape for master in masters]  # a swapped-out master is empty
        self.groups = _sub_groups(masters, sub_group_numel)
        largest = max(self._capacity(group) for group in range(len(self.groups)))
        self._slots = pool.slots("optimizer-swap", largest, torch.float32, torch.device("cpu"))
        self.file_keys: list[dict[int, list[str]]] = [{} for _ in self.groups]  # master -> states in a file
        self._placeholder = torch.empty(0)
        self._buffers: dict[int, torch.Tensor] = {}
        self._writes: dict[int, Future] = {}
        for group in range(len(self.groups)):  # the masters start in their files
            self._buffers[group] = self._slots.take()
            self._bind(group, copy_in=True)
            self._write_behind(group)
            self._finish_write(group)

    # layout ------------------------------------------------------------------------------------------
    def _size(self, index: int) -> int:
        return self.shapes[index].numel()

    def _capacity(self, group: int) -> int:
        """Elements of ``group``'s swapped masters plus two states per element (Adam's moments)."""
        return sum(self._size(i) * (self.swapped_masters[i] + 2) for i in self.groups[group])

    def _layout(self, group: int):
        """(master index, state key or None for the master itself, element offset) in file order."""
        offset = 0
        for index in self.groups[group]:
            for key in ([None] if self.swapped_masters[index] else []) + self.file_keys[group].get(index, []):
                yield index, key, offset
                offset += self._size(index)

    def _numel(self, group: int) -> int:
        return sum(self._size(i) * (int(self.swapped_masters[i]) + len(self.file_keys[group].get(i, [])))
                   for i in self.groups[group])

    def _bind(self, group: int, copy_in: bool = False) -> None:
        """Point the masters and states of ``group`` at its buffer. ``copy_in``: their current values move
        into it first (the masters at start, the optimizer's freshly created states after its first step)."""
        buffer = self._buffers[group]
        if self._numel(group) > buffer.numel():
            raise ValueError(f"NVMe offload keeps at most two states per element; "
                             f"{type(self.optimizer).__name__} keeps {self.file_keys[group]}")
        moves = []
        for index, key, offset in self._layout(group):
            master = self.masters[index]
            view = buffer[offset:offset + self._size(index)].view(self.shapes[index])
            if copy_in:  # a copy first: the old values may sit where the new layout puts another tensor
                moves.append((view,
                              (master.data if key is None else self.optimizer.state[master][key]).clone()))
            if key is None:
                master.data = view
            else:
                self.optimizer.state[master][key] = view
        for view, value in moves:
            view.copy_(value)

    def _unbind(self, group: int) -> None:
        for index, key, _ in self._layout(group):
            master = self.masters[index]
            if key is None:
                master.data = self._placeholder
            else:
                self.optimizer.state[master][key] = self._placeholder

    # transfers ---------------------------------------------------------------------------------------
    def _read_ahead(self, group: int) -> Future:
        self._buffers[group] = self._slots.take()
        return self.space.read(f"subgroup-{group}", self._buffers[group][:self._numel(group)])

    def _write_behind(self, group: int) -> None:
        self._writes[group] = self.space.write(f"subgroup-{group}", self._buffers[group][:self._numel(group)])
        self._unbind(group)

    def _finish_write(self, group: int) -> None:
        if group in self._writes:
            self._writes.pop(group).result()
            self._slots.give_back(self._buffers.pop(group))

    def _state_keys(self, group: int) -> dict[int, list[str]]:
        """The states the optimizer keeps per element for each of ``group``'s masters (none before its first
        step; Muon keeps a momentum for matrices, AdamW's two moments for the rest)."""
        keys = {}
        for index in self.groups[group]:
            master = self.masters[index]
            state = self.optimizer.state.get(master, {})
            found = sorted(k for k, v in state.items() if is_per_element(v))
            if found:  # (none before the first step: the group then has no keys at all)
                keys[index] = found
            for key in found:
                if state[key].shape != self.shapes[index] or state[key].dtype != master.dtype:
                    raise ValueError("NVMe offload swaps optimizer states shaped like their parameter "
                                     "(Adam, AdamW, SGD with momentum, Muon); state "
                                     f"{key!r} of {type(self.optimizer).__name__} is "
                                     f"{tuple(state[key].shape)} {state[key].dtype}")
        return keys

    def _adopt_states(self, group: int) -> None:
        """States the optimizer created or loaded outside the buffer move into it and, from now on, into
        the group's file."""
        self.file_keys[group] = self._state_keys(group)
        self._bind(group, copy_in=True)

    # the step ----------------------------------------------------------------------------------------
    def step(self, grad_of, write_back) -> None:
        """One optimizer step: ``grad_of(i)`` makes master i's gradient (when its sub-group is stepped);
        ``write_back(i)`` copies master i into its compute-precision parameter while it is in memory.
        Muon walks the sub-groups twice: its element-wise ``prepare`` (AdamW whole, Muon's momentum), the
        orthogonalization of every matrix at once (a collective), then ``finish`` where updates wait."""
        phased = isinstance(self.optimizer, Muon)

        def first(members: list[int]) -> None:
            for index in members:
                self.masters[index].grad = grad_of(index)
            if phased:
                self.optimizer.prepare(keep=True)
            else:
                self.optimizer.step()  # masters without a gradient (the other groups) are skipped
            for index in members:
                self.masters[index].grad = None
                if not (phased and self.optimizer.waiting(self.masters[index])):
                    write_back(index)

        def second(members: list[int]) -> None:
            self.optimizer.finish([self.masters[index] for index in members])
            for index in members:
                write_back(index)

        self._walk(list(range(len(self.groups))), first)
        if phased:
            self.optimizer.exchange()
            self._walk([group for group, members in enumerate(self.groups)
                        if any(self.optimizer.waiting(self.masters[i]) for i in members)], second)

    def _walk(self, groups: list[int], visit) -> None:
        """``visit(members)`` on each of ``groups`` in memory, reading ahead and writing behind."""
        reads = {groups[0]: self._read_ahead(groups[0])} if groups else {}
        for position, group in enumerate(groups):
            reads.pop(group).result()
            if position >= 2:
                self._finish_write(groups[position - 2])  # its buffer serves the read of the next group
            if position + 1 < len(groups):
                reads[groups[position + 1]] = self._read_ahead(groups[position + 1])
            self._bind(group)
            visit(self.groups[group])
            if not self.file_keys[group]:  # the first step created the states
                self._adopt_states(group)
            self._write_behind(group)
        for group in list(self._writes):
            self._finish_write(group)

    @contextlib.contextmanager
    def in_memory(self):
        """Every master and state in memory inside the block (to save or load a checkpoint), written back
        to the files after (a load may have replaced them). This holds all the swapped bytes at once: a
        save needs that much memory."""
        for group in range(len(self.groups)):
            self._buffers[group] = torch.empty(self._numel(group))
            self.space.read(f"subgroup-{group}", self._buffers[group]).result()
            self._bind(group)
        try:
            yield
        finally:
            for group in range(len(self.groups)):
                self._buffers[group] = torch.empty(self._capacity(group))
                self._adopt_states(group)
                self.space.write(f"subgroup-{group}", self._buffers[group][:self._numel(group)]).result()
                self._unbind(group)
                del self._buffers[group]

    @property
    def resident_bytes(self) -> int:
        """Bytes of the sub-group buffers the pool holds for the step."""
        return self._slots.bytes()
