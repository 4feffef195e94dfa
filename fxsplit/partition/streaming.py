"""Which weights of one device to stream: keep the most bytes resident, stream the rest (pure; no torch).

A device that cannot hold all the weights its ops read keeps some resident
and has the others copied in from storage before the op that reads them.
The copy for the ``k``-th weight-reading op of the device starts before op
``k - prefetch`` and is freed after op ``k``, so while op ``k`` runs the
streamed groups (a group: the streamed weights one op reads) of ops ``k``
to ``k + prefetch`` are in memory: the device needs room for the largest
such window of ``prefetch + 1`` consecutive groups (at most ``prefetch + 1``
times the largest group) besides what stays resident. Bytes streamed per
forward are the streamed weights' bytes times the number of ops that read
them; the choice minimises that.

For each candidate size ``L`` of the largest window (0, every weight's
size, every group, every window with all its weights streamed), weights
larger than ``L`` stay, windows whose streamed weights exceed ``L`` keep
resident the weights of their last op first (the next windows share them),
and the room left after ``L`` is filled with the weights read most, largest
first. The best candidate wins (fewest bytes streamed,
then the smallest buffers).

>>> reads = [["a"], ["b"], ["c"], ["d"]]  # four ops, each reading one weight
>>> choice = choose_streamed({"a": 40, "b": 40, "c": 10, "d": 10}, reads, capacity=95, prefetch=0)
>>> sorted(choice.streamed), choice.resident_bytes, choice.buffer_bytes, choice.streamed_per_forward
(['c', 'd'], 80, 10, 20)
>>> choose_streamed({"a": 60}, [["a"]], capacity=50, prefetch=0) is None  # one op's weights never fit
True
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["StreamChoice", "choose_streamed"]

MAX_CANDIDATES = 256
"""Candidate group sizes tried at most (evenly spaced among the distinct sizes)."""
DESCENT_LIMIT = 300
"""Devices with at most this many streamable weights get the last, slower search when the others fail."""


@dataclass(frozen=True)
class StreamChoice:
    """What one device streams.

    Attributes:
        streamed: the weights stored off the device and copied in per use.
        resident_bytes: bytes of the weights that stay.
        buffer_bytes: room for the copies in flight: the largest window of
            ``prefetch + 1`` consecutive streamed groups.
        streamed_per_forward: bytes copied in per forward (a weight read by
            two ops is copied twice).
    """

    streamed: frozenset[str]
    resident_bytes: int
    buffer_bytes: int
    streamed_per_forward: int


def choose_streamed(
    weights: Mapping[str, int], op_reads: Sequence[Sequence[str]], capacity: int, prefetch: int
) -> StreamChoice | None:
    """The weights to stream so that residents plus buffers fit ``capacity``, streaming the fewest bytes.

    Args:
        weights: the device's streamable weights -> bytes.
        op_reads: for each op the device runs that reads weights, in the
            order they run, the streamable weights it reads (possibly none;
            a weight no op reads costs nothing to store elsewhere).
        capacity: bytes left for these weights and the streaming buffers.
        prefetch: streamed groups copied ahead of the one in use.

    Returns:
        The choice, or None when no choice fits (some op's weights alone,
        times ``prefetch + 1``, exceed what is left).
    """
    total = sum(weights.values())
    if total <= capacity:
        return StreamChoice(frozenset(), total, 0, 0)
    reads = dict.fromkeys(weights, 0)
    groups = [tuple(dict.fromkeys(w for w in op if w in weights)) for op in op_reads]
    for group in groups:
        for name in group:
            reads[name] += 1
    best: StreamChoice | None = None
    for limit in _candidates(weights, groups, prefetch):
        for cover in (False, True):
            found = _choose_for(limit, weights, reads, groups, capacity, prefetch, cover)
            if found is not None and (best is None or _key(found) < _key(best)):
                best = found
    if best is None:
        best = _from_all_streamed(weights, reads, _windows(groups, prefetch), capacity)
    if best is None and len(weights) <= DESCENT_LIMIT:
        best = _descend(weights, reads, _windows(groups, prefetch), capacity)
    return best


def _key(choice: StreamChoice) -> tuple[int, int, int]:
    return choice.streamed_per_forward, choice.buffer_bytes, len(choice.streamed)


def _windows(groups: Sequence[Sequence[str]], prefetch: int) -> list[tuple[tuple[int, str], ...]]:
    """``(op, weight)`` for the weights of every run of ``prefetch + 1`` consecutive ops (fewer at the start).

    A weight two ops of a run read is there twice: each op gets its own copy.
    """
    return [tuple((op, w) for op in range(max(0, i - prefetch), i + 1) for w in groups[op]) for i in range(len(groups))]


def _candidates(weights: Mapping[str, int], groups: Sequence[Sequence[str]], prefetch: int) -> list[int]:
    windows = _windows(groups, prefetch)
    sizes = {
        0,
        *weights.values(),
        *(sum(weights[w] for w in g) for g in groups),
        *(sum(weights[w] for _, w in window) for window in windows),
    }
    ordered = sorted(sizes)
    if len(ordered) <= MAX_CANDIDATES:
        return ordered
    step = len(ordered) / MAX_CANDIDATES
    return sorted({ordered[int(i * step)] for i in range(MAX_CANDIDATES)} | {ordered[-1]})


def _choose_for(
    limit: int,
    weights: Mapping[str, int],
    reads: Mapping[str, int],
    groups: Sequence[Sequence[str]],
    capacity: int,
    prefetch: int,
    cover: bool = False,
) -> StreamChoice | None:
    """The best choice whose windows of streamed weights are at most ``limit`` bytes, or None.

    ``cover``: a window over the limit keeps resident the smallest weight that alone brings it under
    (when one does) instead of its last op's largest weights: fewer resident bytes spent there.
    """
    room = capacity - limit
    if room < 0:
        return None
    windows = _windows(groups, prefetch)
    resident = {w for w, n in weights.items() if n > limit and reads[w]}
    for window in windows:  # a window whose streamed weights exceed the limit keeps some resident:
        copies = Counter(w for _, w in window if w not in resident)
        excess = sum(weights[w] * n for w, n in copies.items()) - limit
        latest = {w: op for op, w in window}  # the last op's first (the next windows hold them too)
        order = sorted(copies, key=lambda w: (-latest[w], -weights[w], w))
        if cover:
            enough = [w for w in copies if weights[w] * copies[w] >= excess]
            order = sorted(enough, key=lambda w: (weights[w], w))[:1] + order
        for name in order:
            if name in resident:
                continue
            if excess <= 0:
                break
            resident.add(name)
            excess -= weights[name] * copies[name]
    used = sum(weights[w] for w in resident)
    if used > room:
        return None
    # fill what is left: the weights read most first, then the largest (first fit decreasing)
    for name in sorted(weights, key=lambda w: (-reads[w], -weights[w], w)):
        if name not in resident and used + weights[name] <= room:
            resident.add(name)
            used += weights[name]
    streamed_set = frozenset(w for w in weights if w not in resident)
    buffers = max((sum(weights[w] for _, w in window if w in streamed_set) for window in windows), default=0)
    per_forward = sum(weights[w] * reads[w] for w in streamed_set)
    return StreamChoice(streamed_set, used, buffers, per_forward)


def _peak(weights: Mapping[str, int], windows: Sequence[Sequence[tuple[int, str]]], streamed: set[str]) -> int:
    return max((sum(weights[w] for _, w in window if w in streamed) for window in windows), default=0)


def _made(
    weights: Mapping[str, int], reads: Mapping[str, int], windows: _Windows, streamed: set[str], used: int
) -> StreamChoice:
    per_forward = sum(weights[w] * reads[w] for w in streamed)
    return StreamChoice(frozenset(streamed), used, _peak(weights, windows, streamed), per_forward)


_Windows = Sequence[Sequence[tuple[int, str]]]


def _descend(
    weights: Mapping[str, int], reads: Mapping[str, int], windows: _Windows, capacity: int
) -> StreamChoice | None:
    """From everything resident, stream one weight at a time, the one that lowers the need most (or keeps it,
    the cheapest to stream), until it fits."""
    streamed: set[str] = set()
    used = sum(weights.values())
    need = used
    while need > capacity:
        options = [
            (used - weights[w] + _peak(weights, windows, streamed | {w}), weights[w] * reads[w], w)
            for w in weights
            if w not in streamed
        ]
        if not options:
            return None
        best_need, _, name = min(options)
        if best_need > need:  # ties go on (a plateau): each step streams one more weight, so it ends
            return None
        streamed.add(name)
        used -= weights[name]
        need = best_need
    return _made(weights, reads, windows, streamed, used)


def _from_all_streamed(
    weights: Mapping[str, int], reads: Mapping[str, int], windows: _Windows, capacity: int
) -> StreamChoice | None:
    """When no candidate limit worked: stream everything, then keep resident whatever still fits, one by one."""
    streamed = set(weights)
    if _peak(weights, windows, streamed) > capacity:
        return None
    used = 0
    for name in sorted(weights, key=lambda w: (-reads[w], -weights[w], w)):
        streamed.discard(name)
        if used + weights[name] + _peak(weights, windows, streamed) <= capacity:
            used += weights[name]
        else:
            streamed.add(name)
    return _made(weights, reads, windows, streamed, used)
