"""Improve a placement by moving ops between devices, or make one that fits by packing (pure; no torch).

The dynamic programmes (:mod:`fxsplit.partition.contiguous`,
:mod:`fxsplit.partition.ring`) only consider placements where devices take
consecutive runs of ops (in order, or wrapped around to the first device).
Some models are cheaper to run with an op placed out of order. The classic
case is a tied output head: GPT-2's ``lm_head`` reads the token embedding,
which lives on the first device; moving that one op back to the first device
copies the final hidden state there (kilobytes) instead of copying the whole
embedding to the last device on every forward (megabytes).

:func:`improve` walks the ops that read a value from another device and moves
one whenever that strictly lowers the bytes copied per forward and every
budget still holds; then it moves all readers of a copied value on one device
to the value's home together when that copies less, and single ops again.
Ops under a constraint (pinned, in a together-group, or between a write and
the reads it must precede) stay where they are. A value's home stays "the
device of its producer, or of its first reader" so the plan code that names
homes keeps working.

When nothing in order fits, :func:`repair` brings a nearly fitting placement
within budgets and :func:`pack` packs first fit; :func:`device_loads` and
:func:`frozen_ops` are what every step here checks.

>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> tied = PartitionProblem(
...     op_names=("embed", "body", "head"),
...     values=(Value("wte", 1000, 0, (0, 2), weight=1000), Value("w_body", 0, 1, (1,), weight=900),
...             Value("embed", 10, 0, (1,)), Value("body", 10, 1, (2,))))
>>> improve(tied, [0, 1, 1], [1500, 1500])
[0, 1, 0]
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from typing import Sequence

import numpy as np

from fxsplit.partition.problem import PartitionProblem

__all__ = ["State", "device_loads", "frozen_ops", "improve", "pack", "repair"]


class _Counts:
    """``counts[value][device]``: how many of the value's reads run on the device, made when first asked for."""

    def __init__(self, problem: PartitionProblem, op_devices: list[int]) -> None:
        self.problem = problem
        self.devices = op_devices
        self.made: dict[int, dict[int, int]] = {}

    def __getitem__(self, index: int) -> dict[int, int]:
        counts = self.made.get(index)
        if counts is None:
            counts = {}
            for op in self.problem.values[index].consumers:
                counts[self.devices[op]] = counts.get(self.devices[op], 0) + 1
            self.made[index] = counts
        return counts


class State:
    """Consumer counts per value and device, and device loads, kept up to date as ops move."""

    def __init__(self, problem: PartitionProblem, op_devices: list[int], budgets: Sequence[int]) -> None:
        self.problem = problem
        self.devices = op_devices
        self.budgets = list(budgets)
        self.reads = problem.op_reads
        self.starts = problem.op_homes
        self.counts = _Counts(problem, op_devices)
        self.resident = problem.op_weights()
        self.transient = problem.transients()
        self.load = [0] * len(self.budgets)
        self.transients: list[list[int]] = [[] for _ in self.budgets]
        for op, device in enumerate(op_devices):
            self.load[device] += self.resident[op]
            self.transients[device].append(self.transient[op])
        for peaks in self.transients:
            peaks.sort()

    def total(
        self, device: int, add_resident: int = 0, add_transient: int | None = None, drop_transient: int | None = None
    ) -> int:
        """Bytes ``device`` needs, optionally with one op added or removed."""
        peaks = self.transients[device]
        peak = peaks[-1] if peaks else 0
        if drop_transient is not None and peaks and peaks[-1] == drop_transient:
            peak = peaks[-2] if len(peaks) > 1 else 0
        if add_transient is not None:
            peak = max(peak, add_transient)
        return self.load[device] + add_resident + peak

    def value_cost(self, index: int, home: int, counts: dict[int, int]) -> int:
        value = self.problem.values[index]
        if not value.nbytes:
            return 0
        return value.nbytes * sum(1 for d, c in counts.items() if c > 0 and d != home)

    def move_delta(self, op: int, target: int) -> int:
        """Change in bytes copied per forward if ``op`` ran on ``target``."""
        source = self.devices[op]
        delta = 0
        for index in set(self.reads[op]) | set(self.starts[op]):
            value = self.problem.values[index]
            home = self.devices[value.start]
            counts = self.counts[index]
            before = self.value_cost(index, home, counts)
            moved = dict(counts)
            uses = value.consumers.count(op) if op in value.consumers else 0
            if uses:
                moved[source] -= uses
                moved[target] = moved.get(target, 0) + uses
            new_home = target if value.start == op else home
            delta += self.value_cost(index, new_home, moved) - before
        return delta

    def fits(self, op: int, target: int) -> bool:
        return self.total(target, self.resident[op], self.transient[op]) <= self.budgets[target]

    def apply(self, op: int, target: int) -> None:
        source = self.devices[op]
        for index in set(self.reads[op]):
            uses = self.problem.values[index].consumers.count(op)
            counts = self.counts[index]
            counts[source] -= uses
            counts[target] = counts.get(target, 0) + uses
        self.load[source] -= self.resident[op]
        self.load[target] += self.resident[op]
        peaks = self.transients[source]
        del peaks[bisect.bisect_left(peaks, self.transient[op])]
        bisect.insort(self.transients[target], self.transient[op])
        self.devices[op] = target

    def neighbours(self, op: int) -> set[int]:
        found: set[int] = set()
        for index in self.reads[op]:
            found.add(self.problem.values[index].start)
        for index in self.starts[op]:
            found.update(self.problem.values[index].consumers)
        found.discard(op)
        return found


