"""Placements by time: the fastest pipeline of contiguous stages, or the shortest forward.

Given seconds per op on each device and a link per pair of devices
(:class:`Timing`), a device's *stage time* is its ops' seconds plus the
copies it receives (each value once, ``latency + bytes / bandwidth`` over the
link from the value's device). Two objectives:

* ``"throughput"``: the smallest largest stage time over contiguous placements
  (devices in order take consecutive runs of ops, as pipeline stages do): a
  pipeline's steady state runs one micro-batch per slowest stage. Ties go to
  the smaller sum of stage times.
* ``"latency"``: the smallest sum of stage times: one forward, stages one after
  another.

:func:`fastest_boundaries` solves either exactly by dynamic programming over
the candidate positions (:func:`time_candidates`: all of them on graphs of up
to :data:`~fxsplit.partition.contiguous.EXACT_LIMIT` ops, else positions spread
evenly by time) when every link is alike; with unlike links the programme charges a
stage's incoming copies at the link from the device before it (the source of
every copy on a chain), and :func:`stage_times` then gives the true times of
the result.

>>> from fxsplit.partition.context import Context
>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> chain = PartitionProblem(("a", "b", "c", "d"), (Value("a", 8, 0, (1,)), Value("b", 8, 1, (2,)),
...                                                 Value("c", 8, 2, (3,))))
>>> timing = Timing.uniform(np.array([[3.0, 1.0, 1.0, 1.0]] * 2), bandwidth=8.0, latency=0.0)
>>> fastest_boundaries(Context(chain, [100, 100]), timing, "throughput")
[0, 1, 4]
>>> stage_times(chain, [0, 1, 1, 1], timing)  # (compute, copies) per device
[(3.0, 0.0), (3.0, 1.0)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fxsplit.partition.context import Context
from fxsplit.partition.contiguous import EXACT_LIMIT, _walk_back, candidates, cut_cost_matrix, segment_masks
from fxsplit.partition.problem import PartitionProblem

__all__ = ["TIME_OBJECTIVES", "Timing", "fastest_boundaries", "stage_times", "time_candidates", "time_of"]

TIME_OBJECTIVES = ("throughput", "latency")
_INF = float("inf")
_TIE = 1e-9  # relative: stage maxima this close count as equal, and the smaller sum decides


@dataclass(frozen=True)
class Timing:
    """Seconds per op on each device, and the links between devices.

    Attributes:
        op_seconds: ``op_seconds[k, op]``: seconds ``op`` takes on device ``k``.
        bandwidth: ``bandwidth[a, b]``: bytes per second of a copy from device ``a`` to ``b``.
        latency: ``latency[a, b]``: seconds every copy from ``a`` to ``b`` costs.
    """

    op_seconds: np.ndarray
    bandwidth: np.ndarray
    latency: np.ndarray

    @classmethod
    def uniform(cls, op_seconds: np.ndarray, *, bandwidth: float, latency: float) -> Timing:
        """Every pair of devices linked alike."""
        devices = op_seconds.shape[0]
        return cls(op_seconds, np.full((devices, devices), bandwidth), np.full((devices, devices), latency))

    def scaled(self, compute: float, copies: float) -> Timing:
        """Op times multiplied by ``compute`` and copy times by ``copies`` (a training step: forward + backward)."""
        return Timing(self.op_seconds * compute, self.bandwidth / copies, self.latency * copies)


def stage_times(problem: PartitionProblem, op_devices: Sequence[int], timing: Timing) -> list[tuple[float, float]]:
    """``(compute, copies)`` seconds per device for any placement: its ops, and each value it receives once."""
    devices = timing.op_seconds.shape[0]
    placed = np.asarray(op_devices, dtype=np.int64)
    compute = np.zeros(devices)
    if len(placed):
        np.add.at(compute, placed, timing.op_seconds[placed, np.arange(len(placed))])
    copies = np.zeros(devices)
    for value in problem.values:
        if not value.consumers or not value.nbytes:  # as transfer_bytes: an empty value is never copied
            continue
        home = int(placed[min(value.start, len(placed) - 1)])
        for destination in sorted({int(placed[c]) for c in value.consumers} - {home}):
            copies[destination] += (
                timing.latency[home, destination] + value.nbytes / timing.bandwidth[home, destination]
            )
    return list(zip(compute.tolist(), copies.tolist(), strict=True))


def time_of(stages: list[tuple[float, float]], objective: str) -> float:
    """The objective's value for stage times from :func:`stage_times`."""
    totals = [compute + copies for compute, copies in stages]
    return max(totals, default=0.0) if objective == "throughput" else sum(totals)


