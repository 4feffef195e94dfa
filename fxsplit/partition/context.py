"""Arrays derived once from a problem and its budgets, in op order, shared by the programmes.

:class:`Context` holds what the contiguous programmes (:mod:`fxsplit.partition.contiguous`), the
wrapped one (:mod:`fxsplit.partition.ring`) and the infeasibility messages
(:mod:`fxsplit.partition.infeasible`) read about a run of ops ``[start, stop)``: its resident bytes
and peak transient (:meth:`Context.weight`), the bytes crossing each position, where cuts are
forbidden and where pins end.

>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> chain = PartitionProblem(("a", "b"), (Value("w", 0, 0, (0,), weight=60), Value("a", 8, 0, (1,))))
>>> ctx = Context(chain, [100, 100])
>>> ctx.weight(0, 2), ctx.crossing
(60, [0, 8, 0])
"""

from __future__ import annotations

import numpy as np

from fxsplit.partition.problem import PartitionProblem

__all__ = ["Context"]


class Context:
    """Arrays derived once from ``problem`` and ``budgets`` (one entry per device, in stage order).

    Attributes:
        problem: the problem.
        budgets: bytes per device, as given.
        n: number of ops.
        prefix_weight: ``prefix_weight[t]``: resident bytes of ops ``[0, t)``.
        transient: transient bytes per op; ``has_transient``: whether any is non-zero.
        forbidden: ``forbidden[t]``: no device boundary may fall just before op ``t``.
        crossing: ``crossing[t]``: bytes of the values made before op ``t`` and read at or after it.
        reach: start, last reader and bytes of every copied value (arrays), for the wrapped programme.
        last_bad: ``last_bad[k][t]``: 1 + index of the last op before ``t`` pinned to a device other than ``k``.
    """

    def __init__(self, problem: PartitionProblem, budgets: list[int]) -> None:
        self.problem = problem
        self.budgets = budgets
        n = problem.num_ops
        self.n = n
        self.prefix_weight = np.concatenate([[0], np.cumsum(problem.op_weights(), dtype=np.int64)])
        self.transient = problem.transients()
        self.has_transient = any(self.transient)
        self._sparse = _SparseMax(self.transient) if self.has_transient else None
        self.forbidden = problem.forbidden_cuts()
        self.crossing = self._crossing()
        reaching = [v for v in problem.values if v.nbytes and v.consumers]
        # start, last reader and bytes of every copied value, for the wrapped programme
        self.reach = (
            np.array([v.start for v in reaching], dtype=np.int64),
            np.array([v.last for v in reaching], dtype=np.int64),
            np.array([v.nbytes for v in reaching], dtype=np.float64),
        )
        # last_bad[k][t]: 1 + index of the last op before t pinned to a device other than k.
        self.last_bad: list[list[int]] = []
        for k in range(len(budgets)):
            row = [0] * (n + 1)
            last = 0
            for t in range(1, n + 1):
                pin = problem.pinned.get(t - 1)
                if pin is not None and pin != k:
                    last = t
                row[t] = last
            self.last_bad.append(row)

    def _crossing(self) -> list[int]:
        diff = [0] * (self.n + 2)
        for value in self.problem.values:
            if value.consumers and value.nbytes and value.last > value.start:
                diff[value.start + 1] += value.nbytes
                diff[value.last + 1] -= value.nbytes
        crossing, running = [], 0
        for t in range(self.n + 1):
            running += diff[t]
            crossing.append(running)
        return crossing

    def weight(self, start: int, stop: int) -> int:
        """Bytes a device needs to run ops ``[start, stop)``: resident plus peak transient."""
        resident = int(self.prefix_weight[stop] - self.prefix_weight[start])
        if self._sparse is None or stop <= start:
            return resident
        return resident + self._sparse.max(start, stop)


class _SparseMax:
    """Range maximum in O(1) after O(n log n) set-up."""

    def __init__(self, values: list[int]) -> None:
        self.levels = [np.asarray(values, dtype=np.int64)]
        width = 1
        while 2 * width <= len(values):
            previous = self.levels[-1]
            self.levels.append(np.maximum(previous[:-width], previous[width:]))
            width *= 2

    def max(self, start: int, stop: int) -> int:
        level = (stop - start).bit_length() - 1
        row = self.levels[level]
        return int(max(row[start], row[stop - (1 << level)]))
