"""Budgets from the memory the visible GPUs have free: ``budgets="auto"``.

:func:`auto_budgets` asks CUDA how much memory each visible device has free
right now (``torch.cuda.mem_get_info``, so it follows
``CUDA_VISIBLE_DEVICES`` and counts what other processes hold) and keeps a
reserve back for the CUDA context's growth, the caching allocator's
fragmentation and whatever else runs there.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fxsplit.errors import SpecError
from fxsplit.units import format_size

__all__ = ["DEFAULT_RESERVE", "auto_budgets"]

DEFAULT_RESERVE = "1GiB"


def auto_budgets(
    reserve: int | str | float = DEFAULT_RESERVE, *, devices: Sequence[int] | None = None
) -> dict[str, int]:
    """``{"cuda:0": free - reserve, ...}`` for every visible CUDA device (or those in ``devices``).

    Args:
        reserve: bytes to leave free on each device: an int, a size string
            (``"2GiB"``), or a share of the device's total memory: a float
            in ``[0, 1)`` or a percentage (``0.1`` and ``"10%"`` alike, as
            for the ``reserve`` option of :func:`fxsplit.fxsplit`).
        devices: CUDA indices to use (default: all visible ones, in order).

    Raises:
        SpecError: torch sees no CUDA device, an index is not visible, the
            reserve is malformed, or a device has no memory left after it.
    """
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise SpecError(
            "budgets='auto' reads the free memory of the visible CUDA devices, but torch sees none "
            f"(torch.cuda.is_available() is {torch.cuda.is_available()}, torch {torch.__version__}); pass budgets "
            "explicitly, e.g. {'cuda:0': '20GiB', 'cuda:1': '20GiB'} or {'cpu:0': '8GiB', 'cpu:1': '8GiB'}"
        )
    count = torch.cuda.device_count()
    indices = list(range(count)) if devices is None else list(devices)
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise SpecError(f"device {index!r} is not a visible CUDA index (0..{count - 1})")
    budgets: dict[str, int] = {}
    for index in indices:
        free, total = torch.cuda.mem_get_info(index)
        keep = _reserve_bytes(reserve, total)
        if free - keep <= 0:
            raise SpecError(
                f"'cuda:{index}' has {format_size(free)} free of {format_size(total)}, not more than the reserve "
                f"of {format_size(keep)}; free memory there, lower the reserve, or leave the device out (devices=[...])"
            )
        budgets[f"cuda:{index}"] = free - keep
    return budgets


def _reserve_bytes(reserve: int | str | float, total: int) -> int:
    from fxsplit.reserve import parse_headroom  # the same forms as the reserve option

    return parse_headroom(reserve, share_of="the device's memory").of(total)
