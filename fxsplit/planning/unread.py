"""Where :func:`~fxsplit.planning.build.make_plan` puts the tensors no op reads (unused submodules, weights
the graph never reads).

They go into the room the partition leaves (:func:`pack_unread`); when they do not fit there, room is set
aside for them first in several ways and the ops partitioned again into what is left
(:func:`set_aside_unread`).
"""

from __future__ import annotations

from typing import Callable, NoReturn, Sequence

from fxsplit.cost.build import GraphCosts, Weight
from fxsplit.errors import BudgetError
from fxsplit.partition.solve import Partition
from fxsplit.units import format_size

__all__ = ["pack_unread", "raise_unread", "read_homes", "set_aside_unread", "unread_weights"]


def unread_weights(costs: GraphCosts) -> list[Weight]:
    """Parameters and buffers no op of the graph reads, in the model's order."""
    if min(costs.weight_values, default=0) >= 0:  # the usual case: every weight is read (no loop over them)
        return list(costs.unused)
    idle = [w for w, v in zip(costs.weights, costs.weight_values, strict=True) if v < 0]
    return idle + costs.unused


def read_homes(costs: GraphCosts, devices: Sequence[str], solution: Partition) -> dict[str, str]:
    """Canonical name -> device of every weight some op reads: where its first reader runs."""
    homes: dict[str, str] = {}
    values, op_devices = costs.problem.values, solution.op_devices
    for weight, value_index in zip(costs.weights, costs.weight_values, strict=True):
        if value_index >= 0:
            homes[weight.names[0]] = devices[op_devices[values[value_index].start]]
    return homes


def pack_unread(
    costs: GraphCosts, devices: Sequence[str], caps: dict[str, int], solution: Partition
) -> dict[str, str] | None:
    """Canonical name -> device for the tensors no op reads, in the room ``solution`` leaves, or None.

    Largest first (ties in the model's order); each goes beside its module's
    other tensors when some are read and it fits there, else to the device
    with the least room that holds it (big gaps stay for big tensors).
    """
    unread = unread_weights(costs)
    if not unread:
        return {}
    room = {d: caps[d] - int(load) for d, load in zip(devices, solution.device_weights, strict=True)}
    module_home: dict[str, str] = {}
    for name, device in read_homes(costs, devices, solution).items():
        module_home.setdefault(name.rpartition(".")[0], device)
    homes: dict[str, str] = {}
    for weight in sorted(unread, key=lambda w: -w.nbytes):
        module = weight.names[0].rpartition(".")[0]
        beside = module_home.get(module)
        fitting = [d for d in devices if room[d] >= weight.nbytes]
        if not fitting:
            return None
        home = beside if beside in fitting else min(fitting, key=lambda d: room[d])
        homes[weight.names[0]] = home
        room[home] -= weight.nbytes
    return homes


def set_aside_unread(
    costs: GraphCosts,
    devices: Sequence[str],
    caps: dict[str, int],
    repartition: Callable[[Sequence[int]], Partition],
    first: Partition,
) -> tuple[Partition, dict[str, str]]:
    """Set room aside for the unread tensors, partition the ops into what is left, then pack the tensors into
    the room that leaves; over several ways of setting room aside (:func:`_reservations`), the one that copies
    fewest bytes (ties: the first). Refuses when none fits."""
    weights = sorted(unread_weights(costs), key=lambda w: -w.nbytes)
    reservations = _reservations(weights, devices, caps, first)
    if not reservations:
        raise_unread(costs, devices, caps, [0] * len(devices))
    best: tuple[Partition, dict[str, str]] | None = None
    error: BudgetError | None = None
    for aside in reservations:
        try:
            solution = repartition([caps[d] - sum(w.nbytes for w in aside[d]) for d in devices])
        except BudgetError as refused:
            error = error or refused
            continue
        homes = pack_unread(costs, devices, caps, solution) or {w.names[0]: d for d in devices for w in aside[d]}
        if best is None or solution.transfer_bytes < best[0].transfer_bytes:
            best = (solution, homes)
    if best is None:
        unread = sum(w.nbytes for w in weights)
        raise BudgetError(
            f"the ops fit the budgets only if the {format_size(unread)} of tensors no op reads "
            f"({_largest_unread(costs)}) are left out; with room set aside for them first: {error}"
        ) from None
    return best


def _reservations(
    weights: list[Weight], devices: Sequence[str], caps: dict[str, int], first: Partition
) -> list[dict[str, list[Weight]]]:
    """Ways to pack ``weights`` (largest first) into ``caps``, each as device -> its tensors, distinct by the
    bytes each device keeps: into the gaps ``first`` leaves (the tightest that holds each, else the device
    with the most room); each onto the device with the most room (spread); and, for each device, onto it
    first, then onto the next ones in order (so the ops keep other devices whole)."""
    gaps = {d: caps[d] - int(load) for d, load in zip(devices, first.device_weights, strict=True)}

    def into_gaps(room: dict[str, int], nbytes: int) -> str:
        held = [d for d in devices if gaps[d] - (caps[d] - room[d]) >= nbytes]
        return min(held, key=lambda d: gaps[d] - caps[d] + room[d]) if held else max(devices, key=room.__getitem__)

    def spread(room: dict[str, int], nbytes: int) -> str:
        return max(devices, key=room.__getitem__)

    def in_order(order: list[str]) -> Callable[[dict[str, int], int], str]:
        return lambda room, nbytes: next((d for d in order if room[d] >= nbytes), order[0])

    rules = [into_gaps, spread, *(in_order([*devices[k:], *devices[:k]]) for k in range(len(devices)))]
    found: list[dict[str, list[Weight]]] = []
    seen: set[tuple[int, ...]] = set()
    for rule in rules:
        room, aside = dict(caps), {d: list[Weight]() for d in devices}
        for weight in weights:
            home = rule(room, weight.nbytes)
            room[home] -= weight.nbytes
            aside[home].append(weight)
        kept = tuple(room[d] for d in devices)
        if min(kept) >= 0 and kept not in seen:
            seen.add(kept)
            found.append(aside)
    return found


def _largest_unread(costs: GraphCosts) -> str:
    weights = sorted(unread_weights(costs), key=lambda w: -w.nbytes)
    listed = ", ".join(f"'{w.names[0]}' {format_size(w.nbytes)}" for w in weights[:3])
    return listed + (f" and {len(weights) - 3} more" if len(weights) > 3 else "")


def raise_unread(costs: GraphCosts, devices: Sequence[str], caps: dict[str, int], loads: list[int]) -> NoReturn:
    room = {d: caps[d] - load for d, load in zip(devices, loads, strict=True)}
    weights = sorted(unread_weights(costs), key=lambda w: -w.nbytes)
    largest = weights[0]
    total = sum(w.nbytes for w in weights)
    raise BudgetError(
        f"the tensors no op of the graph reads ({format_size(total)}: {_largest_unread(costs)}) do not fit what "
        f"the budgets leave ({', '.join(f'{d!r} {format_size(max(r, 0))}' for d, r in room.items())}); "
        f"raise a budget by {format_size(largest.nbytes)} or more, or delete the unused tensors"
    )
