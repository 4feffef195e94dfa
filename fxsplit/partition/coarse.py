"""Placements of whole modules, in any order: the graph coarsened to its modules, searched exactly (pure; no torch).

The dynamic programmes place runs of ops in op order (or wrapped once), and
the local searches after them move one op, one value's readers or one
min-cut's worth of ops at a time. A placement that moves several whole
modules at once (the layers of a tower to one device, the embedding and a tied
head to another, the blocks between them split unevenly) is out of their
reach, yet it is often the one a person would write, and what a device map
gives.

:func:`module_placements` coarsens the problem: each run of consecutive ops
under one module (``op_labels`` cut to a depth) becomes one op of a small
problem (:func:`coarsened`), whose copies and loads are exactly those of the
full problem for any placement that keeps every run on one device. Runs are
read at each depth in turn, shallowest first; where a depth has more runs than
the exact search takes, neighbouring runs are merged, lightest pair first
(:func:`merged`). Each small problem is searched by branch and bound
(:func:`~fxsplit.partition.exact.exact_placement`), and every placement it
finds is expanded back to ops. Constraints hold: a run never starts where a
cut is forbidden, and never holds ops pinned to two devices.

>>> from fxsplit.partition.context import Context
>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> towers = PartitionProblem(  # two towers whose ops alternate; each tower's value is read by its next op
...     op_names=("a0", "b0", "a1", "b1"),
...     values=(Value("wa0", 0, 0, (0,), weight=50), Value("wb0", 0, 1, (1,), weight=50),
...             Value("wa1", 0, 2, (2,), weight=50), Value("wb1", 0, 3, (3,), weight=50),
...             Value("a0", 8, 0, (2,)), Value("b0", 8, 1, (3,))),
...     op_labels=("a.0", "b.0", "a.1", "b.1"))
>>> module_placements(Context(towers, [100, 100]), [100, 100])
[[0, 1, 0, 1]]
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Sequence

import numpy as np

from fxsplit.partition.exact import NODE_LIMIT, exact_placement, searched, taken_placements
from fxsplit.partition.problem import PartitionProblem, Value

if TYPE_CHECKING:
    from fxsplit.partition.context import Context

__all__ = ["MAX_DEPTH", "coarsened", "label_runs", "merged", "module_placements", "run_limit"]

MAX_DEPTH = 6
"""Deepest module level whose runs are read."""


def run_limit(num_devices: int) -> int:
    """The most runs one search takes on ``num_devices`` devices: as many as
    :func:`~fxsplit.partition.exact.searched` allows (24 on two devices, 15 on three, 14 on more)."""
    limit = 1
    while searched(limit + 1, num_devices):
        limit += 1
    return limit


def label_runs(problem: PartitionProblem, depths: np.ndarray, forbidden: np.ndarray, depth: int) -> list[int]:
    """First op of each run of consecutive ops whose labels agree on their first ``depth`` parts
    (``depths``: :attr:`Context.label_depths <fxsplit.partition.context.Context.label_depths>`).

    A run never starts where a cut is ``forbidden``, and a new run starts where an op is pinned to another
    device than an op pinned earlier in the run (so no run holds two pins that disagree)."""
    starts = np.flatnonzero((depths <= depth) & ~forbidden)
    if not problem.pinned:
        return [0, *starts[starts > 0].tolist()]
    chosen = set(starts.tolist()) | {0}
    pin = None
    for op in range(problem.num_ops):
        if op in chosen:
            pin = None
        here = problem.pinned.get(op)
        if here is not None and pin is not None and here != pin and not forbidden[op]:
            chosen.add(op)
        pin = here if here is not None else pin
    return sorted(chosen)


def merged(problem: PartitionProblem, starts: Sequence[int], limit: int, crossing: Sequence[int]) -> list[int]:
    """``starts`` with neighbouring runs merged until at most ``limit`` remain: each time the pair of the
    smallest joint resident bytes (ties: the one more bytes cross between, then the earliest), never two runs
    holding ops pinned to different devices. ``crossing[t]``: the bytes crossing position ``t``."""
    prefix = np.concatenate([[0], np.cumsum(problem.op_weights(), dtype=np.int64)])
    bounds = np.asarray([*starts, problem.num_ops], dtype=np.int64)
    weight = (prefix[bounds[1:]] - prefix[bounds[:-1]]).tolist()
    pinned = bool(problem.pinned)
    pins: list[set[int]] = [set() for _ in starts]
    for op, device in problem.pinned.items():
        pins[int(np.searchsorted(bounds, op, side="right")) - 1].add(device)
    after = list(range(1, len(starts) + 1))  # the run after each run (len(starts): none)
    before = list(range(-1, len(starts) - 1))
    alive = [True] * len(starts)
    heap = [(weight[i] + weight[i + 1], -crossing[starts[i + 1]], i, i + 1) for i in range(len(starts) - 1)]
    heapq.heapify(heap)
    count = len(starts)
    while count > limit and heap:
        joint, _, i, j = heapq.heappop(heap)
        if not (alive[i] and alive[j]) or after[i] != j or joint != weight[i] + weight[j]:
            continue
        if pinned and len(pins[i] | pins[j]) > 1:
            continue
        weight[i], alive[j], count = joint, False, count - 1
        if pinned:
            pins[i] |= pins[j]
        after[i] = after[j]
        if after[i] < len(starts):
            before[after[i]] = i
            heapq.heappush(heap, (weight[i] + weight[after[i]], -crossing[starts[after[i]]], i, after[i]))
        if before[i] >= 0:
            k = before[i]
            heapq.heappush(heap, (weight[k] + weight[i], -crossing[starts[i]], k, i))
    return [s for s, kept in zip(starts, alive, strict=True) if kept]


def coarsened(problem: PartitionProblem, starts: Sequence[int]) -> tuple[PartitionProblem, np.ndarray]:
    """The problem whose ops are the runs beginning at ``starts``, and the run of every op.

    A placement of the runs, expanded to their ops, copies the same bytes and loads each device the same
    as in ``problem``: a value's home is the run of its ``start``, its readers the other runs that read it
    (values read only at home are dropped); resident bytes (weights and extra) add up, as ``op_extra``;
    transients take the largest; pins and colocated groups carry over to the runs that hold them.
    """
    n, m = problem.num_ops, len(starts)
    mark = np.zeros(n, dtype=np.int64)
    mark[np.asarray(starts[1:], dtype=np.int64)] = 1
    run = np.cumsum(mark)
    value, reader, start, _ = problem.read_edges
    home = run[np.minimum(start, n - 1)]
    away = run[reader] != home
    values = []
    pairs = np.unique(np.stack([value[away], run[reader[away]]]), axis=1) if away.any() else np.zeros((2, 0), int)
    splits = np.flatnonzero(np.diff(pairs[0])) + 1
    for index, runs in zip(np.split(pairs[0], splits), np.split(pairs[1], splits), strict=True):
        if len(index):
            v = problem.values[int(index[0])]
            home_run = int(run[min(v.start, n - 1)])
            values.append(Value(v.name, v.nbytes, home_run, tuple(sorted({home_run, *runs.tolist()}))))
    resident = np.bincount(run, weights=problem.op_weights(), minlength=m).astype(np.int64)
    transient = np.zeros(m, dtype=np.int64)
    if problem.op_transient:
        np.maximum.at(transient, run, np.asarray(problem.op_transient, dtype=np.int64))
    groups = [tuple(sorted({int(run[op]) for op in group})) for group in problem.colocated]
    small = PartitionProblem(
        op_names=tuple(problem.op_names[s] for s in starts),
        values=tuple(values),
        pinned={int(run[op]): d for op, d in problem.pinned.items()},
        op_extra=tuple(int(w) for w in resident),
        op_transient=tuple(int(t) for t in transient) if problem.op_transient else (),
        colocated=tuple(g for g in groups if len(g) > 1),
    )
    return small, run


def module_placements(
    ctx: Context,
    budgets: Sequence[int],
    below: float | None = None,
    node_limit: int = NODE_LIMIT,
    max_runs: int | None = None,
    total_nodes: int | None = None,
    keep: int = 1,
) -> list[list[int]]:
    """The placements the exact search finds over the module runs of each depth within ``budgets``; empty
    when the problem has no ``op_labels`` or nothing fits. See the module's docstring.

    Args:
        ctx: the problem's arrays.
        budgets: the budgets in use.
        below: only placements that copy fewer bytes than this are sought (None: any that fits).
        node_limit: the most branches one search opens.
        max_runs: the most runs one search places (None: as many as :func:`run_limit` allows).
        total_nodes: the most branches all searches open together, shared evenly (None: no such limit).
        keep: from each search, the placement it found and up to ``keep - 1`` it took as its best before
            (:func:`~fxsplit.partition.exact.taken_placements`).
    """
    problem = ctx.problem
    if not problem.op_labels or problem.num_ops < 2 or len(budgets) < 2:
        return []
    limit = min(run_limit(len(budgets)), max_runs or problem.num_ops)
    forbidden = np.asarray(ctx.forbidden[: problem.num_ops], dtype=bool)
    groupings: list[list[int]] = []
    for depth in range(1, MAX_DEPTH + 1):
        starts = label_runs(problem, ctx.label_depths, forbidden, depth)
        raw = len(starts)
        if raw > limit:
            starts = merged(problem, starts, limit, ctx.crossing)
        if 1 < len(starts) <= limit and starts not in groupings:
            groupings.append(starts)
        if raw > limit or raw == problem.num_ops:
            break
    if total_nodes is not None and groupings:
        node_limit = min(node_limit, total_nodes // len(groupings))
    found: list[list[int]] = []
    for starts in groupings:
        small, run = coarsened(problem, starts)
        # a run may hold ops pinned to two devices where constraints allow no cut between them: no search
        if any(small.pinned[run[op]] != device for op, device in problem.pinned.items()):
            continue
        if keep > 1:
            taken = taken_placements(small, budgets, below=below, node_limit=node_limit, keep=keep)
            found += [np.asarray(placed, dtype=np.int64)[run].tolist() for placed in taken]
            continue
        placed = exact_placement(small, budgets, None, node_limit=node_limit, below=below)
        if placed is not None:
            found.append(np.asarray(placed, dtype=np.int64)[run].tolist())
    return found
