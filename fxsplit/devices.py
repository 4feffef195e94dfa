"""Device names and budgets: turn what users write into canonical strings."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from fxsplit.errors import SpecError
from fxsplit.units import parse_size

__all__ = ["normalize_budgets", "normalize_device"]


def normalize_device(key: Any) -> str:
    """Canonical name of a device: ``0`` -> ``"cuda:0"``, ``torch.device("cpu", 1)`` -> ``"cpu:1"``.

    Raises:
        SpecError: the key names no device torch knows, or names ``meta``.
    """
    if isinstance(key, bool):
        raise SpecError(f"device must be a string, torch.device or int (got {key!r})")
    if isinstance(key, int):
        if key < 0:
            raise SpecError(f"device index must not be negative (got {key})")
        return f"cuda:{key}"
    if isinstance(key, torch.device):
        device = key
    elif isinstance(key, str):
        try:
            device = torch.device(key.strip())
        except RuntimeError as error:
            raise SpecError(
                f"{key!r} is not a device; write 'cuda:0', 'cpu', 'cpu:1', or an int for a CUDA index ({error})"
            ) from None
    else:
        raise SpecError(f"device must be a string, torch.device or int (got {type(key).__name__})")
    if device.type == "meta":
        raise SpecError("'meta' holds no data and cannot run a stage; plan for real devices (a meta *model* is fine)")
    return str(device)


def normalize_budgets(budgets: Mapping[Any, Any]) -> dict[str, int]:
    """Budgets as an ordered ``{device name: bytes}``; the order is the order of stages.

    Raises:
        SpecError: not a mapping, empty, a bad device, a bad size, or two keys for one device.
    """
    if not isinstance(budgets, Mapping):
        raise SpecError(
            f"budgets must be a mapping of device to bytes, like {{'cuda:0': '20GiB'}} (got {type(budgets).__name__})"
        )
    if not budgets:
        raise SpecError("budgets must name at least one device, like {'cuda:0': '20GiB'}")
    result: dict[str, int] = {}
    for key, size in budgets.items():
        name = normalize_device(key)
        if name in result:
            raise SpecError(f"budgets name device '{name}' twice (as {key!r} and an earlier key)")
        result[name] = parse_size(size, what=f"budget of '{name}'")
    return result
