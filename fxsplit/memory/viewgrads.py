"""The gradients of partial views of one value, waiting in the backward beside the sum so far, for the simulation.

A value read through several partial views (``select`` or slices: the q, k and v of one projection) gets one
gradient per view, each its own tensor from when it arrives (the backward of the view's last reader) until the
view's backward embeds it in a new value-sized tensor that is added to the value's gradient. The simulation holds
one value-sized gradient throughout (:meth:`~fxsplit.memory.lifetimes._Walk.gradients`): until the first view's
backward (the last view in op order) it stands for the views' gradients, and from there it is the sum so far,
beside which the views whose backward comes later still wait. Each view's own backward holds its gradient
(``backward_internal``); what :func:`waiting_views` adds is the time between.

Used by :class:`~fxsplit.memory.lifetimes._Walk`: ``readers`` are the ops that read each value on each device (a
copy's reader on another device reads it at its home too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection, Hashable, Mapping

if TYPE_CHECKING:
    from fxsplit.memory.activationprofile import ActivationProfile, ValueMemory

__all__ = ["waiting_views"]

Readers = Mapping[tuple[str, Hashable], Collection[int]]


def waiting_views(
    profile: ActivationProfile, readers: Readers, name: str, device: Hashable, read_by: Collection[int]
) -> list[tuple[int, int, int]]:
    """``(first, last, nbytes)`` on ``device`` of each view's gradient waiting beside the gradient of ``name``
    (read there by the ops ``read_by``) that its views are adding up; none when fewer than two views read it.

    >>> from fxsplit.memory.activationprofile import ActivationProfile, ValueMemory
    >>> h, view = ValueMemory(48, (1,), True), ValueMemory(16, (1,), True)
    >>> profile = ActivationProfile(op_names=("h", "q", "k", "v", "out"),
    ...     reads=(("x",), ("h",), ("h",), ("h",), ("q", "k", "v")),
    ...     values={"x": ValueMemory(8, (0,)), "h": h, "q": view, "k": view, "v": view,
    ...             "out": ValueMemory(16, (2,), True)}, storage_bytes={0: 8, 1: 48, 2: 16})
    >>> readers = {("h", 0): {1, 2, 3}, ("q", 0): {4}, ("k", 0): {4}, ("v", 0): {4}}
    >>> waiting_views(profile, readers, "h", 0, [1, 2, 3])  # q waits through k's and v's backward, k through v's
    [(2, 3, 16), (3, 3, 16)]
    """
    read = profile.values[name]
    views = sorted(op for op in read_by if _partial_view(profile, op, read))
    found = []
    for op in views[:-1]:
        arrives = _arrival(profile, readers, profile.op_names[op], device)
        if arrives > op:
            found.append((op + 1, min(arrives, views[-1]), profile.values[profile.op_names[op]].nbytes))
    return found


def _partial_view(profile: ActivationProfile, op: int, read: ValueMemory) -> bool:
    """Whether op ``op``'s result is a smaller view of ``read`` with a backward of its own (not an item of a tuple,
    whose op's backward takes every item's gradient at once; not written in place) whose gradient autograd needs."""
    result = profile.values.get(profile.op_names[op])
    return (
        result is not None
        and result.requires_grad
        and result.nbytes < read.nbytes
        and op not in profile.in_place
        and op not in profile.items
        and bool(set(result.storages) & set(read.storages))
    )


def _arrival(profile: ActivationProfile, readers: Readers, name: str, device: Hashable) -> int:
    """Where the gradient of ``name`` arrives in the backward: at the last op on ``device`` that reads it, or a view
    of it (views of views), and sends a gradient back; at the end for an output; -1 if none does."""
    values, names = profile.values, profile.op_names
    last, stack, seen = -1, [name], {name}
    while stack:
        here = stack.pop()
        if here in profile.outputs:
            last = len(names)
        storages = set(values[here].storages)
        for op in readers.get((here, device), ()):
            result = values.get(names[op])
            if result is not None and not result.requires_grad:  # a detach: no gradient back
                continue
            last = max(last, op)
            viewed = result is not None and op not in profile.in_place and storages & set(result.storages)
            if viewed and names[op] not in seen:
                seen.add(names[op])
                stack.append(names[op])
    return last
