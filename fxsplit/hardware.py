"""How fast devices compute and links copy: the numbers time estimates use, as plain data (no torch).

A :class:`DeviceSpeed` turns an op's work into seconds (a roofline: the slower
of its FLOPs at peak FLOP/s and its bytes at memory bandwidth, plus a fixed
cost per op); a :class:`Link` turns a copy into seconds (latency plus bytes
over bandwidth). :class:`Hardware` holds both for a set of devices: entries
named by device (``"cuda:3"``) win over entries named by kind (``"cuda"``),
which win over :data:`DEFAULT_SPEEDS` and :data:`DEFAULT_LINKS`. Users write
it as a mapping (in Python or under a spec's ``hardware:`` key)::

    hardware:
      devices:
        cuda: {flops: 300T, bandwidth: 2TB/s}
      links:
        cuda:0 <-> cuda:1: {bandwidth: 300GB/s, latency: 2us}

The defaults are round figures for the common case (a data-centre GPU, PCIe
between GPUs, one CPU core), meant for ranking placements, not for
promising times; ``profile=True`` measures the ops instead.

>>> hw = Hardware.coerce({"devices": {"cuda": {"flops": "300T"}},
...                       "links": {"cuda:0 <-> cuda:1": {"bandwidth": "300GB/s", "latency": "2us"}}})
>>> hw.speed("cuda:1").flops, hw.link("cuda:1", "cuda:0").bandwidth, hw.link("cuda:0", "cuda:2").bandwidth
(300000000000000.0, 300000000000.0, 25000000000.0)
>>> parse_rate("2TB/s", what="bandwidth"), parse_seconds("10us"), parse_flops("1.5 TFLOP/s")
(2000000000000.0, 1e-05, 1500000000000.0)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from fxsplit.errors import SpecError
from fxsplit.units import parse_size

__all__ = [
    "DEFAULT_LINKS",
    "DEFAULT_SPEEDS",
    "DeviceSpeed",
    "Hardware",
    "Link",
    "SPEED_KEYS",
    "format_seconds",
    "parse_flops",
    "parse_rate",
    "parse_seconds",
]


@dataclass(frozen=True)
class DeviceSpeed:
    """How fast one device computes.

    Attributes:
        flops: peak floating-point operations per second.
        bandwidth: memory bandwidth in bytes per second.
        overhead: seconds every op costs however small (dispatch, kernel launch).
        half_reduction: a product's reduction length (``K``) at which it runs at half the peak:
            ``K / (K + half_reduction)`` of it (0: every product at the peak).
        half_map: a convolution's output positions per image at which it runs at half the peak (0: none).
        norm_passes: passes over its input a batch norm makes in training beyond its forward's.
        half_channels: a convolution's input channels (per group) at which it runs at half the peak: ``C / (C +
            half_channels)`` of it (0: none): a network's first convolution, over an image's 3 channels, runs
            far below the peak.
        backward_half_map: a convolution over more than one kernel position (3x3, not 1x1): its output positions
            per image at which its backward runs at half the rate of its forward (0: none).
        strided_backward: a strided convolution's backward takes ``1 + strided_backward`` times what its FLOPs
            at the forward's rate say (0: no more).
        fresh_bandwidth: bytes per second at which a tensor too large for the allocator to reuse memory for
            (above :data:`~fxsplit.cost.compute.FRESH_ABOVE`) gets fresh memory: on a CPU, glibc maps new
            pages for it and the kernel zeroes each on its first write; 0 (a GPU's caching allocator): free.
    """

    flops: float
    bandwidth: float
    overhead: float = 0.0
    half_reduction: float = 0.0
    half_map: float = 0.0
    norm_passes: float = 7.0
    fresh_bandwidth: float = 0.0
    half_channels: float = 0.0
    backward_half_map: float = 0.0
    strided_backward: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {key: getattr(self, key) for key in SPEED_KEYS}


SPEED_KEYS = (
    "flops",
    "bandwidth",
    "overhead",
    "half_reduction",
    "half_map",
    "norm_passes",
    "fresh_bandwidth",
    "half_channels",
    "backward_half_map",
    "strided_backward",
)


@dataclass(frozen=True)
class Link:
    """How fast a copy from one device to another goes: ``latency + bytes / bandwidth`` seconds.

    Attributes:
        bandwidth: bytes per second.
        latency: seconds every copy costs however small.
    """

    bandwidth: float
    latency: float = 0.0

    def seconds(self, nbytes: float) -> float:
        """Seconds one copy of ``nbytes`` takes."""
        return self.latency + nbytes / self.bandwidth

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth": self.bandwidth, "latency": self.latency}


DEFAULT_SPEEDS: dict[str, DeviceSpeed] = {
    "cuda": DeviceSpeed(flops=100e12, bandwidth=2e12, overhead=10e-6),  # a data-centre GPU, 16-bit matmuls
    # one core; products below the peak, batch norm's passes and fresh pages as measured on one here (docs/TIME.md)
    "cpu": DeviceSpeed(
        flops=50e9,
        bandwidth=10e9,
        overhead=5e-6,
        half_reduction=40.0,
        half_map=2.0,
        norm_passes=14.0,
        fresh_bandwidth=2e9,
        half_channels=8.0,
        backward_half_map=9.0,
        strided_backward=0.6,
    ),
    "other": DeviceSpeed(flops=10e12, bandwidth=400e9, overhead=10e-6),  # mps, xpu, ...: a laptop-class GPU
}
"""Device kind -> speed, where :class:`Hardware` names neither the device nor its kind."""

DEFAULT_LINKS: dict[str, Link] = {
    # two logical devices of one memory (cpu:0 -> cpu:1): a copy into fresh memory, which goes at 1.5-15 GB/s
    # on the 2-core machines of the benchmarks (page faults slow the large ones), and 10-15 µs for a small one
    "same": Link(bandwidth=3e9, latency=10e-6),
    "other": Link(bandwidth=25e9, latency=10e-6),  # anything else: PCIe 4.0 x16
}
"""Links :class:`Hardware` does not name: ``"same"`` between devices of one memory (``cpu:N``), else ``"other"``."""


@dataclass(frozen=True)
class Hardware:
    """Device speeds and links, by device or by kind; what is not named takes the defaults.

    Attributes:
        devices: device (``"cuda:3"``) or kind (``"cuda"``) -> its speed.
        links: ``(a, b)`` device or kind pairs -> the link between them, both ways.
    """

    devices: Mapping[str, DeviceSpeed] = field(default_factory=dict)
    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)

    def speed(self, device: str) -> DeviceSpeed:
        """The speed of ``device``: its own entry, its kind's, or the default for its kind."""
        kind = _kind(device)
        found = self.devices.get(device) or self.devices.get(kind)
        return found or DEFAULT_SPEEDS.get(kind, DEFAULT_SPEEDS["other"])

    def link(self, source: str, destination: str) -> Link:
        """The link copies from ``source`` to ``destination`` take (entries hold both ways)."""
        kinds = (_kind(source), _kind(destination))
        for a, b in ((source, destination), kinds):
            found = self.links.get((a, b)) or self.links.get((b, a))
            if found is not None:
                return found
        same = kinds == ("cpu", "cpu")
        return DEFAULT_LINKS["same" if same else "other"]

    def to_dict(self) -> dict[str, Any]:
        """As plain data, the way :meth:`coerce` reads it (for plans and specs)."""
        return {
            "devices": {name: speed.to_dict() for name, speed in self.devices.items()},
            "links": {f"{a} <-> {b}": link.to_dict() for (a, b), link in self.links.items()},
        }

    @classmethod
    def coerce(cls, value: Any) -> Hardware:
        """Hardware from Hardware, None (all defaults) or a mapping ``{"devices": {...}, "links": {...}}``.

        Device entries take ``flops`` (``"300T"``, ``"300 TFLOP/s"`` or a number), ``bandwidth``
        (``"2TB/s"``, ``"25GiB/s"`` or bytes per second), ``overhead`` (``"10us"`` or seconds) and
        the plain numbers ``half_reduction``, ``half_map`` and ``norm_passes`` (:class:`DeviceSpeed`);
        what an entry leaves out comes from the default for its kind. Link keys are ``"a <-> b"``
        strings or ``(a, b)`` pairs of devices or kinds; entries take ``bandwidth`` and ``latency``.

        Raises:
            SpecError: an unknown key, a value that does not parse, or a rate that is not positive.
        """
        if value is None or isinstance(value, cls):
            return value or cls()
        if not isinstance(value, Mapping):
            raise SpecError(
                "hardware must be a mapping like {'devices': {'cuda': {'flops': '300T', 'bandwidth': '2TB/s'}}, "
                f"'links': {{'cuda:0 <-> cuda:1': {{'bandwidth': '300GB/s'}}}}}} (got {type(value).__name__})"
            )
        _only(value, ("devices", "links"), "hardware")
        problems: list[str] = []  # every entry's problem at once, as a spec lists them

        def checked(make: Any, *args: Any) -> Any:
            try:
                return make(*args)
            except SpecError as error:
                problems.append(str(error))
                return None

        devices = {str(name): checked(_speed, str(name), entry) for name, entry in (value.get("devices") or {}).items()}
        links = {checked(_pair, key): checked(_link, key, entry) for key, entry in (value.get("links") or {}).items()}
        if problems:
            raise SpecError("; ".join(problems))
        return cls(devices, links)


def _kind(device: str) -> str:
    return str(device).split(":", 1)[0]


def _only(entry: Mapping[str, Any], keys: tuple[str, ...], what: str) -> None:
    unknown = sorted(str(k) for k in entry if k not in keys)
    if unknown:
        raise SpecError(f"unknown {what} key(s) {', '.join(map(repr, unknown))}; keys are {', '.join(keys)}")


def _speed(name: str, entry: Any) -> DeviceSpeed:
    if isinstance(entry, DeviceSpeed):
        return entry
    if not isinstance(entry, Mapping):
        raise SpecError(f"hardware device {name!r} must be a mapping like {{'flops': '300T', 'bandwidth': '2TB/s'}}")
    _only(entry, SPEED_KEYS, f"hardware device {name!r}")
    base = DEFAULT_SPEEDS.get(_kind(name), DEFAULT_SPEEDS["other"])
    where = f"hardware device {name!r}"
    return DeviceSpeed(
        flops=parse_flops(entry["flops"], what=f"{where} flops") if "flops" in entry else base.flops,
        bandwidth=parse_rate(entry["bandwidth"], what=f"{where} bandwidth") if "bandwidth" in entry else base.bandwidth,
        overhead=parse_seconds(entry["overhead"], what=f"{where} overhead") if "overhead" in entry else base.overhead,
        half_reduction=_count(entry, "half_reduction", base.half_reduction, where),
        half_map=_count(entry, "half_map", base.half_map, where),
        norm_passes=_count(entry, "norm_passes", base.norm_passes, where),
        fresh_bandwidth=_fresh(entry, base.fresh_bandwidth, where),
        half_channels=_count(entry, "half_channels", base.half_channels, where),
        backward_half_map=_count(entry, "backward_half_map", base.backward_half_map, where),
        strided_backward=_count(entry, "strided_backward", base.strided_backward, where),
    )


def _fresh(entry: Mapping[str, Any], default: float, where: str) -> float:
    """``fresh_bandwidth``: a rate, or 0 for none (an allocator that keeps large blocks mapped)."""
    if "fresh_bandwidth" not in entry:
        return default
    value = entry["fresh_bandwidth"]
    return 0.0 if value in (0, "0") else parse_rate(value, what=f"{where} fresh_bandwidth")


def _count(entry: Mapping[str, Any], key: str, default: float, where: str) -> float:
    """A plain non-negative number under ``key`` (``default`` when absent)."""
    if key not in entry:
        return default
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise SpecError(f"{where} {key} must be a number >= 0 (got {value!r})")
    return float(value)


def _pair(key: Any) -> tuple[str, str]:
    if isinstance(key, tuple) and len(key) == 2:
        return str(key[0]), str(key[1])
    parts = [p.strip() for p in str(key).split("<->")]
    if len(parts) != 2 or not all(parts):
        raise SpecError(f"hardware link {key!r} must name two devices or kinds, like 'cuda:0 <-> cuda:1'")
    return parts[0], parts[1]


def _link(key: Any, entry: Any) -> Link:
    if isinstance(entry, Link):
        return entry
    where = f"hardware link {key!r}"
    if not isinstance(entry, Mapping) or "bandwidth" not in entry:
        raise SpecError(
            f"{where} must be a mapping with a bandwidth, like {{'bandwidth': '300GB/s', 'latency': '2us'}}"
        )
    _only(entry, ("bandwidth", "latency"), where)
    latency = parse_seconds(entry["latency"], what=f"{where} latency") if "latency" in entry else 0.0
    return Link(parse_rate(entry["bandwidth"], what=f"{where} bandwidth"), latency)


_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*(.*?)\s*$")
_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}


