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

from typing import TYPE_CHECKING, Collection, Hashable, Mapping, Sequence

if TYPE_CHECKING:
    from fxsplit.memory.activationprofile import ActivationProfile, ValueMemory

__all__ = ["arrival", "partial_views", "tuple_items", "waiting_views"]

Readers = Mapping[tuple[str, Hashable], Collection[int]]
ItemsOf = Mapping[str, Sequence[int]]  # a tuple's name -> the ops that take items out of it


def waiting_views(
    profile: ActivationProfile,
    readers: Readers,
    name: str,
    device: Hashable,
    read_by: Collection[int],
    views: Mapping[int, int] | None = None,
    items_of: ItemsOf | None = None,
    whole_from: int = -1,
) -> list[tuple[int, int, int]]:
    """``(first, last, nbytes)`` on ``device`` of each view's gradient waiting beside the gradient of ``name``
    (read there by the ops ``read_by``) that its views are adding up. The last view in op order waits only beside a
    gradient of all of the value that another reader sends (a full view's, as ``h.t()``'s; another op's) or that
    arrives from ``whole_from`` (an output's, the loss's: from the start); before that the simulation's one
    gradient of the value stands for it. ``views``: :func:`partial_views` of ``read_by``, when the caller has them.
    ``items_of``: a tuple's name -> the ops taking items out of it (``chunk``'s items, read one by one, are one
    partial view of the value).

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
    items_of = items_of or {}
    sizes = partial_views(profile, readers, name, device, read_by, items_of) if views is None else views
    ordered = sorted(sizes)
    if not ordered:
        return []
    found = []
    whole = max(_whole(profile, readers, read_by, name, sizes, device), whole_from)
    for op in ordered[:-1]:  # beside the sum so far, from the first view's backward (the last one's), or a whole one
        arrives = min(_view_arrival(profile, readers, items_of, op, device), max(ordered[-1], whole))
        if arrives > op:
            found.append((op + 1, arrives, sizes[op]))
    last = ordered[-1]  # beside a gradient of all of the value from another reader (h.t() @ h[..., :24]) or the loss
    arrives = min(_view_arrival(profile, readers, items_of, last, device), whole)
    if arrives > last:
        found.append((last + 1, arrives, sizes[last]))
    return found


def tuple_items(profile: ActivationProfile) -> dict[str, list[int]]:
    """A tuple's name -> the ops that take an item out of it (:attr:`ActivationProfile.items`), in op order."""
    found: dict[str, list[int]] = {}
    for op in sorted(profile.items):
        for name in profile.reads[op][:1]:
            found.setdefault(name, []).append(op)
    return found


def partial_views(
    profile: ActivationProfile,
    readers: Readers,
    name: str,
    device: Hashable,
    read_by: Collection[int],
    items_of: ItemsOf | None = None,
) -> dict[int, int]:
    """The readers of ``name`` (of ``read_by``, on ``device``) that are partial views of it -> the bytes of the
    gradient each gets (a tuple's: its items' that some op reads)."""
    read, items_of = profile.values[name], items_of or {}
    return {op: nbytes for op in read_by if (nbytes := _part_bytes(profile, readers, items_of, op, read, device))}


def _whole(
    profile: ActivationProfile,
    readers: Readers,
    read_by: Collection[int],
    name: str,
    views: Collection[int],
    device: Hashable,
) -> int:
    """Where the first gradient of all of value ``name`` arrives from one of its readers ``read_by`` that is not a
    partial view (``views``): a full view's (a transpose), or one an op hands on as is (``stack([h])``'s, a
    returned value's: from the start), where its own arrives, and at the latest at the view (one read on another
    device, whose copy's gradient comes home there); another op's at its backward; -1 if none sends one."""
    names, values, found = profile.op_names, profile.values, -1
    read, index = values[name], profile.positions.get(name, -1)
    for op in read_by:
        result = values.get(names[op])
        if (result is not None and not result.requires_grad) or op in views or op in profile.items:
            continue
        viewed = result is not None and op not in profile.in_place and set(read.storages) & set(result.storages)
        handed = viewed or (op, index) in profile.grad_passthrough
        found = max(found, max(op, arrival(profile, readers, names[op], device)) if handed else op)
    return found


def _part_bytes(
    profile: ActivationProfile, readers: Readers, items_of: ItemsOf, op: int, read: ValueMemory, device: Hashable
) -> int:
    """Bytes of the gradient op ``op``'s result gets if it is a smaller view of ``read`` with a backward of its own
    (not written in place) whose gradient autograd needs, else 0. A tuple of views (``chunk``, ``split``) read
    through its items gets those of the items some op reads (the rest get none), and its backward takes them all
    at once: a partial view even when they cover all of ``read``, since each item's gradient is a tensor of its
    own until then (both halves of ``split(h)`` read on another device beside ``h``: 0.818 of the allocator when
    counted as one gradient of all of ``h``)."""
    result = profile.values.get(profile.op_names[op])
    if result is None or not result.requires_grad or op in profile.in_place or op in profile.items:
        return 0
    if not set(result.storages) & set(read.storages):
        return 0
    taken = items_of.get(profile.op_names[op])
    nbytes = (
        result.nbytes
        if taken is None
        else sum(
            _item(profile, i).nbytes
            for i in taken
            if _item(profile, i).requires_grad and arrival(profile, readers, profile.op_names[i], device) >= 0
        )
    )
    return nbytes if nbytes < read.nbytes or taken is not None else 0


def _item(profile: ActivationProfile, op: int) -> ValueMemory:
    return profile.values[profile.op_names[op]]


def _view_arrival(profile: ActivationProfile, readers: Readers, items_of: ItemsOf, op: int, device: Hashable) -> int:
    """Where the gradient of a partial view (op ``op``'s result) arrives; a tuple's, where its items' last does."""
    name = profile.op_names[op]
    taken = items_of.get(name)
    if taken is None:
        return arrival(profile, readers, name, device)
    return max((arrival(profile, readers, profile.op_names[item], device) for item in taken), default=-1)


def arrival(
    profile: ActivationProfile,
    readers: Readers,
    name: str,
    device: Hashable,
    items_of: ItemsOf | None = None,
    outputs: bool = True,
) -> int:
    """Where the gradient of ``name`` arrives in the backward: at the last op on ``device`` that reads it, or a view
    of it (views of views; with ``items_of``, the items of a tuple of views too, as ``broadcast_tensors``'), and
    sends a gradient back; at the end for an output (unless not ``outputs``); -1 if none does."""
    values, names, items_of = profile.values, profile.op_names, items_of or {}
    last, stack, seen = -1, [name], {name}
    while stack:
        here = stack.pop()
        if outputs and here in profile.outputs:
            last = len(names)
        storages = set(values[here].storages)
        for op in (*readers.get((here, device), ()), *items_of.get(here, ())):
            result = values.get(names[op])
            if result is not None and not result.requires_grad:  # a detach: no gradient back
                continue
            if op not in profile.items:  # an item has no backward of its own: its readers send it
                last = max(last, op)
            viewed = result is not None and op not in profile.in_place and storages & set(result.storages)
            if viewed and names[op] not in seen:
                seen.add(names[op])
                stack.append(names[op])
    return last
