"""Memory a device keeps free: :class:`Headroom`, read by :func:`parse_headroom`; :func:`reserve_bytes` per device.

A reserve is a size (``"2GiB"``, ``2147483648``), a share of the budget
(``"10%"``, ``0.1``), or a mapping device -> either.

>>> parse_headroom("10%").of(2048), reserve_bytes("1KiB", {"cuda:0": 4096, "cuda:1": 0})
(204, {'cuda:0': 1024, 'cuda:1': 0})
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from fxsplit.errors import SpecError
from fxsplit.units import format_size, parse_size
from fxsplit.yamlfile import short_repr as _short

__all__ = ["Headroom", "parse_headroom", "reserve_bytes"]

_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


@dataclass(frozen=True)
class Headroom:
    """Memory to keep free on a device: a byte count plus a fraction of the budget."""

    nbytes: int = 0
    fraction: float = 0.0

    def of(self, budget: int) -> int:
        """Bytes held back from ``budget``."""
        return self.nbytes + int(budget * self.fraction)

    def __str__(self) -> str:
        parts = [format_size(self.nbytes)] if self.nbytes else []
        parts += [f"{100 * self.fraction:g}%"] if self.fraction else []
        return " + ".join(parts) or "0 B"


def parse_headroom(value: Any, *, what: str = "reserve", share_of: str = "the budget") -> Headroom:
    """``"2GiB"``, ``2147483648``, ``"10%"`` or ``0.1`` (both of the budget) as a :class:`Headroom`.

    A float is always a fraction, as in :func:`fxsplit.auto_budgets`: bytes
    are an int or a size string.

    Raises:
        SpecError: not a size, a percentage below 100, or a fraction below 1.
    """
    if isinstance(value, Headroom):
        return value
    if isinstance(value, float):
        if not 0 <= value < 1:
            raise SpecError(
                f"{what} {value!r} is a float, which means a fraction of {share_of} from 0 to below 1 "
                "(0.1 is '10%'); for bytes write an int or a size like '100MiB'"
            )
        return Headroom(fraction=value)
    if isinstance(value, str) and "%" in value:
        match = _PERCENT.match(value)
        if match is None or float(match.group(1)) >= 100:
            raise SpecError(
                f"{what} {_short(value)} is not a percentage of {share_of} from 0% to below 100%, like '10%'"
            )
        return Headroom(fraction=float(match.group(1)) / 100)
    return Headroom(nbytes=parse_size(value, what=what))


def reserve_bytes(reserve: Any, budgets: Mapping[str, int]) -> dict[str, int]:
    """Bytes to hold back on each device: ``reserve`` is a size, ``"N%"`` or a mapping device -> either.

    A device with a budget of 0 holds nothing, so nothing is held back
    there (its usable budget is 0, never negative).

    Raises:
        SpecError: a bad size, a device without a budget, or a reserve that
            leaves nothing of a non-zero budget.
    """
    if reserve is None:
        return {}
    if isinstance(reserve, Mapping):
        from fxsplit.devices import normalize_device  # loads torch: importing the spec does not

        rooms: dict[str, Headroom] = {}
        for key, value in reserve.items():
            device = normalize_device(key)
            if device not in budgets:
                raise SpecError(f"reserve names '{device}', which has no budget (devices: {', '.join(budgets)})")
            rooms[device] = parse_headroom(value, what=f"reserve of '{device}'")
    else:
        room = parse_headroom(reserve)
        rooms = {device: room for device in budgets}
    held = {device: rooms[device].of(budget) if device in rooms and budget else 0 for device, budget in budgets.items()}
    for device, nbytes in held.items():
        if budgets[device] and nbytes >= budgets[device]:
            raise SpecError(
                f"reserve {rooms[device]} of '{device}' leaves nothing of its budget "
                f"{format_size(budgets[device])}; reserve less or raise the budget"
            )
    return held
