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

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from fxsplit.partition import _Context

__all__ = ["LONG_REACH", "WRAP_TRIES", "has_long_reach", "wrap_points", "wrapped_placement"]

WRAP_TRIES = 16
"""How many wrap points ``b`` are tried (each costs one pass of the exact programme)."""

LONG_REACH = 1 / 3
"""A value reaches far when it is made in the first third of the ops and read in the last third."""

_INF = float("inf")


def has_long_reach(ctx: _Context) -> bool:
    """Whether some copied value is made early and read late: only then can a wrap help."""
    n = ctx.n
    early, late = n * LONG_REACH, n * (1 - LONG_REACH)
    return any(v.nbytes and v.consumers and v.start < early and v.last >= late for v in ctx.problem.values)


def wrap_points(ctx: _Context, cands: np.ndarray, budget: int) -> list[int]:
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
        idx for idx, t in enumerate(cands.tolist())
        if 0 < t < n and t >= suffix_ok and not ctx.forbidden[t] and ctx.weight(t, n) <= budget
    ]
    if len(fitting) <= WRAP_TRIES:
        return fitting
    shares = np.array([(total - int(ctx.prefix_weight[cands[idx]])) for idx in fitting], dtype=np.float64)
    targets = np.linspace(shares.min(), shares.max(), WRAP_TRIES)
    chosen = {fitting[int(np.argmin(np.abs(shares - target)))] for target in targets}
    return sorted(chosen)


def wrapped_placement(ctx: _Context, cands: np.ndarray, cost: np.ndarray, seg_weight: np.ndarray,
                      masks: list[np.ndarray], budgets: Sequence[int], wrap: int) -> list[int] | None:
    """Op devices of the cheapest placement wrapped at ``cands[wrap]``, or None if none fits.

    ``cost``, ``seg_weight`` and ``masks`` are the contiguous programme's
    matrices over ``cands`` (segment copy cost, segment bytes, segment allowed
    on device k).
    """
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
    previous = np.where(fits0, suffix_cost + balance0, _INF)
    choices: list[np.ndarray] = []
    sub_cost = cost[:m, :m]
    for k in range(1, len(budgets)):
        budget = budgets[k]
        weight = seg_weight[:m, :m]
        fraction = weight / budget if budget > 0 else np.where(weight > 0, _INF, 0.0)
        total = np.where(masks[k][:m, :m], previous[:, None] + sub_cost + epsilon * fraction**2, _INF)
        best_start = m - 1 - np.argmin(total[::-1], axis=0)
        best = total[best_start, np.arange(m)]
        take = best < previous
        choices.append(np.where(take, best_start, -1))
        previous = np.where(take, best, previous)
    if previous[m - 1] == _INF:
        return None
    # Walk back: device k (k >= 1) ran [cands[start], cands[stop]); device 0 the rest.
    op_devices = [0] * n
    stop = m - 1
    for k in range(len(budgets) - 1, 0, -1):
        start = int(choices[k - 1][stop])
        if start < 0:
            continue
        for op in range(int(cands[start]), int(cands[stop])):
            op_devices[op] = k
        stop = start
    return op_devices


def _made_from(ctx: _Context, positions: np.ndarray, b: int) -> np.ndarray:
    """``out[j]``: bytes of values made in ``[positions[j], b)`` and read at or after ``b``."""
    by_start = np.zeros(len(positions) + 1)
    for value in ctx.problem.values:
        if value.nbytes and value.consumers and value.start < b <= value.last:
            # made in [positions[j], b) exactly for j < (number of positions <= start)
            by_start[int(np.searchsorted(positions, value.start, side="right"))] += value.nbytes
    return np.cumsum(by_start[::-1])[::-1][1:] if len(positions) else np.zeros(0)
