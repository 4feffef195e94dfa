"""Contiguous placements by dynamic programming: devices, in order, take consecutive runs of ops.

A device may take no ops. Two programmes place the boundaries between runs:

* :func:`relay_boundaries` runs over *every* position in O(devices x ops) with a
  sliding-window minimum. It charges a value once for every boundary it
  crosses, which equals the true cost on chains and is an upper bound
  elsewhere (a value that skips a device is really copied once, directly).
  Its feasibility is exact: None means no contiguous placement fits.
* :func:`exact_boundaries` charges the true cost (one copy per value and
  destination device) and breaks ties by balance (:func:`fxsplit.partition.ring.step_matrices`),
  over a set of candidate positions (:func:`candidates`): all of them for
  graphs of up to :data:`EXACT_LIMIT` ops, else module boundaries, the cheapest
  cut positions and the relay solution's cuts.

So :func:`exact_boundaries` gives the exact optimum over contiguous placements for
graphs of up to :data:`EXACT_LIMIT` ops, and never worse than the relay optimum
otherwise. :func:`min_max_fraction` and :func:`min_scale` answer the balance and
"how far from fitting" questions over the same positions.

>>> from fxsplit.partition.context import Context
>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> chain = PartitionProblem(
...     op_names=("a", "b", "c"),
...     values=(Value("w_a", 0, 0, (0,), weight=60), Value("w_b", 0, 1, (1,), weight=60),
...             Value("w_c", 0, 2, (2,), weight=60), Value("a", 8, 0, (1,)), Value("b", 4, 1, (2,))))
>>> ctx = Context(chain, [130, 130])
>>> cands = candidates(ctx, None)
>>> exact_boundaries(ctx, cands, ctx.budgets, Matrices.of(ctx, cands, ctx.budgets))
[0, 2, 3]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from fxsplit.partition.context import Context
from fxsplit.partition.ring import cheapest_starts, flip_steps, step_matrices

__all__ = [
    "EXACT_LIMIT",
    "Matrices",
    "candidates",
    "cut_cost_matrix",
    "devices_of",
    "exact_boundaries",
    "min_max_fraction",
    "min_scale",
    "relay_boundaries",
    "segment_masks",
]

EXACT_LIMIT = 479  # ops; such a graph has EXACT_LIMIT + 1 cut positions, all of them tried
_INF = float("inf")


def relay_boundaries(ctx: Context, budgets: Sequence[int]) -> list[int] | None:
    """Boundaries of the cheapest contiguous placement when a value pays once per boundary it crosses.

    Device ``k`` runs ops ``[b[k], b[k + 1])``. None when no contiguous placement fits: the
    programme visits every position, so that answer is exact.

    Device ``k``'s run ending at ``t`` may start at any ``s`` in ``[bound[t], t)`` (within its budget,
    after the last op pinned elsewhere); the cheapest start (the latest of those that tie) comes from a
    range-minimum table over all positions at once (:func:`_latest_argmin`), in numpy.
    """
    n = ctx.n
    crossing = np.asarray(ctx.crossing, dtype=np.float64)
    ineligible = np.asarray(ctx.forbidden, dtype=bool)  # a run may not start at a forbidden cut
    ineligible[0] = False
    ineligible[n] = True  # a run ending at t starts at t - 1 at the latest
    ends = np.arange(1, n + 1)
    previous = np.full(n + 1, _INF)
    previous[0] = 0.0
    choices: list[list[int]] = []
    for k, budget in enumerate(budgets):
        keys = previous + crossing
        keys[ineligible] = _INF
        bound = np.maximum(_run_starts(ctx, budget), np.asarray(ctx.last_bad[k], dtype=np.int64))[1:]
        start = _latest_argmin(keys, bound, ends - 1)
        best = np.where(start >= 0, keys[start], _INF)
        take = best < previous[1:]
        choice = np.full(n + 1, -1, dtype=np.int64)
        choice[1:][take] = start[take]
        previous = previous.copy()
        previous[1:][take] = best[take]
        choices.append(choice.tolist())
    if previous[n] == _INF:
        return None
    return _walk_back(choices, n)


def _run_starts(ctx: Context, budget: int) -> np.ndarray:
    """``left[t]``: the first op a device within ``budget`` can start at and run up to op ``t`` (excluded)."""
    n, prefix = ctx.n, ctx.prefix_weight
    if not ctx.has_transient and not ctx.held and bool(np.all(prefix[1:] >= prefix[:-1])):
        within = min(budget, int(prefix[n]))  # a larger budget starts every run at 0 too
        return np.searchsorted(prefix, prefix - within, side="left").astype(np.int64)
    left_of = [0] * (n + 1)
    left = 0
    for t in range(1, n + 1):
        while left < t and ctx.weight(left, t) > budget:
            left += 1
        if ctx.weight(left, t) > budget:
            left = t
        left_of[t] = left
    return np.asarray(left_of, dtype=np.int64)


def _latest_argmin(keys: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """For each query, the index in ``[lo, hi]`` of the smallest key (the latest of those that tie), or -1
    when the range is empty; a sparse table of O(len(keys) log len(keys)) entries."""
    table = [np.arange(len(keys))]
    width = 1
    while 2 * width <= len(keys):
        below = table[-1]
        first, second = below[:-width], below[width:]
        table.append(np.where(keys[second] <= keys[first], second, first))
        width *= 2
    found = np.full(len(lo), -1, dtype=np.int64)
    length = hi - lo + 1
    present = np.flatnonzero(length > 0)
    level = np.frexp(length[present].astype(np.float64))[1] - 1  # floor(log2(length)), exact
    for j in np.unique(level).tolist():
        rows = present[level == j]
        first = table[j][lo[rows]]
        second = table[j][hi[rows] - (1 << j) + 1]
        found[rows] = np.where(keys[second] <= keys[first], second, first)
    return found


def _walk_back(choices: list[list[int]], n: int) -> list[int]:
    """Boundaries from each device's choices: ``choices[k][t]`` is where device ``k``'s run ending at ``t``
    starts (-1: the device is empty)."""
    boundaries = [0] * (len(choices) + 1)
    boundaries[-1] = t = n
    for k in range(len(choices) - 1, -1, -1):
        s = choices[k][t]
        if s >= 0:
            t = s
        boundaries[k] = t
    boundaries[0] = 0
    return boundaries


def candidates(ctx: Context, relay: list[int] | None) -> np.ndarray:
    """Positions where the exact programme may put a device boundary (at most ``EXACT_LIMIT + 1`` of them).

    Every position on graphs of up to :data:`EXACT_LIMIT` ops; else both ends, ``relay``'s cuts, module
    boundaries (from ``op_labels``, shallowest first, while they fill at most half) and the allowed
    positions that fewest bytes cross.
    """
    n = ctx.n
    if n <= EXACT_LIMIT:
        return np.arange(n + 1)
    allowed = np.flatnonzero(~np.asarray(ctx.forbidden[:n], dtype=bool))
    allowed = allowed[allowed > 0]
    chosen = {0, n, *(relay or [])}
    if ctx.problem.op_labels:
        # op t starts a module at depth d when the first d parts of its label and the previous op's differ
        depth_of = ctx.label_depths[allowed]
        for depth in range(1, 5):
            level = set(allowed[depth_of <= depth].tolist())
            if len(chosen | level) > (EXACT_LIMIT + 1) // 2:
                break
            chosen |= level
    crossing = np.asarray(ctx.crossing, dtype=np.int64)[allowed]
    for t in allowed[np.lexsort((allowed, crossing))].tolist():  # fewest bytes crossing first, then earliest
        if len(chosen) > EXACT_LIMIT:
            break
        chosen.add(t)
    return np.array(sorted(chosen))


def cut_cost_matrix(ctx: Context, cands: np.ndarray, *, count: bool = False) -> np.ndarray:
    """``C[i, j]``: bytes copied into a device that runs ops ``[cands[i], cands[j])`` (with ``count``: how many
    values are).

    A value made before ``cands[i]`` and read at or after it is copied into that device when its first
    reader from ``cands[i]`` on is before ``cands[j]``: each (value, start position) pair adds its bytes
    at that reader's column, and a cumulative sum along the rows finishes the matrix.
    """
    m = len(cands)
    starts, lasts, nbytes = ctx.reach
    offsets, consumers = ctx.readers
    spanning = np.flatnonzero(lasts > starts)
    los = np.searchsorted(cands, starts[spanning], side="right")
    his = np.searchsorted(cands, lasts[spanning], side="right")
    counts = np.maximum(his - los, 0)
    if not counts.sum():
        return np.zeros((m, m))
    # one entry per (value, candidate position in (start, last]) pair
    pair_value = np.repeat(np.arange(len(spanning)), counts)
    first_pair = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rows = los[pair_value] + (np.arange(len(pair_value)) - first_pair[pair_value])
    # its next reader at or after the position: search (value, op) keys, values in order, readers sorted
    stride = ctx.n + 2
    owner = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    keys = owner * stride + consumers
    value = spanning[pair_value]
    next_use = consumers[np.searchsorted(keys, value * stride + cands[rows], side="left")]
    cols = np.searchsorted(cands, next_use, side="right")
    weights = np.ones(len(value)) if count else nbytes[value]
    increments = np.bincount(rows * (m + 1) + cols, weights=weights, minlength=m * (m + 1))
    return np.cumsum(increments.reshape(m, m + 1), axis=1)[:, :m]


def segment_masks(ctx: Context, cands: np.ndarray, budgets: Sequence[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(seg_weight, masks)``: the bytes a device running ``[cands[i], cands[j])`` needs, and whether device
    ``k`` may run it (within its budget, not starting at a forbidden cut, no op pinned elsewhere)."""
    weights = ctx.prefix_weight[cands]
    seg_weight = (weights[None, :] - weights[:, None]).astype(np.float64)
    if ctx.held:
        seg_weight += ctx.held_matrix(cands)
    m = len(cands)
    if ctx.has_transient:
        transient = np.asarray(ctx.transient, dtype=np.float64)
        pairs = zip(cands[:-1], cands[1:], strict=True)
        block_max = np.array([transient[a:b].max() if b > a else 0.0 for a, b in pairs])
        for i in range(m - 1):
            seg_weight[i, i + 1 :] += np.maximum.accumulate(block_max[i:])
    base = np.triu(np.ones((m, m), dtype=bool), k=1)
    starts_ok = np.array([t == 0 or not ctx.forbidden[t] for t in cands.tolist()])
    base &= starts_ok[:, None]
    masks: list[np.ndarray] = []
    shared: dict[tuple[int, int], np.ndarray] = {}  # devices alike (same budget, no pins) share one mask
    for k, budget in enumerate(budgets):
        key = (budget, k if ctx.problem.pinned else -1)
        if key not in shared:
            last_bad = np.asarray(ctx.last_bad[k])[cands]
            pins_ok = last_bad[None, :] <= cands[:, None]
            shared[key] = base & (seg_weight <= budget) & pins_ok
        masks.append(shared[key])
    return seg_weight, masks


