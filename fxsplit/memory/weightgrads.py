"""Where the gradients of a weight read by several ops are summed in the backward, for the simulation.

A weight (parameter or buffer that needs a gradient) gets one gradient from each op that reads it. They are
summed where they meet: at the weight's home, and, for a copy on another device read there by several ops,
first on that device (the copy's gradient, sent home once by the copy's backward). The first to reach a place
waits there (autograd's input buffer) while the rest arrive; each later one is a new tensor while it is added.

Used by :class:`~fxsplit.memory.lifetimes._Walk`: ``weight_readers`` are the ops that read each weight (on any
device, through a copy or not), ``device_of`` each op's device, ``home`` each value's device and ``replicas``
the other devices that hold a weight of their own (and sum its gradients there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection, Hashable, Mapping

if TYPE_CHECKING:
    from fxsplit.memory.activationprofile import ActivationProfile

__all__ = ["Replicas", "held_weight_gradients", "weight_contributions"]

Replicas = Mapping[str, Collection[Hashable]] | None
"""Weight -> the other devices that hold it too (``Plan.replicas``)."""


def _arrivals(
    name: str,
    readers: Collection[int],
    home: Mapping[str, Hashable],
    replicas: Replicas,
    device_of: Mapping[int, Hashable],
) -> set[int]:
    """The ops whose backward brings a gradient of weight ``name`` to its home: each reader there, and each
    other device's copy (at its first reader there; a device holding its own replica keeps its own)."""
    there, own = home[name], (replicas or {}).get(name, ())
    arrivals = {op for op in readers if device_of[op] == there}
    first_elsewhere: dict[Hashable, int] = {}
    for op in readers:
        if (device := device_of[op]) != there and device not in own:
            first_elsewhere[device] = min(op, first_elsewhere.get(device, op))
    return arrivals | set(first_elsewhere.values())


def held_weight_gradients(
    profile: ActivationProfile,
    home: Mapping[str, Hashable],
    replicas: Replicas,
    weight_readers: Mapping[str, Collection[int]],
    device_of: Mapping[int, Hashable],
) -> list[tuple[Hashable, int, int, int]]:
    """``(device, first, last, nbytes)``: the first gradient to reach a weight's home waits there from its
    arrival (``last``, the backward runs ops in reverse) to the backward of the weight's first reader.

    When the weight has no ``.grad`` yet (the first backward after ``zero_grad()``) and the first to arrive is
    a copy's, a new tensor the rest are added into in place, it becomes the ``.grad``, which the plan charges
    with the gradients: then it is held twice here. With gradient accumulation or a pipeline's later
    micro-batches the ``.grad`` exists and that tensor is added to it at the end: held for real (one Linear
    applied five times over two devices: 61,824 B on the weight's home in the first backward, 99,072 B in
    the next, which is what is planned).
    """
    held = []
    for name, readers in weight_readers.items():
        info = profile.values[name]
        if info.requires_grad and len(readers) > 1:
            first = max(_arrivals(name, readers, home, replicas, device_of))
            held.append((home[name], min(readers), first, info.nbytes))
    return held


def weight_contributions(
    profile: ActivationProfile,
    home: Mapping[str, Hashable],
    replicas: Replicas,
    weight_readers: Mapping[str, Collection[int]],
    device_of: Mapping[int, Hashable],
) -> list[tuple[Hashable, int, int]]:
    """``(device, op, nbytes)``: each gradient of a weight added to one already there, while it is added.

    At the weight's home, every arrival but the first (:func:`held_weight_gradients`'). On a device where
    several ops read a copy, every reader's but the first to run backward (its last), added into the copy's
    gradient there (one Linear applied five times over two devices was 0.94 of the allocator without them).
    """
    found: list[tuple[Hashable, int, int]] = []
    for name, readers in weight_readers.items():
        info = profile.values[name]
        if not info.requires_grad or len(readers) < 2:
            continue
        arrivals = sorted(_arrivals(name, readers, home, replicas, device_of))
        found.extend((home[name], op, info.nbytes) for op in arrivals[:-1])
        by_device: dict[Hashable, list[int]] = {}
        for op in readers:
            by_device.setdefault(device_of[op], []).append(op)
        for device, there in by_device.items():
            if device != home[name] and len(there) > 1:
                found.extend((device, op, info.nbytes) for op in sorted(there)[:-1])
    return found
