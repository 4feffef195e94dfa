"""Device names and budgets: turn what users write into canonical strings, and check devices exist.

Names are checked for form only (:func:`normalize_device`), so a plan can be
made for devices this machine does not have. Running a split needs them:
:func:`require_usable` refuses absent ones before anything is traced or moved.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import torch

from fxsplit.errors import DeviceError, SpecError
from fxsplit.units import format_size, parse_size

__all__ = ["MAX_DEVICE_INDEX", "normalize_budgets", "normalize_device", "require_usable", "visible_devices"]

MAX_DEVICE_INDEX = 127
"""Largest device index torch can hold (it stores indices in 8 bits: ``cuda:300`` would become ``cuda:44``)."""

_INDEX = re.compile(r":\s*(\d+)\s*$")


def normalize_device(key: Any) -> str:
    """Canonical name of a device: ``0`` -> ``"cuda:0"``, ``torch.device("cpu", 1)`` -> ``"cpu:1"``.

    Raises:
        SpecError: the key names no device torch knows, an index above
            ``MAX_DEVICE_INDEX``, or ``meta``.
    """
    if isinstance(key, bool):
        raise SpecError(f"device must be a string, torch.device or int (got {key!r})")
    if isinstance(key, int):
        if key < 0:
            raise SpecError(f"device index must not be negative (got {key})")
        _check_index(key, repr(key))
        return f"cuda:{key}"
    if isinstance(key, torch.device):
        if key.index is not None and key.index < 0:
            raise SpecError(
                f"device '{key}' has a negative index: torch keeps device indices in 8 bits, so an "
                f"index above {MAX_DEVICE_INDEX} wraps around; write an index of a device you have"
            )
        device = key
    elif isinstance(key, str):
        index = _INDEX.search(key)
        if index is not None:
            _check_index(int(index.group(1)), repr(key))
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


def _check_index(index: int, written: str) -> None:
    if index > MAX_DEVICE_INDEX:
        raise SpecError(
            f"device {written} has index {index}, but torch's device indices go from 0 to "
            f"{MAX_DEVICE_INDEX}; write an index of a device you have, like 'cuda:1' or 'cpu:1'"
        )


def _physical(name: str) -> str:
    """The indexed name of ``name``: a bare accelerator (``"cuda"``) is its current device, ``"cuda:0"`` here."""
    device = torch.device(name)
    if device.index is not None or device.type == "cpu":
        return name  # logical CPU devices are told apart by their names
    current = torch.cuda.current_device() if device.type == "cuda" and torch.cuda.is_available() else 0
    return f"{device.type}:{current}"


def normalize_budgets(budgets: Mapping[Any, Any]) -> dict[str, int]:
    """Budgets as an ordered ``{device name: bytes}``; the order is the order of stages.

    Raises:
        SpecError: not a mapping, empty, a bad device, a bad size, or two keys
            for one device (``0`` and ``"cuda:0"``, or ``"cuda"`` and its
            current index).
    """
    if not isinstance(budgets, Mapping):
        raise SpecError(
            f"budgets must be a mapping of device to bytes, like {{'cuda:0': '20GiB'}} (got {type(budgets).__name__})"
        )
    if not budgets:
        raise SpecError("budgets must name at least one device, like {'cuda:0': '20GiB'}")
    result: dict[str, int] = {}
    seen: dict[str, Any] = {}
    for key, size in budgets.items():
        name = normalize_device(key)
        physical = _physical(name)
        if physical in seen:
            raise SpecError(_named_twice(physical, seen[physical], key))
        seen[physical] = key
        result[name] = parse_size(size, what=f"budget of '{name}'")
    return result


def _named_twice(physical: str, earlier: Any, later: Any) -> str:
    message = f"budgets name device '{physical}' twice (as {earlier!r} and {later!r})"
    if any(_physical(normalize_device(key)) != normalize_device(key) for key in (earlier, later)):
        kind, _, index = physical.partition(":")
        message += (
            f"; a bare '{kind}' means the current {kind} device, index {index} here: name each device once, "
            "with its index"
        )
    return message


def _availability(kind: str) -> tuple[bool, int] | None:
    """``(available, device count)`` from torch's module for ``kind``; None where torch has none to ask."""
    if kind == "mps":
        available = bool(torch.backends.mps.is_available())
        return available, int(available)
    module = getattr(torch, kind, None)
    is_available = getattr(module, "is_available", None)
    if not callable(is_available):
        return None
    available = bool(is_available())
    device_count = getattr(module, "device_count", None)
    count = int(device_count()) if available and callable(device_count) else int(available)
    return available, count


def _why_unusable(name: str) -> str | None:
    """Why ``name`` cannot hold tensors here, or None when it can."""
    device = torch.device(name)
    if device.type == "cpu":
        return None
    known = _availability(device.type)
    if known is None:
        try:
            torch.empty(0, device=device)
        except Exception as error:  # noqa: BLE001 - any backend may refuse in its own way
            return f"torch cannot allocate on it ({type(error).__name__}: {(str(error).splitlines() or [''])[0]})"
        return None
    available, count = known
    if not available:
        why = f"torch.{device.type}.is_available() is False"
        if device.type == "cuda" and torch.version.cuda is None:
            why += f" (this torch, {torch.__version__}, was built without CUDA)"
        elif device.type == "cuda":
            why += " (no CUDA device is visible: check the driver and CUDA_VISIBLE_DEVICES)"
        return why
    if device.index is not None and device.index >= count:
        return f"only {count} {device.type} device(s) are visible ({device.type}:0 to {device.type}:{count - 1})"
    return None


def visible_devices() -> list[str]:
    """The devices torch can use here: ``cpu``, then every visible CUDA, MPS and XPU device."""
    found = ["cpu"]
    for kind in ("cuda", "mps", "xpu"):
        known = _availability(kind)
        if known is not None and known[0]:
            found += [f"{kind}:{index}" for index in range(known[1])]
    return found


def require_usable(devices: Iterable[str], budgets: Mapping[str, int] | None = None) -> None:
    """Check that every device exists here and can hold tensors, before any work is done for it.

    ``cpu:N`` is always usable (logical CPU devices run on the CPU). A plan
    alone (:func:`fxsplit.plan`) needs no devices; running a split does.

    Raises:
        DeviceError: names each unusable device and why, the devices torch
            sees, and how to try the split on logical CPU devices instead.
    """
    by_reason: dict[str, list[str]] = {}
    for name in dict.fromkeys(devices):
        why = _why_unusable(name)
        if why is not None:
            by_reason.setdefault(why, []).append(f"'{name}'")
    if not by_reason:
        return
    problems = [f"{', '.join(names)}: {why}" for why, names in by_reason.items()]
    sizes = [format_size(size).replace(" ", "") for size in (budgets or {}).values()] or ["20GiB", "20GiB"]
    dry_run = ", ".join(f"'cpu:{i}': '{size}'" for i, size in enumerate(sizes))
    raise DeviceError(
        f"cannot run on {'; '.join(problems)}. Devices visible here: {', '.join(visible_devices())}. Nothing was "
        f"moved. Planning alone works for absent devices (fxsplit.plan); to try the split on this machine, use "
        f"logical CPU devices, which all run on the CPU: {{{dry_run}}}"
    )
