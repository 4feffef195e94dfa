"""Pins and together-groups of module patterns, resolved to the graph's ops (op index -> device index)."""

from __future__ import annotations

import fnmatch
from typing import Mapping, Sequence

import torch.fx

from fxsplit.errors import SpecError

__all__ = ["path_matches", "resolve_pins", "resolve_together"]


def resolve_pins(
    pins: Mapping[str, str],
    ops: list[torch.fx.Node],
    labels: tuple[str, ...],
    device_index: Mapping[str, int],
) -> dict[int, int]:
    """Op index -> device index for every op whose module (or name) matches a pin pattern."""
    pinned: dict[int, int] = {}
    for pattern, device in pins.items():
        if device not in device_index:
            raise SpecError(
                f"pin {pattern!r} names device {device!r}, which has no budget; budgets: {sorted(device_index)}"
            )
        matched = False
        for i, (node, label) in enumerate(zip(ops, labels, strict=True)):
            if path_matches(pattern, label) or node.name == pattern:
                matched = True
                previous = pinned.get(i)
                if previous is not None and previous != device_index[device]:
                    raise SpecError(f"op '{node.name}' (in '{label}') is pinned to two devices by overlapping pins")
                pinned[i] = device_index[device]
        if not matched:
            raise SpecError(f"pin {pattern!r} matches no module or node of the traced graph")
    return pinned


def resolve_together(
    groups: Sequence[Sequence[str]], ops: list[torch.fx.Node], labels: tuple[str, ...]
) -> tuple[tuple[int, ...], ...]:
    """One group of op indices per group of module patterns: every op of every matching module."""
    resolved: list[tuple[int, ...]] = []
    for group in groups:
        members: list[int] = []
        for pattern in group:
            found = [i for i, node in enumerate(ops) if path_matches(pattern, labels[i]) or node.name == pattern]
            if not found:
                raise SpecError(f"together-pattern {pattern!r} matches no module or node of the traced graph")
            members.extend(found)
        resolved.append(tuple(sorted(set(members))))
    return tuple(resolved)


def path_matches(pattern: str, path: str) -> bool:
    """Whether module path ``path`` is ``pattern``, inside it, or matches it as a glob (``layers.*``)."""
    if not path:
        return False
    return (
        path == pattern
        or path.startswith(pattern + ".")
        or fnmatch.fnmatchcase(path, pattern)
        or (fnmatch.fnmatchcase(path, pattern + ".*"))
    )
