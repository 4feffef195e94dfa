"""A brute-force reference for contiguous placements, written from the problem's definition.

It enumerates every placement of ops on devices in order (all device
boundaries), charges the true cost (one copy per value and destination
device) and checks feasibility, sharing no code with ``fxsplit.partition``.
The brute force over placements in any order (:func:`any_order_optimum`) is
benchmarks/optimality.py's, which reports the same comparison.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from benchmarks.optimality import any_order_optimum, every_placement
from fxsplit.partition.problem import PartitionProblem

__all__ = [
    "any_order_optimum",
    "brute_force",
    "every_placement",
    "feasible",
    "loads",
    "placements",
    "sum_sq",
    "true_cost",
]


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
