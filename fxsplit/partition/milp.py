"""Exact placement of mid-sized graphs as a mixed-integer programme, when SciPy's MILP solver (HiGHS) is installed.

The branch and bound of :mod:`fxsplit.partition.exact` is pure Python and
searches graphs of up to 14 ops (24 on two devices); past that the
partitioner's answer is heuristic, and on random training programs of 15-40 ops
over three devices it copied up to twice what the optimum does, refused
budgets that fit, and was not monotone in the budget (docs/MEMORY.md). A
placement is an assignment of ops to devices, and what it costs and needs is
linear in that assignment, so a MILP solver finds the cheapest one outright:

* ``x[op, d]``, binary: ``op`` runs on device ``d``; each op on one device;
* ``y[v, d]`` in ``[0, 1]``: value ``v`` is copied to ``d``, at least
  ``x[reader, d] - x[start, d]`` for each op that reads it (its home is where
  its ``start`` op runs, as :func:`~fxsplit.partition.result.transfer_bytes`
  counts it); the objective is ``sum(nbytes[v] * y[v, d])``;
* ``peak[d] >= transient[op] * x[op, d]``, and each device's resident bytes
  plus its peak within its budget (as
  :func:`~fxsplit.partition.result.placement_problems` counts them);
* pins fix ``x``; ops in a span no cut may fall inside, and ops of a colocated group, share their device.

The solver stops after :data:`MILP_NODES` branches (a count, not a time, so
that the answer does not depend on the machine); the placement it returns is
checked against the budgets and constraints, and kept only if it copies
strictly fewer bytes than the best the other strategies found. Without SciPy
the strategy offers nothing, and the heuristics' answer stands.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Sequence

import numpy as np

from fxsplit.partition.exact import searched
from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.result import placement_problems, transfer_bytes

__all__ = ["MILP_NODES", "MILP_OPS", "milp_available", "milp_placement", "milp_places", "without_milp"]

MILP_OPS = 60
"""Graphs of up to this many ops are solved as a MILP (when SciPy is installed)."""

MILP_NODES = 2_000
"""Most branch-and-bound nodes the solver opens; past that the best placement it found is used, if any."""


_OFF: ContextVar[bool] = ContextVar("fxsplit_without_milp", default=False)


@contextmanager
def without_milp() -> Iterator[None]:
    """Inside the block, :func:`milp_placement` offers nothing: the partitioner's heuristics alone, as without
    SciPy (:func:`~fxsplit.memory.fit.fit_budgets` plans both ways where activations are charged)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def milp_available() -> bool:
    """Whether SciPy's ``milp`` can be imported here (and is not switched off by :func:`without_milp`)."""
    return _milp() is not None


def milp_places(num_ops: int, num_devices: int) -> bool:
    """Whether a graph of ``num_ops`` ops over ``num_devices`` devices is solved as a MILP here: SciPy is installed,
    two devices or more, more ops than the branch and bound searches and at most :data:`MILP_OPS`."""
    return num_devices >= 2 and num_ops <= MILP_OPS and not searched(num_ops, num_devices) and milp_available()


def _milp() -> Any:
    if _OFF.get():
        return None
    try:
        from scipy.optimize import milp
    except ImportError:
        return None
    return milp


