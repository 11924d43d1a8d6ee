"""Muon's orthogonalization over a ``ZeroOptimizer``'s shards: every matrix is gathered whole on one owner,
orthogonalized there once, and its pieces go back to the ranks whose masters hold them.

Owners balance the Newton-Schulz FLOPs over the data-parallel ranks of the optimizer's shard group and, for
whole matrices, its tensor-parallel ranks too, preferring the rank that holds most of a matrix (ZeRO's
buffers keep most parameters whole on one rank: those never travel); a tensor-parallel
weight is joined along its split dimension, so the result is the one-process result in every layout.
``tp_mode`` "blockwise" (Megatron-LM's default) orthogonalizes each tensor-parallel shard on its own
instead. Per step: an all-to-all over dp (each rank's pieces to their owners), one over tp (shards to the
whole matrix's owner), Newton-Schulz, and the same two back, all counted by ``parallel.comm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from parallel import comm
from parallel.muon.matrices import MuonSettings, orthogonalization_flops, orthogonalized
from parallel.param_meta import meta
from parallel.process_groups import module_device


@dataclass(frozen=True)
class _Matrix:
    """One Muon parameter: its shape on this rank, settings, whether every dp rank holds all of it
    (stage 0) and the (dp, tp) place of its owner."""

    param: nn.Parameter
    shape: torch.Size
    settings: MuonSettings
    replicated: bool
    owner: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.shape.numel()


def balanced_owners(costs: list[int], places: int, held: list[list[int]] | None = None,
                    slack: float = 1.25) -> list[int]:
    """The place (0 .. ``places`` - 1) of each item, largest cost first: the place holding most of it
    (``held[item][place]``: its elements there) whose load stays within ``slack`` x an even share, else the
    least loaded place. ZeRO's buffers keep most parameters whole on one rank, so most matrices are
    orthogonalized where they lie and never travel."""
    load, owner, cap = [0] * places, [0] * len(costs), slack * sum(costs) / max(places, 1)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        local = sorted((p for p in range(places) if held and held[item][p]),
                       key=lambda p: (-held[item][p], load[p], p))
        fitting = [p for p in local if load[p] + costs[item] <= cap]
        place = fitting[0] if fitting else min(range(places), key=lambda p: (load[p], p))
        owner[item] = place
        load[place] += costs[item]
    return owner


class WholeMatrices:
    """The orthogonalizer of a ``Muon`` stepping ``zero``'s masters (``Muon.distribute``).

    Owns the matrices' owners and every dp rank's holdings (exchanged once, here). It never steps the
    optimizer and never changes a master: it returns each master's orthogonalized update.
    """

    def __init__(self, zero, muon):
        self.dp, tp = zero.dp, zero.model_parallel.tp
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.device = module_device(zero.module)
        in_muon = {id(p): group for group in muon.param_groups if group["use_muon"] for p in group["params"]}
        modes = {group["tp_mode"] for group in in_muon.values()}
        if len(modes) > 1:
            raise ValueError(f"--muon-tp-mode is one for the whole run, got {sorted(modes)}")
        self.whole = self.tp is not None and modes != {"blockwise"}
        found: dict[int, tuple] = {}
        for slot in zero.slots:
            group = in_muon.get(id(slot.master))
            if group is None:
                continue
            for param, _, shape in slot.layout:
                found.setdefault(id(param), (param, shape, MuonSettings.of({**muon.defaults, **group}),
                                             not slot.sharded))
        self.index = {key: number for number, key in enumerate(found)}
        # this rank's pieces: (matrix, start, length, master, offset), by matrix then start
        self.masters = zero.masters
        self.mine = sorted((self.index[id(piece.param)], piece.start, piece.length, piece.master,
                            piece.offset)
                           for piece in zero.master.pieces(muon) if id(piece.param) in self.index)
        self.holdings = comm.all_gather_object([item[:3] for item in self.mine], self.dp, self.device) \
            if self.dp.size > 1 else [[item[:3] for item in self.mine]]
        costs = [orthogonalization_flops(self._whole_shape(param, shape), meta(param).fused_rows, settings)
                 for param, shape, settings, _ in found.values()]
        tp_rank, tp_size = (self.tp.rank, self.tp.size) if self.tp is not None else (0, 1)
        spread = tp_size if self.whole else 1  # places: (dp index, tp index) in whole mode, else dp index
        held = [[0] * (self.dp.size * spread) for _ in found]
        for q, pieces in enumerate(self.holdings):
            for number, _, length in pieces:
                for t in range(spread):
                    held[number][q * spread + t] += length
        places = balanced_owners(costs, self.dp.size * spread, held)
        self.matrices = [_Matrix(param, shape, settings, replicated,
                                 divmod(place, tp_size) if self.whole else (place, tp_rank))
                         for (param, shape, settings, replicated), place in zip(found.values(), places)]
        if self.tp is not None and len(set(comm.all_gather_object(self.dp.rank, self.tp, self.device))) != 1:
            raise ValueError("Muon's owners need the tensor-parallel ranks of a group at one data-parallel "
                             "index")

    def _whole_shape(self, param: nn.Parameter, shape: torch.Size) -> torch.Size:
        declared = meta(param)
        if not (self.whole and declared.tensor_parallel):
            return shape
        dims = list(shape)
        dims[declared.partition_dim] *= self.tp.size
        return torch.Size(dims)

    # the exchange ------------------------------------------------------------------------------------
    def __call__(self, updates: list[tuple[nn.Parameter, torch.Tensor, MuonSettings]]
                 ) -> list[tuple[torch.Tensor, float]]:
        position = {id(master): index for index, (master, _, _) in enumerate(updates)}
        flat = [update.reshape(-1) for _, update, _ in updates]
        update_of = [flat[position[id(self.masters[item[3]])]] for item in self.mine]
        results = self._orthogonalize(self._gather_dp(update_of))
        out = [torch.zeros_like(update) for update in flat]
        for item, values in zip(self.mine, self._scatter_dp(results)):
            master, offset, length = item[3], item[4], item[2]
            out[position[id(self.masters[master])]][offset:offset + length].copy_(values)
        return [(update, 1.0) for update in out]

    def _owned_dp(self, number: int) -> bool:
        return self.matrices[number].owner[0] == self.dp.rank

    def _exchange(self, group, sends: list[list[torch.Tensor]], receive: list[int]) -> list[torch.Tensor]:
        """``sends[q]`` to rank q of ``group``; ``receive[q]`` elements from it: what each sent, in order."""
        me = group.rank
        data = torch.cat([t.to(self.device) for q, parts in enumerate(sends) if q != me for t in parts]
                         or [torch.empty(0, device=self.device)])
        splits = [0 if q == me else sum(t.numel() for t in parts) for q, parts in enumerate(sends)]
        incoming = [0 if q == me else n for q, n in enumerate(receive)]
        return list(comm.all_to_all_uneven(data, splits, incoming, group).split(incoming))

    def _gather_dp(self, update_of: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The matrices whose owner is at this dp index, whole on this tp rank (flat, on the device), from
        ``update_of`` (the update's elements of each of ``mine``)."""
        me, size = self.dp.rank, self.dp.size
        local = {n: torch.zeros(m.numel, device=self.device) for n, m in enumerate(self.matrices)
                 if self._owned_dp(n)}
        sends = [[] for _ in range(size)]
        for (number, start, length, _, offset), update in zip(self.mine, update_of):
            values = update[offset:offset + length]
            owner = self.matrices[number].owner[0]
            if owner == me:
                local[number][start:start + length].copy_(values)
            elif not self.matrices[number].replicated:
                sends[owner].append(values)
        wanted = [[(n, s, ln) for n, s, ln in held if self._owned_dp(n) and not self.matrices[n].replicated]
                  for held in self.holdings]
        if size > 1:
            got = self._exchange(self.dp, sends, [sum(ln for _, _, ln in w) for w in wanted])
            for q in range(size):
                if q == me:
                    continue
                sizes = [length for _, _, length in wanted[q]]
                for (number, start, length), values in zip(wanted[q], got[q].split(sizes)):
                    local[number][start:start + length].copy_(values)
        return local

    def _orthogonalize(self, local: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """This tp rank's part of each matrix owned at this dp index, orthogonalized (joined over tp and
        orthogonalized by the tp owner first, for whole matrices)."""
        if not self.whole:
            return {n: self._solve(self.matrices[n], u.view(self.matrices[n].shape)).reshape(-1)
                    for n, u in local.items()}
        me, size = self.tp.rank, self.tp.size
        split = {n: meta(self.matrices[n].param).tensor_parallel for n in local}
        sends = [[local[n] for n in local if split[n] and self.matrices[n].owner[1] == q]
                 for q in range(size)]
        mine = [n for n in local if self.matrices[n].owner[1] == me]
        got = self._exchange(self.tp, sends, [sum(local[n].numel() for n in mine if split[n])] * size)
        parts = {q: iter(got[q].split([local[n].numel() for n in mine if split[n]])) for q in range(size)
                 if q != me}
        solved = {}
        for n in mine:
            matrix = self.matrices[n]
            if split[n]:
                dim = meta(matrix.param).partition_dim
                pieces = [local[n] if q == me else next(parts[q]) for q in range(size)]
                whole = torch.cat([p.view(matrix.shape) for p in pieces], dim=dim)
                solved[n] = [c.contiguous().reshape(-1) for c in self._solve(matrix, whole).chunk(size, dim)]
            else:
                solved[n] = [self._solve(matrix, local[n].view(matrix.shape)).reshape(-1)] * size
        back_sends = [[solved[n][q] for n in mine] if q != me else [] for q in range(size)]
        theirs = [n for n in local if self.matrices[n].owner[1] != me]
        got = self._exchange(self.tp, back_sends,
                             [sum(local[n].numel() for n in theirs if self.matrices[n].owner[1] == q)
                              for q in range(size)])
        result = {n: solved[n][me] for n in mine}
        for q in range(size):
            if q != me:
                from_q = [n for n in theirs if self.matrices[n].owner[1] == q]
                result.update(zip(from_q, got[q].split([local[n].numel() for n in from_q])))
        return result

    def _solve(self, matrix: _Matrix, update: torch.Tensor) -> torch.Tensor:
        return orthogonalized(update, meta(matrix.param).fused_rows, matrix.settings)

    def _scatter_dp(self, results: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's pieces (``mine``, in order) of the orthogonalized matrices."""
        me, size = self.dp.rank, self.dp.size
        sends = [[] for _ in range(size)]
        for q in range(size):
            if q == me:
                continue
            held = {n for n, _, _ in self.holdings[q]}
            sends[q] = [results[n] for n in sorted(results) if self.matrices[n].replicated and n in held]
            sends[q] += [results[n][s:s + ln] for n, s, ln in self.holdings[q]
                         if n in results and not self.matrices[n].replicated]
        replicated_from = [[n for n in range(len(self.matrices)) if self.matrices[n].owner[0] == q
                            and self.matrices[n].replicated and any(m[0] == n for m in self.mine)]
                           for q in range(size)]
        sharded_from = [[item for item in self.mine if self.matrices[item[0]].owner[0] == q
                         and not self.matrices[item[0]].replicated] for q in range(size)]
        incoming = [sum(self.matrices[n].numel for n in replicated_from[q])
                    + sum(item[2] for item in sharded_from[q]) for q in range(size)]
        got = self._exchange(self.dp, sends, incoming) if size > 1 else [torch.empty(0)]
        whole, pieces = {}, {}
        for q in range(size):
            if q == me:
                continue
            stream = got[q].split([self.matrices[n].numel for n in replicated_from[q]]
                                  + [item[2] for item in sharded_from[q]])
            whole.update(zip(replicated_from[q], stream[:len(replicated_from[q])]))
            pieces.update(zip(sharded_from[q], stream[len(replicated_from[q]):]))
        out = []
        for item in self.mine:
            number, start, length = item[:3]
            if number in results:
                out.append(results[number][start:start + length])
            elif item in pieces:
                out.append(pieces[item])
            else:
                out.append(whole[number][start:start + length])
        return out