@dataclass(frozen=True)
class Matrices:
    """The exact programmes' matrices over candidate positions, for one set of budgets.

    ``cost[i, j]``: bytes copied into a device running ``[cands[i], cands[j])``;
    ``seg_weight[i, j]``: the bytes it needs; ``masks[k][i, j]``: whether device
    ``k`` may run that segment; ``steps[k][i, j]``: what that segment adds to
    the objective (:func:`fxsplit.partition.ring.step_matrices`).
    """

    cost: np.ndarray
    seg_weight: np.ndarray
    masks: list[np.ndarray]
    steps: list[np.ndarray]

    @classmethod
    def of(cls, ctx: Context, cands: np.ndarray, budgets: Sequence[int], cost: np.ndarray | None = None) -> Matrices:
        seg_weight, masks = segment_masks(ctx, cands, budgets)
        cost = cut_cost_matrix(ctx, cands) if cost is None else cost
        return cls(cost, seg_weight, masks, step_matrices(cost, seg_weight, masks, budgets))

    @cached_property
    def flipped(self) -> list[np.ndarray]:
        """:attr:`steps` as :func:`~fxsplit.partition.ring.cheapest_starts` reads them."""
        return flip_steps(self.steps)


def exact_boundaries(ctx: Context, cands: np.ndarray, budgets: Sequence[int], matrices: Matrices) -> list[int] | None:
    """Boundaries of the cheapest contiguous placement (true copy cost, then balance) with boundaries in
    ``cands``, or None when none fits."""
    m = len(cands)
    previous = np.full(m, _INF)
    previous[0] = 0.0
    choices: list[list[int]] = []
    for k in range(len(budgets)):
        best_start, best = cheapest_starts(matrices.flipped[k], previous, last_only=k == len(budgets) - 1)
        take = best < previous
        choices.append(np.where(take, best_start, -1).tolist())
        previous = np.where(take, best, previous)
    if previous[m - 1] == _INF:
        return None
    positions = _walk_back(choices, m - 1)
    return [int(cands[i]) for i in positions]