def _split(value: Any, what: str, example: str) -> tuple[float, str]:
    if isinstance(value, bool):
        raise SpecError(f"{what} must be a number or a string like {example!r} (got {value!r})")
    if isinstance(value, (int, float)):
        return float(value), ""
    match = _NUMBER.match(str(value))
    if match is None:
        raise SpecError(f"{what} must be a number or a string like {example!r} (got {value!r})")
    number = float(match.group(1)) * 10 ** int(match.group(2) or 0)
    return number, match.group(3)


def _positive(number: float, what: str, written: Any) -> float:
    if not math.isfinite(number) or number <= 0:
        raise SpecError(f"{what} must be positive and finite (got {written!r})")
    return number


def parse_flops(value: Any, *, what: str = "flops") -> float:
    """FLOP/s from a number or ``"300T"``, ``"300 TFLOP/s"``, ``"1.5e14"`` (decimal prefixes)."""
    number, unit = _split(value, what, "300 TFLOP/s")
    unit = unit.lower().replace("flop/s", "").replace("flops", "").strip()
    if unit not in _SI:
        raise SpecError(f"{what}: unknown unit in {value!r}; write a number or like '300T' or '300 TFLOP/s'")
    return _positive(number * _SI[unit], what, value)


def parse_rate(value: Any, *, what: str = "bandwidth") -> float:
    """Bytes per second from a number or ``"2TB/s"``, ``"25GiB/s"`` (a size as :func:`~fxsplit.units.parse_size`
    reads it, per second)."""
    number, _ = _split(value, what, "25GB/s")
    if not isinstance(value, str):
        return _positive(number, what, value)
    text = value.strip()
    if not text.lower().endswith("/s"):
        raise SpecError(f"{what} must be a rate like '25GB/s' or a number of bytes per second (got {value!r})")
    return _positive(float(parse_size(text[:-2], what=what)), what, value)


def parse_seconds(value: Any, *, what: str = "latency") -> float:
    """Seconds from a number or ``"10us"``, ``"10µs"``, ``"2ms"``, ``"5ns"``, ``"1s"``."""
    number, unit = _split(value, what, "10us")
    unit = unit.lower() or "s"
    if unit not in _PER_SECOND:
        raise SpecError(f"{what}: unknown unit in {value!r}; write seconds or like '10us', '2ms'")
    if not math.isfinite(number) or number < 0:
        raise SpecError(f"{what} must be >= 0 (got {value!r})")
    return number / _PER_SECOND[unit]


def format_seconds(seconds: float) -> str:
    """Seconds for people: ``'1.25 ms'``, ``'830 µs'``, ``'2.10 s'``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"