def milp_placement(
    problem: PartitionProblem, budgets: Sequence[int], below: int | None = None, *, node_limit: int = MILP_NODES
) -> list[int] | None:
    """The cheapest placement of ``problem``'s ops within ``budgets``, copying fewer than ``below`` bytes when given;
    None when SciPy is missing, none is found within ``node_limit`` branches, or none fits."""
    milp = _milp()
    n, k = problem.num_ops, len(budgets)
    if milp is None or n == 0 or k == 0 or problem.held:
        return None
    from scipy.optimize import Bounds, LinearConstraint
    from scipy.sparse import coo_array, vstack

    copies = _copies(problem, n)
    transient = np.asarray(problem.transients(), dtype=np.float64)
    peaked = bool(transient.any())
    num_x, num_y = n * k, len(copies) * k
    size = num_x + num_y + (k if peaked else 0)

    def x(op: int, d: int) -> int:
        return op * k + d

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lower: list[float] = []
    upper: list[float] = []

    def row(entries: list[tuple[int, float]], lo: float, hi: float) -> None:
        at = len(lower)
        for col, val in entries:
            rows.append(at)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)

    for op in range(n):  # each op on one device
        row([(x(op, d), 1.0) for d in range(k)], 1.0, 1.0)
    cost = np.zeros(size)
    for c, (nbytes, start, readers) in enumerate(copies):
        for d in range(k):
            y = num_x + c * k + d
            cost[y] = nbytes
            for reader in readers:  # copied to d when a reader runs there and the home does not
                row([(y, 1.0), (x(reader, d), -1.0), (x(start, d), 1.0)], 0.0, np.inf)
    resident = np.asarray(problem.op_weights(), dtype=np.float64)
    for d in range(k):
        entries = [(x(op, d), float(resident[op])) for op in range(n) if resident[op]]
        if peaked:
            peak = num_x + num_y + d
            entries.append((peak, 1.0))
            for op in map(int, np.flatnonzero(transient)):
                row([(peak, 1.0), (x(op, d), -float(transient[op]))], 0.0, np.inf)
        if entries:
            row(entries, -np.inf, float(budgets[d]))
    for group in _shared(problem):  # ops that must share a device: each takes the first one's
        for op in group[1:]:
            for d in range(k):
                row([(x(op, d), 1.0), (x(group[0], d), -1.0)], 0.0, 0.0)
    for before, after in _alike_pairs(problem, budgets):  # alike devices are used in order (one of each relabeling)
        for op in range(n):
            row([(x(op, after), -1.0), *((x(i, before), 1.0) for i in range(op))], 0.0, np.inf)
    low, high = np.zeros(size), np.ones(size)
    if peaked:
        high[num_x + num_y :] = np.inf
    for op, device in problem.pinned.items():
        if 0 <= op < n and 0 <= device < k:
            high[[x(op, d) for d in range(k) if d != device]] = 0.0
            low[x(op, device)] = 1.0
    integrality = np.zeros(size)
    integrality[:num_x] = 1
    matrix = coo_array((vals, (rows, cols)), shape=(len(lower), size)).tocsr()
    options: dict[str, Any] = {"node_limit": node_limit, "presolve": True, "disp": False}
    if below is not None:  # no more than the best placement so far, less a byte: the solver prunes by it
        if below <= 0:
            return None
        matrix = vstack([matrix, coo_array(cost[None, :])]).tocsr()
        lower.append(-np.inf)
        upper.append(float(below) - 1.0)  # strictly fewer bytes (byte counts are whole numbers)
    result = milp(
        cost,
        constraints=LinearConstraint(matrix, np.asarray(lower), np.asarray(upper)),
        integrality=integrality,
        bounds=Bounds(low, high),
        options=options,
    )
    if result.x is None:
        return None
    placed: list[int] = [int(d) for d in np.asarray(result.x[:num_x]).reshape(n, k).argmax(axis=1)]
    if placement_problems(problem, placed, budgets):
        return None
    if below is not None and transfer_bytes(problem, placed) >= below:
        return None
    return placed


def _copies(problem: PartitionProblem, n: int) -> list[tuple[float, int, tuple[int, ...]]]:
    """``(bytes, start op, readers other than the start)`` of each value that may be copied."""
    found = []
    for value in problem.values:
        if value.nbytes <= 0 or not value.consumers:
            continue
        start = value.start
        if not 0 <= start < n:
            continue
        readers = tuple(op for op in dict.fromkeys(value.consumers) if op != start and 0 <= op < n)
        if readers:
            found.append((float(value.nbytes), start, readers))
    return found


def _alike_pairs(problem: PartitionProblem, budgets: Sequence[int]) -> list[tuple[int, int]]:
    """``(d, e)``: devices ``d < e`` of the same budget, neither pinned, ``e`` the next such after ``d``. Swapping two
    such devices changes neither the bytes copied nor what fits, so only placements whose first op on ``e`` comes
    after some op on ``d`` are searched."""
    pinned = set(problem.pinned.values())
    last: dict[int, int] = {}
    pairs = []
    for d, budget in enumerate(budgets):
        if d in pinned:
            continue
        if budget in last:
            pairs.append((last[budget], d))
        last[budget] = d
    return pairs


def _shared(problem: PartitionProblem) -> list[list[int]]:
    """Groups of ops that must run on one device: each span no cut may fall inside, and each colocated group."""
    groups = [list(range(lo, hi + 1)) for lo, hi in problem.no_cut_spans() if hi > lo]
    groups += [sorted(group) for group in problem.colocated if len(group) > 1]
    return groups