def min_max_fraction(ctx: Context, cands: np.ndarray) -> float | None:
    """Smallest achievable largest (device bytes / budget) over contiguous placements with boundaries in ``cands``
    under ``ctx.budgets``, or None when none fits."""
    seg_weight, masks = segment_masks(ctx, cands, ctx.budgets)
    m = len(cands)
    previous = np.full(m, _INF)
    previous[0] = 0.0
    for k, budget in enumerate(ctx.budgets):
        fraction = seg_weight / budget if budget > 0 else np.where(seg_weight > 0, _INF, 0.0)
        total = np.where(masks[k], np.maximum(previous[:, None], fraction), _INF)
        previous = np.minimum(previous, total.min(axis=0))
    return None if previous[m - 1] == _INF else float(previous[m - 1])


def devices_of(n: int, boundaries: list[int]) -> list[int]:
    """Op devices of a contiguous placement: device k runs ops ``[boundaries[k], boundaries[k + 1])``."""
    op_devices = [0] * n
    for k in range(len(boundaries) - 1):
        for op in range(boundaries[k], boundaries[k + 1]):
            op_devices[op] = k
    return op_devices


def min_scale(ctx: Context, budgets: Sequence[int]) -> tuple[float, list[int] | None]:
    """The smallest factor on every budget (to about 0.01%) at which a contiguous placement fits, and its boundaries."""
    low, high = 1.0, 2.0
    found = relay_boundaries(ctx, [int(b * high) for b in budgets])
    while found is None and high < 1e6:
        low, high = high, high * 2
        found = relay_boundaries(ctx, [int(b * high) for b in budgets])
    for _ in range(14):
        middle = (low + high) / 2
        attempt = relay_boundaries(ctx, [int(b * middle) for b in budgets])
        if attempt is None:
            low = middle
        else:
            high, found = middle, attempt
    return high, found
