"""Byte sizes: parse ``"1.5GiB"``-style strings and print bytes for people.

>>> parse_size("512MiB")
536870912
>>> parse_size("2GB")
2000000000
>>> format_size(3 * 2**30)
'3.00 GiB'
"""

from __future__ import annotations

import math
import re

from fxsplit.errors import SpecError

__all__ = ["format_size", "parse_size"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_LARGEST = 2**63 - 1
"""The largest size fxsplit accepts (8 EiB): byte counts are summed in 64-bit integers."""
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([A-Za-z]*)\s*$")


def parse_size(value: object, *, what: str = "size") -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts non-negative ints, floats that are whole numbers, and strings with
    a decimal (``kB``, ``MB``, ``GB``, ``TB``) or binary (``KiB``, ``MiB``,
    ``GiB``, ``TiB``; also ``K``, ``M``, ``G``, ``T``) unit, case-insensitive.
    Fractions of a byte are rounded down.

    Raises:
        SpecError: the value is negative, not a number, has an unknown unit,
            or is not finite or above 8 EiB (``2**63 - 1`` bytes).
    """
    if isinstance(value, bool):
        raise SpecError(f"{what} must be a byte count or a string like '20GiB' (got {value!r})")
    if isinstance(value, int):
        if value < 0:
            raise SpecError(f"{what} must not be negative (got {value})")
        return _at_most_largest(value, value, what)
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise SpecError(f"{what} must be a finite, non-negative number (got {value!r})")
        return _at_most_largest(int(value), value, what)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is None and value.strip().startswith("-") and _SIZE.match(value.strip()[1:]):
            raise SpecError(f"{what} must not be negative (got {_clipped(value)})")
        if match is None:
            raise SpecError(
                f"{what} {_clipped(value)} is not a size; write a number with an optional unit, "
                "like '512MiB', '2GB' or '1.5GiB'"
            )
        number, exponent, unit = match.groups()
        factor = _UNITS.get(unit.lower())
        if factor is None:
            valid = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB"
            raise SpecError(f"{what} {_clipped(value)} has unknown unit {_clipped(unit)}; use one of {valid}")
        try:
            amount = float(number) * (10.0 ** int(exponent) if exponent else 1) * factor
        except OverflowError:
            amount = math.inf
        return _at_most_largest(int(amount) if math.isfinite(amount) else None, value, what)
    raise SpecError(f"{what} must be a byte count or a string like '20GiB' (got {type(value).__name__})")


def _at_most_largest(nbytes: int | None, written: object, what: str) -> int:
    """``nbytes``, or a SpecError when it is above ``_LARGEST`` (None: it overflowed)."""
    if nbytes is None or nbytes > _LARGEST:
        shown = f" {_clipped(written)}" if isinstance(written, (str, float)) else ""  # a huge int may not print
        raise SpecError(f"{what}{shown} is larger than the largest size fxsplit handles, 8 EiB (2**63 - 1 bytes)")
    return nbytes


def _clipped(text: object, limit: int = 60) -> str:
    """``repr(text)``, cut to about ``limit`` characters: a message never carries a whole hostile input."""
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[:limit]}...' ({len(str(text))} characters)"


def format_size(nbytes: int | None) -> str:
    """Format a byte count with a binary unit, for messages and tables."""
    if nbytes is None:
        return "unknown"
    sign = "-" if nbytes < 0 else ""
    value = float(abs(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{sign}{int(value)} B" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    return f"{sign}{value:.2f} TiB"
