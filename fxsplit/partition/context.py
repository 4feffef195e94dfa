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

import bisect
import itertools
from functools import cached_property

import numpy as np

from fxsplit.partition.problem import PartitionProblem

__all__ = ["LABEL_DEPTH", "NEVER_DIFFERS", "Context"]

NEVER_DIFFERS = 1 << 30
""":attr:`Context.label_depths` where two neighbouring ops' labels are equal."""

LABEL_DEPTH = 8
"""How many parts of each label :attr:`Context.label_depths` reads."""


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
        last_bad: ``last_bad[k][t]``: 1 + index of the last op before ``t`` pinned to a device other than ``k``
            (an array per device).
        held: home op, sorted readers and bytes of every ``held`` value read by more than one op: a run
            that reads it but does not hold its home op holds a copy too (:meth:`weight`, :meth:`held_matrix`).
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
        reaching = [v for v in problem.values if v.nbytes and v.consumers]
        # start, last reader and bytes of every copied value, for the wrapped programme
        self.reach = (
            np.array([v.start for v in reaching], dtype=np.int64),
            np.array([v.last for v in reaching], dtype=np.int64),
            np.array([v.nbytes for v in reaching], dtype=np.float64),
        )
        self._reaching = reaching
        self.crossing = self._crossing()
        # last_bad[k][t]: 1 + index of the last op before t pinned to a device other than k.
        self.last_bad: list[np.ndarray] = []
        for k in range(len(budgets)):
            row = np.zeros(n + 1, dtype=np.int64)
            for op, pin in problem.pinned.items():
                if pin != k and 0 <= op < n:
                    row[op + 1] = op + 1
            self.last_bad.append(np.maximum.accumulate(row))
        self.held: list[tuple[int, list[int], int]] = []
        for index in problem.held:
            value = problem.values[index]
            if value.weight and len(set(value.consumers)) > 1:
                self.held.append((min(value.start, max(n - 1, 0)), sorted(set(value.consumers)), value.weight))

    def _crossing(self) -> list[int]:
        starts, lasts, _ = self.reach
        spans = lasts > starts
        nbytes = np.array([v.nbytes for v in self._reaching], dtype=np.int64)[spans]
        diff = np.zeros(self.n + 2, dtype=np.int64)
        np.add.at(diff, starts[spans] + 1, nbytes)
        np.add.at(diff, lasts[spans] + 1, -nbytes)
        return [int(c) for c in np.cumsum(diff[: self.n + 1]).tolist()]

    @cached_property
    def readers(self) -> tuple[np.ndarray, np.ndarray]:
        """``(offsets, consumers)``: the readers of the ``i``-th value of :attr:`reach` are
        ``consumers[offsets[i]:offsets[i + 1]]``, sorted."""
        counts = np.array([len(v.consumers) for v in self._reaching], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        consumers = np.fromiter(
            itertools.chain.from_iterable(v.consumers for v in self._reaching), dtype=np.int64, count=int(offsets[-1])
        )
        return offsets, consumers

    @cached_property
    def label_depths(self) -> np.ndarray:
        """``label_depths[t]``: the smallest ``d`` such that the first ``d`` dot-separated parts of the labels
        of ops ``t - 1`` and ``t`` differ (op ``t`` starts a module at depth ``d`` and deeper), read up to
        depth :data:`LABEL_DEPTH` (labels that first differ deeper give ``LABEL_DEPTH + 1``);
        :data:`NEVER_DIFFERS` where they are equal, at ``t = 0`` and everywhere without ``op_labels``."""
        labels = self.problem.op_labels
        depths = np.full(self.n, NEVER_DIFFERS, dtype=np.int64)
        if not labels or self.n < 2:
            return depths
        distinct: dict[str, int] = {}
        label_id = np.fromiter((distinct.setdefault(label, len(distinct)) for label in labels), np.int64, self.n)
        part_ids: dict[str, int] = {}
        table = np.full((len(distinct), LABEL_DEPTH), -1, dtype=np.int64)  # the part ids of each distinct label
        for row, label in enumerate(distinct):
            for column, part in enumerate(label.split(".")[:LABEL_DEPTH]):
                table[row, column] = part_ids.setdefault(part, len(part_ids))
        parts = table[label_id]
        differ = parts[1:] != parts[:-1]
        first = np.where(differ.any(axis=1), differ.argmax(axis=1) + 1, LABEL_DEPTH + 1)
        depths[1:] = np.where(label_id[1:] != label_id[:-1], first, NEVER_DIFFERS)
        return depths

    def weight(self, start: int, stop: int) -> int:
        """Bytes a device needs to run ops ``[start, stop)``: resident (with the copies of the ``held`` values it
        reads) plus peak transient."""
        resident = int(self.prefix_weight[stop] - self.prefix_weight[start])
        if self.held and stop > start:
            resident += self._held_in(start, stop)
        if self._sparse is None or stop <= start:
            return resident
        return resident + self._sparse.max(start, stop)

    def _held_in(self, start: int, stop: int) -> int:
        """Bytes of the ``held`` values that ops ``[start, stop)`` read and whose home op is outside them."""
        extra = 0
        for home, readers, nbytes in self.held:
            if not start <= home < stop:
                first = bisect.bisect_left(readers, start)
                if first < len(readers) and readers[first] < stop:
                    extra += nbytes
        return extra

    def held_matrix(self, cands: np.ndarray) -> np.ndarray:
        """``extra[i, j]``: bytes of the ``held`` values a run ``[cands[i], cands[j])`` reads, its copies of
        them whose home op is outside it (zeros without ``held`` values)."""
        m = len(cands)
        steps = np.zeros((m, m + 1), dtype=np.int64)
        rows = np.arange(m)
        for home, readers, nbytes in self.held:
            ordered = np.asarray(readers, dtype=np.int64)
            first = np.searchsorted(ordered, cands)  # the first reader at or after each run's start
            reader = np.where(
                first < len(ordered), ordered[np.minimum(first, len(ordered) - 1)], np.iinfo(np.int64).max
            )
            low = np.searchsorted(cands, reader, side="right")  # runs ending after it read it ...
            high = np.where(cands > home, m, np.searchsorted(cands, home, side="right"))  # ... unless they hold home
            reads = low < high
            np.add.at(steps, (rows[reads], low[reads]), nbytes)
            np.add.at(steps, (rows[reads], high[reads]), -nbytes)
        return np.cumsum(steps, axis=1)[:, :m]


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