def frozen_ops(problem: PartitionProblem) -> set[int]:
    """Ops that constraints tie to their neighbours or to a device."""
    frozen = set(problem.pinned)
    for lo, hi in problem.no_cut_spans():
        frozen.update(range(lo, hi + 1))
    for group in problem.colocated:
        frozen.update(group)
    return frozen


def device_loads(problem: PartitionProblem, op_devices: Sequence[int], num_devices: int) -> list[int]:
    """Bytes each device needs for a placement: resident bytes (with the ``held`` weights it reads) plus its
    largest transient."""
    resident, transient = problem.op_weights(), problem.transients()
    loads, peaks = [0] * num_devices, [0] * num_devices
    for op, device in enumerate(op_devices):
        loads[device] += resident[op]
        peaks[device] = max(peaks[device], transient[op])
    if problem.held:
        loads = [load + held for load, held in zip(loads, problem.held_loads(op_devices, num_devices), strict=True)]
    return [load + peak for load, peak in zip(loads, peaks, strict=True)]


def improve(
    problem: PartitionProblem, op_devices: Sequence[int], budgets: Sequence[int], *, max_moves: int | None = None
) -> list[int]:
    """Move ops to other devices while that strictly lowers the bytes copied per forward.

    Single ops first (at most ``max_moves``, default four per op), then, up to twice, the
    readers of a copied value on one device all to its home, each round followed by
    single moves again. Every move keeps every budget; constrained ops stay put. Deterministic: ops are visited in index
    order from a work list, devices in order, and ties keep the op in place.
    """
    if problem.num_ops == 0 or len(budgets) < 2:
        return list(op_devices)
    state = State(problem, list(op_devices), budgets)
    frozen = frozen_ops(problem)
    limit = max_moves if max_moves is not None else 4 * problem.num_ops
    moves = _single_moves(state, frozen, limit)
    for _ in range(2):  # a value copied to a device for several readers: move the readers together
        if not _group_moves(state, frozen):
            break
        moves += _single_moves(state, frozen, max(0, limit - moves))
    return state.devices


