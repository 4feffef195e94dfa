"""Placements where the first device also runs the *last* ops: contiguous on a ring.

A contiguous placement keeps each device's ops in one run, so a value made at
the start and read at the end (a U-Net's skip connections, an embedding whose
weight the language-model head reuses) is copied across the whole pipeline.
When the first device also takes a suffix ``[b, n)`` of the ops, such values
stay home. This module finds the cheapest such *wrapped* placement for a few
wrap points ``b``: device 0 runs ``[0, a)`` and ``[b, n)``, devices 1.. run
consecutive runs of ``[a, b)``, in order.

The cost is exact (one copy per value and destination device):

* a middle device running ``[i, j)`` receives what the contiguous programme
  charges it (values made before ``i`` and read in ``[i, j)``);
* device 0 receives, for its suffix, every value made in ``[a, b)`` and read
  at or after ``b``; values made in its own prefix cost nothing.

Pure numpy over the arrays the contiguous programme already built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from fxsplit.partition.context import Context

__all__ = [
    "LONG_REACH",
    "WRAP_TRIES",
    "cheapest_starts",
    "cheapest_wraps",
    "flip_steps",
    "has_long_reach",
    "step_matrices",
    "wrap_points",
    "wrapped_placement",
]

WRAP_TRIES = 16
"""How many wrap points ``b`` are tried (each costs one pass of the exact programme)."""

LONG_REACH = 1 / 3
"""A value reaches far when it is made in the first third of the ops and read in the last third."""

_INF = float("inf")


def has_long_reach(ctx: Context) -> bool:
    """Whether some copied value is made early and read late: only then can a wrap help."""
    n = ctx.n
    early, late = n * LONG_REACH, n * (1 - LONG_REACH)
    starts, lasts, _ = ctx.reach
    return bool(np.any((starts < early) & (lasts >= late)))


def wrap_points(ctx: Context, cands: np.ndarray, budget: int) -> list[int]:
    """Indices into ``cands`` of the wrap points to try, at most :data:`WRAP_TRIES`.

    A suffix fits device 0 only if its weights do; among those positions, the
    tries are spread evenly by the suffix's share of that budget, so short and
    long suffixes are both tried.
    """
    n = ctx.n
    pins = ctx.problem.pinned
    suffix_ok = n  # smallest t such that no op in [t, n) is pinned off device 0
    while suffix_ok > 0 and pins.get(suffix_ok - 1, 0) == 0:
        suffix_ok -= 1
    total = int(ctx.prefix_weight[n])
    fitting = [
        idx
        for idx, t in enumerate(cands.tolist())
        if 0 < t < n and t >= suffix_ok and not ctx.forbidden[t] and ctx.weight(t, n) <= budget
    ]
    if len(fitting) <= WRAP_TRIES:
        return fitting
    shares = np.array([(total - int(ctx.prefix_weight[cands[idx]])) for idx in fitting], dtype=np.float64)
    targets = np.linspace(shares.min(), shares.max(), WRAP_TRIES)
    chosen = {fitting[int(np.argmin(np.abs(shares - target)))] for target in targets}
    return sorted(chosen)


def step_matrices(
    cost: np.ndarray, seg_weight: np.ndarray, masks: list[np.ndarray], budgets: Sequence[int]
) -> list[np.ndarray]:
    """``steps[k][i, j]``: what device ``k`` running ``[cands[i], cands[j])`` adds to the programme's objective.

    The bytes copied into it plus a small balance term (its squared budget
    fraction, scaled so that it only breaks ties between equal copy costs);
    infinite where the segment does not fit or is not allowed. Devices with
    the same budget and mask share one matrix.
    """
    epsilon = 0.5 / len(budgets)
    shared: dict[tuple[int, int], np.ndarray] = {}
    steps: list[np.ndarray] = []
    for k, budget in enumerate(budgets):
        same = next((j for j in range(k) if budgets[j] == budget and masks[j] is masks[k]), k)
        key = (budget, same)
        if key not in shared:
            fraction = seg_weight / budget if budget > 0 else np.where(seg_weight > 0, _INF, 0.0)
            shared[key] = np.where(masks[k], cost + epsilon * fraction**2, _INF)
        steps.append(shared[key])
    return steps


def flip_steps(steps: list[np.ndarray]) -> list[np.ndarray]:
    """Each of ``steps`` transposed with its starts reversed, ``flipped[k][j, M - 1 - i] = steps[k][i, j]``
    (matrices shared between devices stay shared), for :func:`cheapest_starts`."""
    flipped: dict[int, np.ndarray] = {}
    for step in steps:
        if id(step) not in flipped:
            flipped[id(step)] = np.ascontiguousarray(step.T[:, ::-1])
    return [flipped[id(step)] for step in steps]


def cheapest_starts(
    flipped: np.ndarray, previous: np.ndarray, last_only: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """For each end ``j < m`` (``m = len(previous)``), the start ``i < m`` minimising ``previous[i] +
    steps[i, j]`` (the latest of those that tie: ops without weights stay with the stage before), and that
    minimum (infinite where no start fits; the start is then meaningless); ``flipped`` is ``steps`` as
    :func:`flip_steps` gives it. With ``last_only``, only for ``j = m - 1`` (infinite elsewhere): the
    last device's run must end there.

    Only starts before the end (``steps`` is infinite elsewhere) and within the finite part of
    ``previous`` are read, a block of ends at a time; the minimum runs along contiguous rows, the starts
    reversed so that the first minimum is the latest.
    """
    m, last = len(previous), flipped.shape[1] - 1
    starts = np.zeros(m, dtype=np.int64)
    best = np.full(m, _INF)
    finite = np.flatnonzero(previous < _INF)
    if not len(finite):
        return starts, best
    lo, hi = int(finite[0]), int(finite[-1])
    block = max(32, -(-m // 8))
    begin = max(lo + 1, m - 1) if last_only else lo + 1  # ends j <= lo have no finite start before them
    for first in range(begin, m, block):
        stop = min(first + block, m)
        top = min(stop - 2, hi)  # the latest start an end in [first, stop) may take
        total = flipped[first:stop, last - top : last - lo + 1] + previous[lo : top + 1][::-1]
        latest = total.argmin(axis=1)
        starts[first:stop] = top - latest
        best[first:stop] = total[np.arange(stop - first), latest]
    return starts, best


def wrapped_placement(
    ctx: Context,
    cands: np.ndarray,
    cost: np.ndarray,
    seg_weight: np.ndarray,
    masks: list[np.ndarray],
    budgets: Sequence[int],
    wrap: int,
) -> list[int] | None:
    """Op devices of the cheapest placement wrapped at ``cands[wrap]``, or None if none fits.

    ``cost``, ``seg_weight`` and ``masks`` are the contiguous programme's
    matrices over ``cands`` (segment copy cost, segment bytes, segment allowed
    on device k).
    """
    flipped = flip_steps(step_matrices(cost, seg_weight, masks, budgets))
    found = _wrapped(ctx, cands, cost, flipped, _start(ctx, cands, cost, seg_weight, budgets, wrap), budgets)
    return None if found is None else found[1]


def cheapest_wraps(
    ctx: Context,
    cands: np.ndarray,
    cost: np.ndarray,
    seg_weight: np.ndarray,
    steps: list[np.ndarray],
    budgets: Sequence[int],
    points: Sequence[int],
    keep: int,
) -> list[list[int]]:
    """The ``keep`` cheapest of the placements :func:`wrapped_placement` finds at ``points``, cheapest first.

    Ties go to the earlier wrap point. Each wrap point's placement is still
    the exact optimum there, but a point is skipped when a lower bound on its
    bytes (see :class:`_Start`) cannot enter the ``keep`` cheapest found so
    far: points are visited by increasing bound, so the search stops at the
    first such point.
    """
    starts = [_start(ctx, cands, cost, seg_weight, budgets, w) for w in points]
    flipped = flip_steps(steps)
    best: list[tuple[float, int, list[int]]] = []
    for start in sorted(starts, key=lambda s: (s.bound, s.wrap)):
        if len(best) >= keep and (start.bound, start.wrap) > best[keep - 1][:2]:
            break
        found = _wrapped(ctx, cands, cost, flipped, start, budgets)
        if found is not None:
            best.append((found[0], start.wrap, found[1]))
            best.sort(key=lambda item: item[:2])
            del best[keep:]
    return [op_devices for _, _, op_devices in best]


@dataclass(frozen=True)
class _Start:
    """Device 0's side of a wrap at ``cands[wrap]``, for each end ``cands[a]`` of its prefix.

    ``objective[a]``: bytes copied back to device 0 for its suffix plus its
    balance term (infinite where device 0 cannot hold prefix and suffix);
    ``suffix_cost[a]``: those bytes alone. ``bound``: a lower bound on the
    bytes of any placement wrapped here: the suffix's bytes plus every value
    made in the prefix and read in ``[a, b)`` (copied at least once, since
    other devices run those ops), at the best ``a``. With two devices it is
    the exact optimum.
    """

    wrap: int
    objective: np.ndarray
    suffix_cost: np.ndarray
    bound: float


def _start(
    ctx: Context, cands: np.ndarray, cost: np.ndarray, seg_weight: np.ndarray, budgets: Sequence[int], wrap: int
) -> _Start:
    n, b = ctx.n, int(cands[wrap])
    m = wrap + 1  # candidate positions 0..b
    suffix_resident = int(ctx.prefix_weight[n] - ctx.prefix_weight[b])
    suffix_peak = max(ctx.transient[b:n]) if ctx.has_transient else 0
    prefix_resident = ctx.prefix_weight[cands[:m]].astype(np.float64)
    prefix_peak = seg_weight[0, :m] - prefix_resident
    load0 = prefix_resident + suffix_resident + np.maximum(prefix_peak, suffix_peak)
    load0[0] = suffix_resident + suffix_peak
    prefix_pins_ok = np.asarray(ctx.last_bad[0])[cands[:m]] == 0
    fits0 = (load0 <= budgets[0]) & prefix_pins_ok
    suffix_cost = _made_from(ctx, cands[:m], b)  # copied back to device 0 for its suffix
    epsilon = 0.5 / len(budgets)
    balance0 = epsilon * (load0 / budgets[0]) ** 2 if budgets[0] > 0 else 0.0
    objective = np.where(fits0, suffix_cost + balance0, _INF)
    bounds = np.where(fits0, suffix_cost + cost[:m, wrap], _INF)
    return _Start(wrap, objective, suffix_cost, float(bounds.min()) if m else _INF)


def _wrapped(
    ctx: Context, cands: np.ndarray, cost: np.ndarray, flipped: list[np.ndarray], start: _Start, budgets: Sequence[int]
) -> tuple[int, list[int]] | None:
    """``(bytes copied, op devices)`` of the cheapest placement wrapped at ``start.wrap``, or None;
    ``flipped``: the step matrices as :func:`flip_steps` gives them."""
    m = start.wrap + 1
    previous = start.objective
    choices: list[np.ndarray] = []
    for k in range(1, len(budgets)):
        best_start, best = cheapest_starts(flipped[k], previous, last_only=k == len(budgets) - 1)
        take = best < previous
        choices.append(np.where(take, best_start, -1))
        previous = np.where(take, best, previous)
    if previous[m - 1] == _INF:
        return None
    # Walk back: device k (k >= 1) ran [cands[start], cands[stop]); device 0 the rest.
    op_devices = [0] * ctx.n
    stop, copied = m - 1, 0.0
    for k in range(len(budgets) - 1, 0, -1):
        first = int(choices[k - 1][stop])
        if first < 0:
            continue
        op_devices[int(cands[first]) : int(cands[stop])] = [k] * int(cands[stop] - cands[first])
        copied += cost[first, stop]
        stop = first
    return int(copied + start.suffix_cost[stop]), op_devices


def _made_from(ctx: Context, positions: np.ndarray, b: int) -> np.ndarray:
    """``out[j]``: bytes of values made in ``[positions[j], b)`` and read at or after ``b``."""
    if not len(positions):
        return np.zeros(0)
    starts, lasts, nbytes = ctx.reach
    crossing = (starts < b) & (lasts >= b)
    # made in [positions[j], b) exactly for j < (number of positions <= start)
    slots = np.searchsorted(positions, starts[crossing], side="right")
    by_start = np.bincount(slots, weights=nbytes[crossing], minlength=len(positions) + 1)
    return np.cumsum(by_start[::-1])[::-1][1:]