def fastest_boundaries(
    ctx: Context, timing: Timing, objective: str, cands: np.ndarray | None = None
) -> list[int] | None:
    """Boundaries of the fastest contiguous placement under ``ctx.budgets`` (device ``k`` runs ops
    ``[b[k], b[k + 1])``), by ``objective`` (one of :data:`TIME_OBJECTIVES`), or None when none fits."""
    cands = time_candidates(ctx, timing) if cands is None else cands
    m = len(cands)
    _, masks = segment_masks(ctx, cands, ctx.budgets)
    incoming = cut_cost_matrix(ctx, cands)
    counts = cut_cost_matrix(ctx, cands, count=True)
    prev_max, prev_sum = np.full(m, _INF), np.full(m, _INF)
    prev_max[0] = prev_sum[0] = 0.0
    choices: list[list[int]] = []
    for k in range(len(ctx.budgets)):
        prefix = np.concatenate([[0.0], np.cumsum(timing.op_seconds[k])])[cands]
        source = max(k - 1, 0)
        stage = (prefix[None, :] - prefix[:, None]) + counts * timing.latency[source, k]
        stage = np.where(masks[k], stage + incoming / timing.bandwidth[source, k], _INF)
        total_sum = prev_sum[:, None] + stage
        if objective == "throughput":
            total_max = np.maximum(prev_max[:, None], stage)
            best_max = total_max.min(axis=0)
            near = total_max <= best_max[None, :] * (1 + _TIE)
            start = np.argmin(np.where(near, total_sum, _INF), axis=0)
        else:
            total_max = total_sum
            start = np.argmin(total_sum, axis=0)
        columns = np.arange(m)
        new_max, new_sum = total_max[start, columns], total_sum[start, columns]
        take = _better(new_max, new_sum, prev_max, prev_sum)
        choices.append(np.where(take, start, -1).tolist())
        prev_max, prev_sum = np.where(take, new_max, prev_max), np.where(take, new_sum, prev_sum)
    if prev_sum[m - 1] == _INF:
        return None
    return [int(cands[i]) for i in _walk_back(choices, m - 1)]


def time_candidates(ctx: Context, timing: Timing) -> np.ndarray:
    """Where the time programme may put a boundary: every position on graphs of up to
    :data:`~fxsplit.partition.contiguous.EXACT_LIMIT` ops; beyond, the allowed positions on either side of
    evenly spaced fractions of the ops' total time (mean over devices), so that stages can be balanced to
    about 1/240 of the whole wherever the time lies (module boundaries and cheap cuts, which the bytes
    programme tries, may all sit in one part of the graph), together with those (its
    :func:`~fxsplit.partition.contiguous.candidates`) and both ends of every gap between ops pinned to
    different devices, where a boundary must fall."""
    n = ctx.n
    if n <= EXACT_LIMIT:
        return candidates(ctx, None)
    allowed = np.array([t for t in range(1, n) if not ctx.forbidden[t]], dtype=np.int64)
    chosen = {0, n, *candidates(ctx, None).tolist(), *_pin_changes(ctx)}
    if len(allowed):
        prefix = np.concatenate([[0.0], np.cumsum(timing.op_seconds.mean(axis=0))])
        targets = np.searchsorted(prefix, np.linspace(0.0, prefix[-1], (EXACT_LIMIT - 1) // 2 + 1)[1:-1])
        after = np.minimum(np.searchsorted(allowed, targets), len(allowed) - 1)
        before = np.maximum(after - 1, 0)
        chosen |= set(allowed[after].tolist()) | set(allowed[before].tolist())
    return np.array(sorted(chosen))


def _pin_changes(ctx: Context) -> set[int]:
    """Positions just after the last op pinned to one device and just before the next op pinned to another."""
    changes: set[int] = set()
    pinned = sorted(ctx.problem.pinned.items())
    for (op, device), (next_op, next_device) in zip(pinned, pinned[1:], strict=False):
        if device != next_device:
            changes |= {op + 1, next_op}
    return changes


def _better(new_max: np.ndarray, new_sum: np.ndarray, old_max: np.ndarray, old_sum: np.ndarray) -> np.ndarray:
    """Where ``(new_max, new_sum)`` is lexicographically smaller (maxima within :data:`_TIE` count as equal)."""
    finite = np.isfinite(new_max)
    with np.errstate(invalid="ignore"):  # inf - inf where neither fits: not equal, and not taken
        equal = np.abs(new_max - old_max) <= _TIE * np.maximum(np.abs(old_max), 1e-30)
    better: np.ndarray = finite & (
        (~equal & (new_max < old_max)) | (equal & (new_sum < old_sum)) | ~np.isfinite(old_max)
    )
    return better
