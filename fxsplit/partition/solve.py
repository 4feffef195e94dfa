"""Assign every op of a :class:`PartitionProblem` to a device, under budgets.

Pure functions over plain data (no torch). The placement is *contiguous*:
devices, in the order given, take consecutive runs of ops (a device may take
none). Among contiguous placements that respect the budgets, pins and
together-constraints, the default objective minimises the bytes copied
between devices, then spreads the load (sum of squared budget fractions).

Two dynamic programmes do the work:

* ``_relay_boundaries`` runs over *every* position in O(devices x ops) with a
  sliding-window minimum. It charges a value once for every boundary it
  crosses, which equals the true cost on chains and is an upper bound
  elsewhere (a value that skips a device is really copied once, directly).
* ``_exact_boundaries`` charges the true cost (one copy per value and
  destination device) and breaks ties by balance, over a set of candidate
  positions: all of them for graphs of up to ``EXACT_LIMIT`` ops, else module
  boundaries, the cheapest cut positions and the relay solution's cuts.

So the result is the exact optimum over contiguous placements for graphs of
up to ``EXACT_LIMIT`` ops, and never worse than the relay optimum otherwise.

Unless ``contiguous=True``, out-of-order steps follow: *wrapped* placements
(device 0 also runs the last ops, so skip connections and tied embeddings
stay home; :mod:`fxsplit.partition.ring`) compete with the contiguous one; with
unequal budgets both programmes also run over permuted device orders
(nothing out of order ties stage ``k`` to the ``k``-th budget; every order
for up to 4 devices on graphs of up to ``EXACT_LIMIT`` ops, else budgets
descending and ascending); single ops then move wherever that lowers the
bytes copied (:mod:`fxsplit.partition.refine`); on graphs of up to ``EXACT_LIMIT``
ops, pairs of devices exchange whole groups of ops along minimum cuts
(networkx max-flow, :mod:`fxsplit.partition.mincut`) where single moves are stuck;
and graphs of up to :data:`fxsplit.partition.exact.EXACT_OPS` ops are searched
exactly (:mod:`fxsplit.partition.exact`). When no contiguous placement fits, wrapped
placements, an out-of-order packing and (on small graphs) the exact search
are tried instead. Ties keep the budgets' own order.

>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> chain = PartitionProblem(
...     op_names=("a", "b", "c"),
...     values=(Value("w_a", 0, 0, (0,), weight=60), Value("w_b", 0, 1, (1,), weight=60),
...             Value("w_c", 0, 2, (2,), weight=60), Value("a", 8, 0, (1,)), Value("b", 4, 1, (2,))))
>>> partition(chain, [130, 130]).op_devices
(0, 0, 1)
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import NoReturn, Sequence

import numpy as np

from fxsplit.errors import BudgetError, SpecError
from fxsplit.options import OBJECTIVES
from fxsplit.partition.context import Context
from fxsplit.partition.exact import exact_placement
from fxsplit.partition.mincut import exchange
from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.refine import device_loads, frozen_ops, improve, pack, repair
from fxsplit.partition.ring import cheapest_wraps, has_long_reach, step_matrices, wrap_points
from fxsplit.units import format_size

__all__ = ["EXACT_LIMIT", "OBJECTIVES", "Partition", "partition", "transfer_bytes"]

EXACT_LIMIT = 479  # ops; such a graph has EXACT_LIMIT + 1 cut positions, all of them tried
RING_KEEP = 3
_INF = float("inf")


@dataclass(frozen=True)
class Partition:
    """A solved placement.

    Attributes:
        op_devices: device index of every op, in op order.
        transfer_bytes: bytes copied between devices per forward pass.
        device_weights: resident bytes (parameters, buffers) per device index.
    """

    op_devices: tuple[int, ...]
    transfer_bytes: int
    device_weights: tuple[int, ...]


def transfer_bytes(problem: PartitionProblem, op_devices: Sequence[int]) -> int:
    """Bytes copied per forward: each value once per device, other than its home, that reads it."""
    values, readers, starts, nbytes = problem.read_edges
    if not len(values):
        return 0
    devices = np.asarray(op_devices, dtype=np.int64)
    destination, home = devices[readers], devices[starts]
    away = (destination != home) & (nbytes > 0)
    copies = np.unique(values[away] * (int(devices.max()) + 1) + destination[away], return_index=True)[1]
    return int(nbytes[away][copies].sum())


def partition(
    problem: PartitionProblem,
    budgets: Sequence[int],
    *,
    objective: str = "min_transfer",
    device_names: Sequence[str] | None = None,
    contiguous: bool = False,
) -> Partition:
    """Place every op on a device so that each device's resident bytes fit its budget.

    Args:
        problem: ops, values and constraints.
        budgets: bytes each device may hold, in stage order.
        objective: ``"min_transfer"`` (fewest bytes between devices, then
            balance) or ``"balanced"`` (smallest largest budget fraction, then
            fewest bytes between devices).
        device_names: names for error messages (default ``device 0``, ...).
        contiguous: keep the placement contiguous (devices take consecutive
            runs of ops, in order), as a pipeline of stages needs. When False
            (the default), single ops may then move out of order wherever that
            lowers the bytes copied (see :mod:`fxsplit.partition.refine`).

    Raises:
        BudgetError: no placement fits; the message says what and by how much.
        SpecError: pins contradict the device order, the objective is unknown, or a budget is negative.
    """
    if objective not in OBJECTIVES:
        raise SpecError(f"objective must be one of {', '.join(OBJECTIVES)} (got {objective!r})")
    if not budgets:
        raise SpecError("budgets must name at least one device")
    names = list(device_names) if device_names else [f"device {k}" for k in range(len(budgets))]
    negative = [f"{name}: {budget}" for name, budget in zip(names, budgets, strict=True) if budget < 0]
    if negative:
        raise SpecError(f"budgets must not be negative ({', '.join(negative)}); is a reserve larger than a budget?")
    ctx = Context(problem, list(budgets))
    _check_pin_order(problem, names)
    if problem.num_ops == 0:
        return _result(problem, ctx, [0, 0] + [0] * (len(budgets) - 1))
    relay = None if problem.num_ops <= EXACT_LIMIT else _relay_boundaries(ctx, ctx.budgets)
    if problem.num_ops > EXACT_LIMIT and relay is None:
        return _folded(problem, ctx, names, contiguous)
    candidates = _candidates(ctx, relay)
    budgets_used = ctx.budgets
    if objective == "balanced":
        scale = _min_max_fraction(ctx, candidates)
        if scale is not None:
            budgets_used = [min(b, int(b * scale) + 1) for b in ctx.budgets]
    matrices = _Matrices.of(ctx, candidates, budgets_used)
    if contiguous:
        boundaries = _exact_boundaries(ctx, candidates, budgets_used, matrices)
        if boundaries is None:
            return _folded(problem, ctx, names, contiguous)
        return _result(problem, ctx, boundaries)
    found = _ordered_candidates(ctx, candidates, budgets_used, matrices)
    if not found:
        return _folded(problem, ctx, names, contiguous)
    costs = [transfer_bytes(problem, p) for p in found]
    cost = min(costs)
    op_devices = found[costs.index(cost)]  # ties: the budgets' own order, contiguous before wrapped
    exchanged = _exchanged(problem, op_devices, budgets_used) if cost else op_devices
    if exchanged is not op_devices:
        op_devices, cost = exchanged, transfer_bytes(problem, exchanged)
    if cost:
        op_devices = exact_placement(problem, budgets_used, op_devices, cost) or op_devices
        cost = transfer_bytes(problem, op_devices)
    loads = device_loads(problem, op_devices, len(budgets))
    return Partition(tuple(op_devices), cost, tuple(loads))


def _exchanged(problem: PartitionProblem, op_devices: list[int], budgets: Sequence[int]) -> list[int]:
    """Minimum-cut exchanges between device pairs (:mod:`fxsplit.partition.mincut`), then single moves again.

    Only for graphs of up to ``EXACT_LIMIT`` ops: each cut is a max-flow in
    Python (tens of ms on a few hundred ops).
    """
    if problem.num_ops > EXACT_LIMIT or len(budgets) < 2:
        return op_devices
    exchanged = exchange(problem, op_devices, budgets, frozen_ops(problem))
    if exchanged == op_devices:
        return op_devices
    return improve(problem, exchanged, budgets)


def _ordered_candidates(
    ctx: Context, cands: np.ndarray, budgets: Sequence[int], matrices: _Matrices
) -> list[list[int]]:
    """Contiguous and wrapped placements, improved, for each order of the devices :func:`_device_orders` gives.

    Out of order nothing ties stage ``k`` to the ``k``-th budget, so with
    unequal budgets the programmes also run over permuted budgets (the
    result relabelled back). The budgets' own order comes first.
    """
    found: list[list[int]] = []
    for order in _device_orders(ctx, budgets):
        permuted = [budgets[d] for d in order]
        m = matrices if permuted == list(budgets) and not found else _Matrices.of(ctx, cands, permuted, matrices.cost)
        boundaries = _exact_boundaries(ctx, cands, permuted, m)
        placed = [] if boundaries is None else [_devices_of(ctx.n, boundaries)]
        if not placed or transfer_bytes(ctx.problem, placed[0]):
            placed += _wrapped_candidates(ctx, cands, permuted, m, improved=False)
        found += [improve(ctx.problem, [order[d] for d in p], budgets) for p in placed]
    return found


def _device_orders(ctx: Context, budgets: Sequence[int]) -> list[tuple[int, ...]]:
    """Orders of the devices to try: the given one first; then, with unequal budgets and no pins, every
    distinct order for up to 4 devices on graphs of up to ``EXACT_LIMIT`` ops, else budgets descending and
    ascending. Orders that permute equal budgets only are the same problem and are skipped."""
    identity = tuple(range(len(budgets)))
    if ctx.problem.pinned or len(set(budgets)) < 2:
        return [identity]
    if len(budgets) <= 4 and ctx.n + 1 <= EXACT_LIMIT:
        orders = list(itertools.permutations(identity))
    else:
        descending = tuple(sorted(identity, key=lambda d: (-budgets[d], d)))
        orders = [identity, descending, descending[::-1]]
    seen: set[tuple[int, ...]] = set()
    distinct = []
    for order in orders:
        key = tuple(budgets[d] for d in order)
        if key not in seen:
            seen.add(key)
            distinct.append(order)
    return distinct


def _wrapped_candidates(
    ctx: Context,
    cands: np.ndarray,
    budgets: Sequence[int],
    matrices: _Matrices | None = None,
    *,
    improved: bool = True,
) -> list[list[int]]:
    """The cheapest placements where device 0 also runs the last ops (see :mod:`fxsplit.partition.ring`), improved.

    On graphs of more than ``EXACT_LIMIT`` ops only tried when a copied value
    is made early and read late (skip connections, tied embeddings); each
    wrap point costs one pass of the exact programme, and only the
    :data:`RING_KEEP` cheapest are kept.
    """
    if len(budgets) < 2 or (ctx.n + 1 > EXACT_LIMIT and not has_long_reach(ctx)):
        return []
    points = wrap_points(ctx, cands, budgets[0])
    if not points:
        return []
    m = matrices or _Matrices.of(ctx, cands, budgets)
    found = cheapest_wraps(ctx, cands, m.cost, m.seg_weight, m.steps, budgets, points, RING_KEEP)
    return [improve(ctx.problem, p, budgets) for p in found] if improved else found


def _folded(problem: PartitionProblem, ctx: Context, names: Sequence[str], contiguous: bool) -> Partition:
    """No contiguous placement fits: wrap or pack out of order (unless forbidden), then lower the copies."""
    if contiguous:
        _raise_infeasible(problem, ctx, names, contiguous)
    found = _wrapped_candidates(ctx, _candidates(ctx, None), ctx.budgets)
    near = _nearly_fitting(ctx)
    packed = repair(problem, near, ctx.budgets) if near is not None else None
    packed = packed if packed is not None else pack(problem, ctx.budgets)
    if packed is not None:
        found.append(improve(problem, packed, ctx.budgets))
    if not found:
        searched = exact_placement(problem, ctx.budgets, None)
        if searched is None:
            _raise_infeasible(problem, ctx, names, contiguous)
        found.append(searched)
    op_devices = min(found, key=lambda p: transfer_bytes(problem, p))
    op_devices = _exchanged(problem, op_devices, ctx.budgets)
    op_devices = exact_placement(problem, ctx.budgets, op_devices, transfer_bytes(problem, op_devices)) or op_devices
    loads = device_loads(problem, op_devices, len(ctx.budgets))
    return Partition(tuple(op_devices), transfer_bytes(problem, op_devices), tuple(loads))


def _check_pin_order(problem: PartitionProblem, names: Sequence[str]) -> None:
    previous: tuple[int, int] | None = None
    for op in sorted(problem.pinned):
        device = problem.pinned[op]
        if not 0 <= device < len(names):
            raise SpecError(
                f"op {problem.label(op)} is pinned to device index {device}, which is not among the budgets"
            )
        if previous is not None and device < previous[1]:
            raise SpecError(
                f"pins contradict the device order: {problem.label(previous[0])} is pinned to "
                f"'{names[previous[1]]}' but the later {problem.label(op)} to the earlier stage "
                f"'{names[device]}'; devices run in the order the budgets list them, so reorder "
                "the budgets or change a pin"
            )
        previous = (op, device)


def _relay_boundaries(ctx: Context, budgets: Sequence[int]) -> list[int] | None:
    """Cheapest contiguous placement when a value pays once per boundary it crosses."""
    n, crossing, forbidden = ctx.n, ctx.crossing, ctx.forbidden
    prefix = ctx.prefix_weight.tolist()
    previous = [0.0] + [_INF] * n
    choices: list[list[int]] = []
    for k, budget in enumerate(budgets):
        current = [0.0] + [_INF] * n
        choice = [-1] * (n + 1)
        window: deque[int] = deque()
        left = 0
        last_bad = ctx.last_bad[k]
        for t in range(1, n + 1):
            s = t - 1
            if previous[s] < _INF and (s == 0 or not forbidden[s]):
                key = previous[s] + crossing[s]
                while window and previous[window[-1]] + crossing[window[-1]] >= key:
                    window.pop()
                window.append(s)
            if ctx.has_transient:
                while left < t and ctx.weight(left, t) > budget:
                    left += 1
                if ctx.weight(left, t) > budget:
                    left = t
            else:
                while prefix[t] - prefix[left] > budget:
                    left += 1
            bound = max(left, last_bad[t])
            while window and window[0] < bound:
                window.popleft()
            best = previous[t]
            if window:
                s = window[0]
                if previous[s] + crossing[s] < best:
                    best = previous[s] + crossing[s]
                    choice[t] = s
            current[t] = best
        choices.append(choice)
        previous = current
    if previous[n] == _INF:
        return None
    return _walk_back(choices, n)


def _walk_back(choices: list[list[int]], n: int) -> list[int]:
    boundaries = [0] * (len(choices) + 1)
    boundaries[-1] = t = n
    for k in range(len(choices) - 1, -1, -1):
        s = choices[k][t]
        if s >= 0:
            t = s
        boundaries[k] = t
    boundaries[0] = 0
    return boundaries


def _candidates(ctx: Context, relay: list[int] | None) -> np.ndarray:
    """Positions where the exact programme may put a device boundary (at most ``EXACT_LIMIT + 1`` of them)."""
    n = ctx.n
    if n <= EXACT_LIMIT:
        return np.arange(n + 1)
    allowed = [t for t in range(1, n) if not ctx.forbidden[t]]
    chosen = {0, n, *(relay or [])}
    labels = ctx.problem.op_labels
    if labels:
        parts = [label.split(".") for label in labels]
        for depth in range(1, 5):
            level = {t for t in allowed if parts[t][:depth] != parts[t - 1][:depth]}
            if len(chosen | level) > (EXACT_LIMIT + 1) // 2:
                break
            chosen |= level
    by_cost = sorted(allowed, key=lambda t: (ctx.crossing[t], t))
    for t in by_cost:
        if len(chosen) > EXACT_LIMIT:
            break
        chosen.add(t)
    return np.array(sorted(chosen))


def _cut_cost_matrix(ctx: Context, cands: np.ndarray) -> np.ndarray:
    """``C[i, j]``: bytes copied into a device that runs ops ``[cands[i], cands[j])``."""
    m = len(cands)
    increments = np.zeros((m, m + 1))
    spanning = [v for v in ctx.problem.values if v.nbytes and v.consumers and v.last > v.start]
    if not spanning:
        return increments[:, :m]
    starts = np.array([v.start for v in spanning])
    lasts = np.array([v.last for v in spanning])
    los = np.searchsorted(cands, starts, side="right")
    his = np.searchsorted(cands, lasts, side="right")
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    for value, lo, hi in zip(spanning, los.tolist(), his.tolist(), strict=True):
        if lo >= hi:
            continue
        positions = cands[lo:hi]
        consumers = np.asarray(value.consumers)
        next_use = consumers[np.searchsorted(consumers, positions, side="left")]
        rows.append(np.arange(lo, hi))
        cols.append(np.searchsorted(cands, next_use, side="right"))
        sizes.append(np.full(hi - lo, value.nbytes, dtype=np.float64))
    if rows:
        np.add.at(increments, (np.concatenate(rows), np.concatenate(cols)), np.concatenate(sizes))
    return np.cumsum(increments, axis=1)[:, :m]


def _segment_masks(ctx: Context, cands: np.ndarray, budgets: Sequence[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    weights = ctx.prefix_weight[cands]
    seg_weight = (weights[None, :] - weights[:, None]).astype(np.float64)
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
class _Matrices:
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
    def of(cls, ctx: Context, cands: np.ndarray, budgets: Sequence[int], cost: np.ndarray | None = None) -> _Matrices:
        seg_weight, masks = _segment_masks(ctx, cands, budgets)
        cost = _cut_cost_matrix(ctx, cands) if cost is None else cost
        return cls(cost, seg_weight, masks, step_matrices(cost, seg_weight, masks, budgets))


def _exact_boundaries(ctx: Context, cands: np.ndarray, budgets: Sequence[int], matrices: _Matrices) -> list[int] | None:
    """Cheapest placement (true copy cost, then balance) with boundaries in ``cands``."""
    m = len(cands)
    previous = np.full(m, _INF)
    previous[0] = 0.0
    choices: list[list[int]] = []
    for k in range(len(budgets)):
        total = previous[:, None] + matrices.steps[k]
        # On ties take the latest start: ops without weights stay with the stage before.
        best_start = m - 1 - np.argmin(total[::-1], axis=0)
        best = total[best_start, np.arange(m)]
        take = best < previous
        choices.append(np.where(take, best_start, -1).tolist())
        previous = np.where(take, best, previous)
    if previous[m - 1] == _INF:
        return None
    positions = _walk_back(choices, m - 1)
    return [int(cands[i]) for i in positions]


def _min_max_fraction(ctx: Context, cands: np.ndarray) -> float | None:
    """Smallest achievable largest (device bytes / budget) over candidate placements."""
    seg_weight, masks = _segment_masks(ctx, cands, ctx.budgets)
    m = len(cands)
    previous = np.full(m, _INF)
    previous[0] = 0.0
    for k, budget in enumerate(ctx.budgets):
        fraction = seg_weight / budget if budget > 0 else np.where(seg_weight > 0, _INF, 0.0)
        total = np.where(masks[k], np.maximum(previous[:, None], fraction), _INF)
        previous = np.minimum(previous, total.min(axis=0))
    return None if previous[m - 1] == _INF else float(previous[m - 1])


def _devices_of(n: int, boundaries: list[int]) -> list[int]:
    """Op devices of a contiguous placement: device k runs ops ``[boundaries[k], boundaries[k + 1])``."""
    op_devices = [0] * n
    for k in range(len(boundaries) - 1):
        for op in range(boundaries[k], boundaries[k + 1]):
            op_devices[op] = k
    return op_devices


def _result(problem: PartitionProblem, ctx: Context, boundaries: list[int]) -> Partition:
    op_devices = _devices_of(problem.num_ops, boundaries)
    device_weights = [ctx.weight(boundaries[k], boundaries[k + 1]) for k in range(len(boundaries) - 1)]
    return Partition(tuple(op_devices), transfer_bytes(problem, op_devices), tuple(device_weights))


def _raise_infeasible(
    problem: PartitionProblem, ctx: Context, names: Sequence[str], contiguous: bool = True
) -> NoReturn:
    total, capacity = ctx.weight(0, ctx.n), sum(ctx.budgets)
    budget_list = ", ".join(f"'{d}' {format_size(b)}" for d, b in zip(names, ctx.budgets, strict=True))
    if total > capacity:
        raise BudgetError(
            f"the model's parameters and buffers need {format_size(total)} ({total} bytes) but the "
            f"budgets add up to {format_size(capacity)} ({capacity} bytes): short by "
            f"{format_size(total - capacity)} ({total - capacity} bytes) [{budget_list}]; "
            "raise the budgets or add a device"
        )
    for lo, hi, weight in _indivisible_blocks(ctx):
        pins = {problem.pinned[op] for op in range(lo, hi + 1) if op in problem.pinned}
        allowed = sorted(pins) if pins else list(range(len(ctx.budgets)))
        best = max(allowed, key=lambda k: (ctx.budgets[k], -k))
        if weight > ctx.budgets[best]:
            what = (
                problem.label(lo)
                if lo == hi
                else (f"ops {problem.label(lo)} .. {problem.label(hi)} (they must share a device)")
            )
            where = f"pinned device '{names[best]}'" if pins else f"every device (the largest, '{names[best]}',"
            tail = "" if pins else ")"
            raise BudgetError(
                f"{what} needs {format_size(weight)} ({weight} bytes){_heaviest(problem, lo, hi, weight)}, "
                f"more than the budget of {where} has {format_size(ctx.budgets[best])}{tail}: short by "
                f"{format_size(weight - ctx.budgets[best])} ({weight - ctx.budgets[best]} bytes); "
                "raise that budget" + (" or unpin" if pins else "")
            )
    _raise_fragmented(problem, ctx, names, total, capacity, contiguous)


def _heaviest(problem: PartitionProblem, lo: int, hi: int, needed: int) -> str:
    """' for its parameters and buffers (a 4.00 KiB, b 128 B)': the largest weights homed at ops lo..hi.

    When the problem also charges per-op memory (``op_extra``, ``op_transient``),
    the bytes are split into the weights and that memory.
    """
    homed = sorted(((v.weight, v.name) for v in problem.values if v.weight and lo <= v.start <= hi), reverse=True)
    listed = ", ".join(f"'{name}' {format_size(size)}" for size, name in homed[:3])
    more = f" and {len(homed) - 3} more" if len(homed) > 3 else ""
    weights = sum(size for size, _ in homed)
    if needed > weights and (problem.op_extra or problem.op_transient):
        named = f" ({listed}{more})" if homed else ""
        return (
            f": weights {format_size(weights)}{named} and per-op memory (activations) {format_size(needed - weights)}"
        )
    if not homed:
        return ""
    return f" for its parameters and buffers ({listed}{more})"


def _min_scale(ctx: Context) -> tuple[float, list[int] | None]:
    """The smallest factor on every budget (to about 0.01%) at which a contiguous placement fits, and it."""
    low, high = 1.0, 2.0
    found = _relay_boundaries(ctx, [int(b * high) for b in ctx.budgets])
    while found is None and high < 1e6:
        low, high = high, high * 2
        found = _relay_boundaries(ctx, [int(b * high) for b in ctx.budgets])
    for _ in range(14):
        middle = (low + high) / 2
        attempt = _relay_boundaries(ctx, [int(b * middle) for b in ctx.budgets])
        if attempt is None:
            low = middle
        else:
            high, found = middle, attempt
    return high, found


def _nearly_fitting(ctx: Context) -> list[int] | None:
    """Op devices of the contiguous placement that needs the least extra budget."""
    _, boundaries = _min_scale(ctx)
    if boundaries is None:
        return None
    return _devices_of(ctx.n, boundaries)


def _raise_fragmented(
    problem: PartitionProblem, ctx: Context, names: Sequence[str], total: int, capacity: int, contiguous: bool
) -> NoReturn:
    high, _ = _min_scale(ctx)
    shortfalls = ", ".join(
        f"'{d}' short by {format_size(int(b * high) - b)}" for d, b in zip(names, ctx.budgets, strict=True)
    )
    how = (
        (
            "in order without exceeding a budget (contiguous=True: ops run on consecutive devices, and "
            "indivisible pieces do not fit the gaps)"
        )
        if contiguous
        else ("without exceeding a budget, in order or out of order (indivisible pieces do not fit the gaps)")
    )
    raise BudgetError(
        f"the budgets hold {format_size(capacity)} and the model needs {format_size(total)}, but its "
        f"{problem.num_ops} ops cannot be packed into the devices {how}; it fits in order when "
        f"every budget is raised by {100 * (high - 1):.1f}% ({shortfalls}); raise the budgets, add a "
        "device, or remove pins and together-constraints"
    )


def _indivisible_blocks(ctx: Context) -> list[tuple[int, int, int]]:
    """Maximal runs of ops with no allowed cut between them, with their resident bytes."""
    blocks, start = [], 0
    for t in range(1, ctx.n + 1):
        if t == ctx.n or not ctx.forbidden[t]:
            blocks.append((start, t - 1, ctx.weight(start, t)))
            start = t
    return blocks
