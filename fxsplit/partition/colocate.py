"""Bring each colocated group of ops onto one device, where that copies least and fits (pure; no torch).

Ops that write one tensor in place must run where the tensor lives, but the
ops between them need not: an accumulator updated after every block, a cache
written by each layer. The strategies place ops without these groups; then
:func:`colocate` moves each group's ops to the one device that adds the
fewest bytes copied per forward among those whose budgets still hold (a
pinned member decides the device). Ops that no cut may separate from a
member (a together-group's span, a value changed in place) move with it.
The ops are usually small (the writes), so this costs little.

>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> acc = PartitionProblem(  # 'zeros' makes a tensor that 'add1' and 'add2' update; 'b1' and 'b2' are blocks
...     op_names=("zeros", "b1", "add1", "b2", "add2"),
...     values=(Value("w1", 0, 1, (1,), weight=100), Value("w2", 0, 3, (3,), weight=100),
...             Value("zeros", 4, 0, (2, 4)), Value("b1", 4, 1, (2, 3)), Value("b2", 4, 3, (4,))),
...     colocated=((0, 2, 4),))
>>> colocate(acc, [0, 0, 0, 1, 1], [150, 150])  # the accumulator joins the second block: only b1 is copied
[1, 0, 1, 1, 1]
"""

from __future__ import annotations

from typing import Sequence

from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.refine import State

__all__ = ["colocate"]


def colocate(problem: PartitionProblem, op_devices: Sequence[int], budgets: Sequence[int]) -> list[int] | None:
    """``op_devices`` with every group of ``problem.colocated`` on one device, or None if some group fits nowhere."""
    if not problem.colocated:
        return list(op_devices)
    state = State(problem, list(op_devices), budgets)
    devices = range(len(budgets))
    for group in problem.colocated:
        members = _moved_with(problem, group)
        pinned = {problem.pinned[m] for m in members if m in problem.pinned}
        best: tuple[int, int] | None = None
        for target in sorted(pinned) if pinned else devices:
            if len(pinned) > 1:
                break
            delta, moved = 0, []
            for op in members:
                if state.devices[op] != target:
                    delta += state.move_delta(op, target)
                    moved.append((op, state.devices[op]))
                    state.apply(op, target)
            fits = all(state.total(d) <= budgets[d] for d in devices)
            for op, source in reversed(moved):
                state.apply(op, source)
            if fits and (best is None or delta < best[0]):
                best = (delta, target)
        if best is None:
            return None
        for op in members:
            if state.devices[op] != best[1]:
                state.apply(op, best[1])
    return state.devices


def _moved_with(problem: PartitionProblem, group: Sequence[int]) -> list[int]:
    """The ops that must move with ``group``: its own, and those of every no-cut span and colocated group that
    shares an op with them (to a fixed point), so that moving them breaks no other constraint."""
    members = set(group)
    spans = [set(range(lo, hi + 1)) for lo, hi in problem.no_cut_spans()] + [set(g) for g in problem.colocated]
    grown = True
    while grown:
        grown = False
        for span in spans:
            if not span <= members and span & members:
                members |= span
                grown = True
    return sorted(members)
