"""Exchange ops between two devices along a minimum cut (networkx max-flow).

Local moves (:mod:`fxsplit.partition.refine`) change one op, or the readers of one
value, at a time, so they stop where every single step costs bytes even
though a bigger rearrangement would save them (two parallel branches that
should swap devices, a block whose inputs and outputs all cross). For a pair
of devices ``a`` and ``b``, the ops that could change sides near their
frontier are re-split by an s-t minimum cut that charges exactly the bytes
copied between ``a`` and ``b`` and to ``a`` and ``b`` from other devices.

Each value is a *net* over the ops that make and read it. Its copies are
counted with Lawler's construction: two auxiliary nodes joined by an edge of
the value's bytes, every pin joined to them by edges of infinite capacity,
so a cut pays the bytes once when the net has pins on both sides:

* a value made on ``a`` or ``b``: one net, its maker and readers; cut when
  some reader is on the other side (one copy);
* a value made on a third device and read on ``a`` or ``b``: it is copied
  once to each of them that reads it, so two nets: its readers with the
  ``b`` terminal (cut when a reader is on ``a``) and with the ``a`` terminal.

Ops far from the frontier (see :data:`WINDOWS`), pinned ops and ops tied by constraints (the
partitioner's frozen set) keep their side (joined to their terminal). The cut ignores budgets: when it
overfills a device, ops it moved are sent back (the cheapest first) until both fit, else the cut is dropped;
regions of growing size around the frontier are tried so that small, fitting exchanges are found too.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable, Iterable, Sequence

import networkx as nx
from networkx.algorithms.flow import edmonds_karp

from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.refine import device_loads

__all__ = ["WINDOWS", "exchange", "pair_cut"]

WINDOWS = (0.1, 0.25, 0.5, 1.0)
"""Sizes of the regions around the frontier that one cut re-splits, as shares of the pair's resident
bytes: the ops nearest the frontier (breadth first through values) join until their weights reach the
share, so a cut moves at most that much, and small, fitting exchanges are tried before large ones."""

MAX_FREE = 160
"""Largest region (in ops) one cut re-splits: wider windows are skipped (max-flow in Python grows fast)."""

_SOURCE, _SINK = "a", "b"


def exchange(
    problem: PartitionProblem, op_devices: Sequence[int], budgets: Sequence[int], frozen: set[int], *, rounds: int = 2
) -> list[int]:
    """Apply every pairwise cut that lowers the bytes copied per forward while every budget holds."""
    devices = list(op_devices)
    touching: list[list[int]] = [[] for _ in range(problem.num_ops)]
    for index, value in enumerate(problem.values):
        if value.nbytes and value.consumers:
            for op in {value.start, *value.consumers}:
                touching[op].append(index)
    resident = problem.op_weights()
    for _ in range(rounds):
        improved = False
        for a, b in _pairs(problem, devices):
            neighbours, frontier = _pair_graph(problem, devices, a, b)
            previous: set[int] = set()
            pair_bytes = sum(resident[op] for op, d in enumerate(devices) if d in (a, b))
            for share in WINDOWS:
                free = _window(neighbours, frontier, frozen, resident, share * pair_bytes)
                if not free or free == previous or len(free) > MAX_FREE:
                    break
                previous = free
                sides = pair_cut(problem, devices, a, b, free)
                changed = {op: side for op, side in sides.items() if devices[op] != side}
                if not changed:
                    continue
                values = {index for op in changed for index in touching[op]}
                before = _cost(problem, devices, values)
                candidate = list(devices)
                for op, side in changed.items():
                    candidate[op] = side
                fitted = _fit_back(problem, candidate, devices, changed, touching, budgets, (a, b))
                if fitted is not None and _cost(problem, fitted, values) < before:
                    devices, improved = fitted, True
                    neighbours, frontier = _pair_graph(problem, devices, a, b)
        if not improved:
            break
    return devices


def pair_cut(problem: PartitionProblem, op_devices: Sequence[int], a: int, b: int, free: set[int]) -> dict[int, int]:
    """The side (``a`` or ``b``) a minimum cut gives each op of ``free``; every other op keeps its device."""
    graph = nx.DiGraph()
    graph.add_nodes_from((_SOURCE, _SINK))

    def pin(op: int) -> Hashable:
        if op in free:
            return op
        return _SOURCE if op_devices[op] == a else _SINK if op_devices[op] == b else None

    for index, value in enumerate(problem.values):
        if not value.nbytes or not value.consumers:
            continue
        if value.start not in free and not any(op in free for op in value.consumers):
            continue
        pins = {pin(op) for op in (value.start, *value.consumers)} - {None}
        if value.start in free or op_devices[value.start] in (a, b):
            _net(graph, ("v", index), pins, value.nbytes)
        else:  # made elsewhere: one copy to each of a and b that reads it
            readers = {pin(op) for op in value.consumers} - {None}
            _net(graph, ("to_a", index), readers | {_SINK}, value.nbytes)
            _net(graph, ("to_b", index), readers | {_SOURCE}, value.nbytes)
    _, (source_side, _) = nx.minimum_cut(graph, _SOURCE, _SINK, flow_func=edmonds_karp)
    return {op: a if op in source_side else b for op in free}


def _net(graph: nx.DiGraph, key: Hashable, pins: set[Hashable], nbytes: int) -> None:
    """Lawler's net: pays ``nbytes`` once when ``pins`` fall on both sides of the cut."""
    if len(pins) < 2 or {_SOURCE, _SINK} <= pins:
        return  # never cut, or always cut (a constant)
    enter, leave = (key, "in"), (key, "out")
    graph.add_edge(enter, leave, capacity=nbytes)
    for p in pins:
        graph.add_edge(p, enter)  # no capacity attribute: infinite
        graph.add_edge(leave, p)