def _group_moves(state: State, frozen: set[int]) -> bool:
    """Move all readers of a copied value on one device to the value's home when that copies less."""
    improved = False
    # Only values copied now, or touched by a move made here, can have readers away from home: they are
    # visited largest first (by their place in ``values_by_size``), each once, from a heap of those places.
    order = state.problem.values_by_size
    rank = np.empty(len(order), dtype=np.int64)
    rank[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
    watched = set(_away(state)[0].tolist())
    heap = [int(rank[index]) for index in watched]
    heapq.heapify(heap)
    while heap:
        place = heapq.heappop(heap)
        index = order[place]
        value = state.problem.values[index]
        if not value.nbytes:
            break
        home = state.devices[value.start]
        for device in sorted({state.devices[c] for c in value.consumers} - {home}):
            readers = [c for c in dict.fromkeys(value.consumers) if state.devices[c] == device]
            if not readers or any(op in frozen for op in readers):
                continue
            done, delta = [], 0
            for op in readers:
                if not state.fits(op, home):
                    break
                delta += state.move_delta(op, home)
                state.apply(op, home)
                done.append(op)
            if len(done) == len(readers) and delta < 0:
                improved = True
                for op in done:
                    for touched in (*state.reads[op], *state.starts[op]):
                        if touched not in watched:
                            watched.add(touched)
                            if rank[touched] > place:
                                heapq.heappush(heap, int(rank[touched]))
                continue
            for op in reversed(done):
                state.apply(op, device)
    return improved


def _single_moves(state: State, frozen: set[int], limit: int) -> int:
    budgets = state.budgets
    pending = sorted(set(_away(state)[1].tolist()) - frozen)
    queue: deque[int] = deque(pending)
    queued = set(pending)
    moves = 0
    while queue and moves < limit:
        op = queue.popleft()
        queued.discard(op)
        best_delta, best_target = 0, -1
        for target in range(len(budgets)):
            if target == state.devices[op] or not state.fits(op, target):
                continue
            delta = state.move_delta(op, target)
            if delta < best_delta:
                best_delta, best_target = delta, target
        if best_target < 0:
            continue
        state.apply(op, best_target)
        moves += 1
        for neighbour in sorted(state.neighbours(op) - frozen - queued):
            queue.append(neighbour)
            queued.add(neighbour)
    return moves


def _away(state: State) -> tuple[np.ndarray, np.ndarray]:
    """The values read away from their home, and the ops that read them there (each once, sorted)."""
    values, readers, starts, _ = state.problem.read_edges
    devices = np.asarray(state.devices, dtype=np.int64)
    away = devices[readers] != devices[starts]
    return np.unique(values[away]), np.unique(readers[away])


def _blocks(problem: PartitionProblem) -> list[list[int]]:
    """Runs of ops that constraints keep on one device (single ops where none do)."""
    forbidden = problem.forbidden_cuts()
    blocks: list[list[int]] = [[0]] if problem.num_ops else []
    for op in range(1, problem.num_ops):
        if forbidden[op]:
            blocks[-1].append(op)
        else:
            blocks.append([op])
    return blocks


def pack(problem: PartitionProblem, budgets: Sequence[int]) -> list[int] | None:
    """A placement that fits when no contiguous one does, or None: first fit, in graph order, then by size.

    Walks the indivisible runs of ops in order and puts each on the current
    device when it fits, else on the next device with room, else back on an
    earlier one (a fold: the data flow returns to a device it left). If that
    fails, first fit by decreasing size. Pins are honoured. The result is a
    starting point for :func:`improve`, which lowers its copies.
    """
    blocks = _blocks(problem)
    resident, transient = problem.op_weights(), problem.transients()
    sized = [(sum(resident[op] for op in block), max(transient[op] for op in block), block) for block in blocks]
    in_order = _first_fit(problem, sized, budgets, walk=True)
    if in_order is not None:
        return in_order
    by_size = sorted(sized, key=lambda item: (-(item[0] + item[1]), item[2][0]))
    return _first_fit(problem, by_size, budgets, walk=False)


def _first_fit(
    problem: PartitionProblem, items: list[tuple[int, int, list[int]]], budgets: Sequence[int], *, walk: bool
) -> list[int] | None:
    loads, peaks = [0] * len(budgets), [0] * len(budgets)
    placement = [0] * problem.num_ops
    current = 0
    for resident, transient, block in items:
        pins = {problem.pinned[op] for op in block if op in problem.pinned}
        if len(pins) > 1:
            return None
        order = list(range(current, len(budgets))) + list(range(current)) if walk else list(range(len(budgets)))
        choices = sorted(pins) if pins else order
        for device in choices:
            if loads[device] + resident + max(peaks[device], transient) <= budgets[device]:
                loads[device] += resident
                peaks[device] = max(peaks[device], transient)
                for op in block:
                    placement[op] = device
                if walk and device > current:
                    current = device
                break
        else:
            return None
    return placement


def repair(
    problem: PartitionProblem, op_devices: Sequence[int], budgets: Sequence[int], *, max_steps: int = 64
) -> list[int] | None:
    """Bring an over-budget placement within budgets by moving ops that hold weights, or None.

    Each step takes the device furthest over its budget and moves the one op
    (with the weights it is home to) whose move copies the fewest extra bytes
    to a device with room. Meant for a contiguous placement that misses its
    budgets by a little: it stays close to it, where packing from scratch
    would scatter the model.
    """
    state = State(problem, list(op_devices), budgets)
    frozen = frozen_ops(problem)
    devices = range(len(budgets))
    for _ in range(max_steps):
        over = [d for d in devices if state.total(d) > state.budgets[d]]
        if not over:
            return state.devices
        source = max(over, key=lambda d: (state.total(d) - state.budgets[d], -d))
        best: tuple[int, int, int, int] | None = None
        for op in range(problem.num_ops):
            if state.devices[op] != source or op in frozen or not state.resident[op]:
                continue
            for target in devices:
                if target == source or not state.fits(op, target):
                    continue
                key = (state.move_delta(op, target), -state.resident[op], op, target)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        state.apply(best[2], best[3])
    return None
