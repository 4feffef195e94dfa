"""The gradients a value read by several ops gets, one from each, for the simulation (:mod:`fxsplit.memory.lifetimes`).

All but the first to arrive are new tensors while they are added to the gradient so far; a partial view's waits
at its own size (:mod:`fxsplit.memory.viewgrads`); a weight's are summed per device
(:mod:`fxsplit.memory.weightgrads`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable

from fxsplit.memory.activationprofile import ValueMemory
from fxsplit.memory.gradsums import handed_from
from fxsplit.memory.viewgrads import arrival, partial_views, waiting_views
from fxsplit.memory.weightgrads import weight_contributions

if TYPE_CHECKING:
    from fxsplit.memory.lifetimes import _Walk

__all__ = ["contributions"]


def contributions(walk: _Walk, weights: bool = True) -> list[tuple[Hashable, int, int, int]]:
    """``(device, first, last, nbytes)``: a value read by several ops gets one gradient from each.

    In backward, all but the first to arrive (from its last reader) are
    new tensors while they are being added to the gradient so far: made
    by the reader's backward, or, for an output (whose first is the loss's)
    read through a view, by the backward of the view's readers, and added
    at the view's (a language model returning its logits and the loss it
    reads them through ``view``: one logits tensor more while the loss's
    backward runs). Read through several partial views (q, k and v), each view's gradient waits beside the
    sum so far: :func:`~fxsplit.memory.viewgrads.waiting_views`. A weight's:
    :func:`~fxsplit.memory.weightgrads.weight_contributions`.
    """
    found: list[tuple[Hashable, int, int, int]] = []
    outputs = set(walk.profile.outputs)
    passed: dict[str, set[int]] = {}  # op's name -> the ops whose backward hands it their result's gradient
    for op, other in walk.profile.grad_passthrough:
        passed.setdefault(walk.profile.op_names[other], set()).add(op)
    values, names = walk.profile.values, walk.profile.op_names
    position = walk.profile.positions
    apart = walk.apart()
    for (name, device), read_by in walk.readers.items():
        info = values[name]
        if not info.requires_grad:
            continue
        # a reader whose result needs no gradient (detach) sends none back, nor does one taking an item out
        # of a tuple (the tuple's op's backward takes every item's at once); one handing on what it received,
        # as is, into a gradient already there on its device adds in place (apart_receivers), while from
        # another device what it hands the value's copy comes home as a gradient of its own
        readers = [
            op
            for op in read_by
            if (names[op] not in values or values[names[op]].requires_grad)
            and op not in walk.profile.items
            and ((op, position.get(name, -1)) not in apart or walk.device_of[op] != device)
        ]
        if name in outputs and device in (walk.home[name], walk.returned_on):  # the loss's arrives first (the
            # caller holds the output there, a copy on the outputs' device): each reader's there adds into it;
            # a partial view's waits at its own size until its backward (h[..., :12] or an item of split(h))
            parts = partial_views(walk.profile, walk.readers, name, device, readers, walk.items_of)
            found.extend(
                (device, op, op if op in parts else _made_from(walk, op, info, device), info.nbytes) for op in readers
            )
            if parts:
                waiting = waiting_views(
                    walk.profile, walk.readers, name, device, readers, parts, walk.items_of, len(names)
                )
                found.extend((device, first, last, nbytes) for first, last, nbytes in waiting)
        elif len(readers) > 1:
            made = handed_from(walk.profile, walk.readers, device, passed.get(name, ()), passed)
            # the first to arrive is the one made first in the backward (an output's, handed on through a
            # view, from the start); each other waits from when it is made until it meets it (another output's
            # is a seed of its own, counted from the start: gradients())
            order = sorted(readers, key=lambda op: (made.get(op, op), op))
            first, end = order[-1], len(names)
            found.extend(
                (device, min(op, first), made.get(op, op), info.nbytes) for op in order[:-1] if made.get(op, op) < end
            )
            waiting = waiting_views(walk.profile, walk.readers, name, device, readers, items_of=walk.items_of)
            found.extend((device, first, last, nbytes) for first, last, nbytes in waiting)
    if weights:
        found += [
            (device, op, op, nbytes)
            for device, op, nbytes in weight_contributions(
                walk.profile, walk.home, walk.replicas, walk.weight_readers, walk.device_of
            )
        ]
    return found


def _made_from(walk: _Walk, op: int, read: ValueMemory, device: Hashable) -> int:
    """Where the gradient op ``op`` adds to the value ``read`` it reads is made: at its own backward, or, when
    its result is a view of ``read`` (a storage of both, not written in place), at the backward of the last op
    that reads it, or a view of it (views of views, the items of a tuple of views such as ``broadcast_tensors``'s),
    and sends a gradient back."""
    profile, names = walk.profile, walk.profile.op_names
    result = profile.values.get(names[op])
    if result is None or op in profile.in_place or not set(result.storages) & set(read.storages):
        return op
    return max(op, arrival(profile, walk.readers, names[op], device, walk.items_of, outputs=False))
