"""Measured links: how long a copy between two devices really takes (``profile=True``).

The link model (:class:`~fxsplit.hardware.Link`) charges ``latency + bytes /
bandwidth`` per copy. Its defaults are guesses per device kind; a large copy
often runs well below the nominal bandwidth (on logical CPU devices every copy
allocates a fresh tensor, whose pages are first touched by the copy itself).
:func:`profile_links` times the copy the generated code makes,
``tensor.to(destination)``, at a small size (for the latency) and at the
largest size the plan may copy (for the bandwidth), so the copies that decide
a stage's time are priced as they run.

All logical ``cpu:N`` devices share one measurement, as they share the memory.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from fxsplit.hardware import Link

__all__ = ["LARGEST_PROBE", "SMALL_PROBE", "measure_copy", "profile_links"]

SMALL_PROBE = 4096  # bytes of the copy that measures a link's latency
LARGEST_PROBE = 256 * 2**20  # the bandwidth probe copies the plan's largest value, up to this many bytes
_MIN_LARGE = 2**20  # and at least this many: smaller copies measure overhead, not bandwidth


def measure_copy(source: str, destination: str, nbytes: int, repeats: int = 5) -> float:
    """Median seconds of ``tensor.to(destination)`` for a ``nbytes`` tensor on ``source`` (one warm-up first)."""
    tensor = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=torch.device(source))
    seconds = []
    for run in range(repeats + 1):
        _sync(source, destination)
        start = time.perf_counter()
        copy = tensor.to(destination)
        _sync(source, destination)
        if run:
            seconds.append(time.perf_counter() - start)
        del copy
    return statistics.median(seconds)


def profile_links(devices: Sequence[str], largest: int, repeats: int = 5) -> dict[tuple[str, str], Link]:
    """A measured :class:`Link` for each ordered pair of distinct ``devices``.

    ``largest``: bytes of the largest value the plan may copy; the bandwidth is
    measured with a copy of that size (between 1 MiB and :data:`LARGEST_PROBE`),
    the latency with one of :data:`SMALL_PROBE` bytes.
    """
    size = min(max(int(largest), _MIN_LARGE), LARGEST_PROBE)
    measured: dict[tuple[str, str], Link] = {}
    cpu: Link | None = None
    for a in devices:
        for b in devices:
            if a == b:
                continue
            if _kind(a) == "cpu" and _kind(b) == "cpu":
                if cpu is None:
                    cpu = _link("cpu:0", "cpu:1", size, repeats)
                measured[(a, b)] = cpu
            else:
                measured[(a, b)] = _link(a, b, size, repeats)
    return measured


def _link(source: str, destination: str, size: int, repeats: int) -> Link:
    latency = measure_copy(source, destination, SMALL_PROBE, repeats)
    large = measure_copy(source, destination, size, repeats)
    return Link(bandwidth=size / max(large - latency, 1e-9), latency=latency)


def _kind(device: str) -> str:
    return device.split(":")[0]


def _sync(*devices: str) -> None:
    for device in devices:
        if _kind(device) == "cuda":
            torch.cuda.synchronize(torch.device(device))