def _pair_graph(
    problem: PartitionProblem, op_devices: Sequence[int], a: int, b: int
) -> tuple[dict[int, set[int]], set[int]]:
    """Ops of ``a`` and ``b`` linked by a value, and those on the frontier (a value crosses between them)."""
    neighbours: dict[int, set[int]] = {}
    frontier: set[int] = set()
    for value in problem.values:
        ops = [op for op in (value.start, *value.consumers) if op_devices[op] in (a, b)]
        if len(ops) < 2:
            continue
        if value.nbytes and len({op_devices[op] for op in ops}) == 2:
            frontier.update(ops)
        for op in ops:
            neighbours.setdefault(op, set()).update(ops)
    return neighbours, frontier


def _window(
    neighbours: dict[int, set[int]], frontier: set[int], frozen: set[int], resident: Sequence[int], limit: float
) -> set[int]:
    """Ops nearest the frontier (breadth first through values), not frozen, while their weights fit ``limit``."""
    start = sorted(op for op in frontier if op not in frozen)
    seen = set(start)
    queue = deque(start)
    free: set[int] = set()
    weight = 0
    while queue:
        op = queue.popleft()
        if free and weight + resident[op] > limit:
            continue
        free.add(op)
        weight += resident[op]
        for other in sorted(neighbours.get(op, ())):
            if other not in seen and other not in frozen:
                seen.add(other)
                queue.append(other)
    return free


def _pairs(problem: PartitionProblem, op_devices: Sequence[int]) -> list[tuple[int, int]]:
    """Device pairs that exchange a value, most bytes first."""
    between: dict[tuple[int, int], int] = {}
    for value in problem.values:
        if not value.nbytes or not value.consumers:
            continue
        home = op_devices[value.start]
        for device in {op_devices[op] for op in value.consumers} - {home}:
            key = (min(home, device), max(home, device))
            between[key] = between.get(key, 0) + value.nbytes
    return sorted(between, key=lambda k: (-between[k], k))


def _cost(problem: PartitionProblem, op_devices: Sequence[int], values: Iterable[int]) -> int:
    """Bytes copied per forward for the values at these indices."""
    total = 0
    for index in values:
        value = problem.values[index]
        home = op_devices[value.start]
        total += value.nbytes * len({op_devices[op] for op in value.consumers} - {home})
    return total


def _fit_back(
    problem: PartitionProblem,
    candidate: list[int],
    original: Sequence[int],
    changed: dict[int, int],
    touching: Sequence[Sequence[int]],
    budgets: Sequence[int],
    pair: tuple[int, int],
) -> list[int] | None:
    """``candidate`` brought within the pair's budgets by sending moved ops back, cheapest first, or None.

    The cut knows no budgets: when it overfills a device, the op it moved
    there whose return adds the fewest bytes (per byte of weight it takes
    away) goes back, until both devices fit.
    """
    resident = problem.op_weights()
    moved = dict(changed)
    while True:
        loads = device_loads(problem, candidate, len(budgets))
        over = [d for d in pair if loads[d] > budgets[d]]
        if not over:
            return candidate
        options = [op for op, side in moved.items() if side in over]
        if not options:
            return None

        def penalty(op: int) -> tuple[float, int]:
            values = touching[op]
            now = _cost(problem, candidate, values)
            candidate[op] = original[op]
            back = _cost(problem, candidate, values)
            candidate[op] = moved[op]
            return (back - now) / max(resident[op], 1), op

        op = min(options, key=penalty)
        candidate[op] = original[op]
        del moved[op]
