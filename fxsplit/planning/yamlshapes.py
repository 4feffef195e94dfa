"""What each field of a plan file may hold: the shape checks :mod:`fxsplit.planning.yamlio`'s reader runs."""

from __future__ import annotations

from typing import Any, Callable

__all__ = [
    "MEMORY_SHAPE",
    "REPLICAS_SHAPE",
    "SPLITS_SHAPE",
    "is_int",
    "is_list",
    "is_map",
    "is_memory",
    "is_offload",
    "is_replicas",
    "is_splits",
    "is_str",
    "is_str_list",
]


def is_offload(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) <= {"host", "disk", "dir", "prefetch"}
        and all(value.get(t) is None or is_int(value[t]) for t in ("host", "disk", "prefetch"))
        and (value.get("dir") is None or is_str(value["dir"]))
    )


MEMORY_SHAPE, REPLICAS_SHAPE = "device -> {component: bytes}", "name -> {devices, nbytes}"
SPLITS_SHAPE = "op -> {weight, bounds: [row bounds]}"


def is_memory(value: Any) -> bool:
    return is_map(value, lambda row: is_map(row, is_int))


def is_replicas(value: Any) -> bool:
    return is_map(value, _is_replica)


def _is_replica(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"devices", "nbytes"}
        and is_str_list(value["devices"])
        and (is_int(value["nbytes"]))
    )


def is_splits(value: Any) -> bool:
    return is_map(value, _is_split)


def _is_split(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"weight", "bounds"}
        and is_str(value["weight"])
        and isinstance(value["bounds"], list)
        and all(is_int(b) for b in value["bounds"])
    )


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def is_list(value: Any) -> bool:
    return isinstance(value, list)


def is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def is_map(value: Any, check: Callable[[Any], bool]) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and check(v) for k, v in value.items())
