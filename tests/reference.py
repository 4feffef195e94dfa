"""A brute-force reference for contiguous placements, written from the problem's definition.

It enumerates every placement of ops on devices in order (all device
boundaries), charges the true cost (one copy per value and destination
device) and checks feasibility, sharing no code with ``fxsplit.partition``.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from fxsplit.partition.problem import PartitionProblem


def placements(n: int, k: int) -> list[tuple[int, ...]]:
    """Every contiguous placement of n ops on k devices in order (devices may take no op)."""
    found = []
    for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
        bounds = (0, *cuts, n)
        found.append(tuple(d for d in range(k) for _ in range(bounds[d], bounds[d + 1])))
    return found


def true_cost(problem: PartitionProblem, devices: Sequence[int]) -> int:
    total = 0
    for v in problem.values:
        home = devices[v.start]
        total += v.nbytes * len({devices[c] for c in v.consumers} - {home})
    return total


def loads(problem: PartitionProblem, devices: Sequence[int], k: int) -> list[int]:
    n = problem.num_ops
    resident = [0] * k
    peak = [0] * k
    extra = problem.op_extra or (0,) * n
    transient = problem.op_transient or (0,) * n
    for v in problem.values:
        if v.weight:
            resident[devices[v.start]] += v.weight
    for op in range(n):
        resident[devices[op]] += extra[op]
        peak[devices[op]] = max(peak[devices[op]], transient[op])
    return [r + p for r, p in zip(resident, peak, strict=True)]


def feasible(problem: PartitionProblem, devices: Sequence[int], budgets: Sequence[int]) -> bool:
    if any(load > b for load, b in zip(loads(problem, devices, len(budgets)), budgets, strict=True)):
        return False
    if any(devices[op] != d for op, d in problem.pinned.items()):
        return False
    if any(len({devices[op] for op in group}) > 1 for group in problem.together):
        return False
    return all(devices[c] == devices[v.start] for v in problem.values if not v.movable for c in v.consumers)


def sum_sq(problem: PartitionProblem, devices: Sequence[int], budgets: Sequence[int]) -> float:
    return sum((load / b) ** 2 for load, b in zip(loads(problem, devices, len(budgets)), budgets, strict=True) if load)


def brute_force(problem: PartitionProblem, budgets: Sequence[int]) -> list[tuple[int, ...]]:
    """Feasible placements of least true cost (empty when nothing fits)."""
    fits = [p for p in placements(problem.num_ops, len(budgets)) if feasible(problem, p, budgets)]
    if not fits:
        return []
    best = min(true_cost(problem, p) for p in fits)
    return [p for p in fits if true_cost(problem, p) == best]


def every_placement(n: int, k: int) -> np.ndarray:
    """All ``k ** n`` placements of ``n`` ops on ``k`` devices, one per row (any order, any device)."""

    grids = np.indices((k,) * n).reshape(n, -1).T
    return grids.astype(np.int8)


def any_order_optimum(problem: PartitionProblem, budgets: Sequence[int]) -> tuple[int, tuple[int, ...]] | None:
    """The cheapest feasible placement of all ``k ** n`` (true cost, vectorised over placements), or None."""

    k, n = len(budgets), problem.num_ops
    grid = every_placement(n, k)
    ok = np.ones(len(grid), dtype=bool)
    extra = problem.op_extra or (0,) * n
    transient = problem.op_transient or (0,) * n
    for d in range(k):
        on_d = grid == d
        load = on_d @ np.asarray(extra, dtype=np.int64)
        for v in problem.values:
            if v.weight:
                load = load + on_d[:, v.start] * v.weight
        peak = (on_d * np.asarray(transient, dtype=np.int64)).max(axis=1) if n else 0
        ok &= load + peak <= budgets[d]
    for op, d in problem.pinned.items():
        ok &= grid[:, op] == d
    for group in problem.together:
        for op in group[1:]:
            ok &= grid[:, op] == grid[:, group[0]]
    for v in problem.values:
        if not v.movable:
            for c in v.consumers:
                ok &= grid[:, c] == grid[:, v.start]
    if not ok.any():
        return None
    grid = grid[ok]
    cost = np.zeros(len(grid), dtype=np.int64)
    for v in problem.values:
        if not v.nbytes or not v.consumers:
            continue
        home = grid[:, v.start]
        for d in range(k):
            reads_on_d = np.zeros(len(grid), dtype=bool)
            for c in v.consumers:
                reads_on_d |= grid[:, c] == d
            cost += v.nbytes * (reads_on_d & (home != d))
    best = int(np.argmin(cost))
    return int(cost[best]), tuple(int(d) for d in grid[best])
