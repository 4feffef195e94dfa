"""Where gradients handed on and summed live in the backward, for the simulation (:mod:`fxsplit.memory.lifetimes`).

* :func:`one_tensor`: storages whose gradient is one tensor handed on (an add's, a view's) share its span; at
  each position the tensor is as big as the largest storage alive there.
* :func:`handed_from`: what an op hands on as is (an add, a transpose) was made further on, by the backward of
  the op that reads its result.
* :func:`apart_receivers`: a gradient handed on as is to several values, summed with another gradient of one of
  them while another still holds it: the sum is a tensor apart.
* :func:`renewed_apart`: below an in-place op (or a slice) whose backward makes a new gradient for the storage it
  wrote (or views), that gradient is a tensor apart from the one handed on to another value, which waits there
  still.
* :func:`foreign_sums`: a sum made out of place into the gradient of a value read on another device happens on
  the value's device, when the gradient of its copy arrives there.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Collection, Hashable, Mapping

if TYPE_CHECKING:
    from fxsplit.memory.activationprofile import ActivationProfile

__all__ = ["apart_receivers", "foreign_sums", "handed_from", "one_tensor", "renewed_apart"]


def one_tensor(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The ``(first, last, nbytes)`` spans of storages whose gradient is one tensor handed on (a giver's span
    reaching down to the op it is handed to), as the spans of that tensor: at each position the largest of those
    alive there (a gap between two takes the larger of its neighbours). An item's gradient handed on as the
    gradient of the tuple it came from (``split``: the tuple's gradient is made at its backward) holds the item's
    bytes until then, not the tuple's; a gradient handed on in views (``stack``'s, to each of its inputs) holds its
    storage until the last of them.

    >>> one_tensor([(0, 5, 48), (5, 6, 16)])
    [(0, 5, 48), (6, 6, 16)]
    """
    if len(spans) == 1:
        return spans
    spans = sorted(spans)
    cuts = sorted({p for first, last, _ in spans for p in (first, last + 1)})
    pieces: list[list[int]] = []
    alive: list[tuple[int, int]] = []  # (-nbytes, last) of the spans begun, the largest first
    begun = 0
    for start, stop in itertools.pairwise(cuts):  # no span begins or ends inside [start, stop)
        while begun < len(spans) and spans[begun][0] <= start:
            heapq.heappush(alive, (-spans[begun][2], spans[begun][1]))
            begun += 1
        while alive and alive[0][1] < start:
            heapq.heappop(alive)
        nbytes = -alive[0][0] if alive else -1
        if pieces and pieces[-1][2] == nbytes:
            pieces[-1][1] = stop - 1
        else:
            pieces.append([start, stop - 1, nbytes])
    for i, piece in enumerate(pieces):  # no storage of the group covers it: as the larger neighbour
        if piece[2] < 0:
            piece[2] = max(pieces[i - 1][2] if i else 0, pieces[i + 1][2] if i + 1 < len(pieces) else 0)
    return [(first, last, nbytes) for first, last, nbytes in pieces]


def foreign_sums(
    profile: ActivationProfile,
    home: Mapping[str, Hashable],
    device_of: Mapping[int, Hashable],
    readers: Mapping[tuple[str, Hashable], Collection[int]],
) -> list[tuple[Hashable, int, int]]:
    """``(device, position, nbytes)`` of each sum out of place into the gradient of a value read on another
    device (:attr:`~fxsplit.memory.activationprofile.ActivationProfile.foreign_sums`): made on the value's
    device (``home``) when the gradient of its copy arrives there, at the copy's first reader (``readers``: the
    ops reading each value on each device). A value sent to another device whose result comes back to be read
    beside it, ``cat([f(v), v])``: 0.87 of the allocator where charged on the device of the op that sent it.
    Where a later reader of the copy on the op's device has sent its gradient first, the copy's gradient waits
    there and the sum is made there, by the op's backward (``cat([v + g(v), v])`` with ``v`` copied over).

    >>> from fxsplit.memory.activationprofile import ActivationProfile, ValueMemory
    >>> profile = ActivationProfile(op_names=("v", "f", "cat"), reads=((), ("v",), ("f", "v")), values={},
    ...     storage_bytes={}, foreign_sums={1: {0: 64}})
    >>> foreign_sums(profile, {"v": 0}, {0: 0, 1: 1, 2: 0}, {("v", 1): {1}})
    [(0, 1, 64)]
    """
    found: dict[tuple[Hashable, int], int] = {}
    for op, sums in profile.foreign_sums.items():
        here = device_of[op]
        for target, nbytes in sums.items():
            name = profile.op_names[target]
            there = home[name]
            if there == here:
                continue
            on_here = readers.get((name, here), (op,))
            if any(r > op and _sends(profile, r) for r in on_here):  # a later reader's gradient of the copy waits
                where = (here, op)  # here: the sum is made beside it (v + f(v) and cat([.., v]) on the copy's device)
            else:
                where = (there, min(on_here))
            found[where] = max(found.get(where, 0), nbytes)
    return [(device, at, nbytes) for (device, at), nbytes in found.items()]


def handed_from(
    profile: ActivationProfile,
    readers: Mapping[tuple[str, Hashable], Collection[int]],
    device: Hashable,
    passing: Collection[int],
    passed: Mapping[str, Collection[int]],
) -> dict[int, int]:
    """Reader -> where the gradient it sends a value is made, for the readers ``passing`` that hand on their
    result's gradient as is (an add, a transpose): at the backward of their result's last reader on ``device``,
    followed through readers that hand it on as is too (``passed``: op name -> such readers) or write it in place
    (``c = h.clone(); c.relu_()``: ``c``'s gradient arrives from the readers of the written version), not their own;
    from the start of the backward when one of them is an output (``(h.t(), h * 2)`` returned).
    ``(h + 1) * h``: the gradient the add passes to ``h`` is made by the multiply's backward, beside the one it makes
    for ``h`` (0.84 of the allocator when counted at the add only); ``h @ (h + 1).t()``: by the matmul's, through
    the transpose.

    >>> from fxsplit.memory.activationprofile import ActivationProfile
    >>> profile = ActivationProfile(op_names=("h", "add", "t", "mm"), reads=(), values={}, storage_bytes={})
    >>> readers = {("h", 0): {1, 3}, ("add", 0): {2}, ("t", 0): {3}}
    >>> handed_from(profile, readers, 0, [1], {"h": [1], "add": [2]})
    {1: 3}
    """
    names, outputs = profile.op_names, set(profile.outputs)
    found: dict[int, int] = {}
    for op in passing:
        last, stack, seen = op, [op], {op}
        while stack:
            here = names[stack.pop()]
            if here in outputs:  # the loss's gradient, there from the start of the backward
                last = len(names)
            for reader in readers.get((here, device), ()):
                last = max(last, reader)
                if (reader in passed.get(here, ()) or _writes(profile, reader, here)) and reader not in seen:
                    seen.add(reader)
                    stack.append(reader)
        found[op] = last
    return found


def renewed_apart(
    renewals: list[tuple[int, int, int, int, int, int]], members: Mapping[int, list[tuple[int, int, int, int]]]
) -> list[tuple[int, int, int, int]]:
    """``(storage, first, last, nbytes)``: the gradients of renewed storages that are tensors apart from their
    group's.

    ``renewals``: ``(group, storage, op, alloc, nbytes, sender)``: the backward of ``op`` (an in-place op, or a
    view) makes a new gradient for ``storage`` (made at ``alloc``, of ``nbytes``), in the group of storages whose
    gradient is one tensor handed on (``group``, :func:`one_tensor`). ``members``: each group's ``(storage, first,
    last, by)``: its span, and the last op whose backward handed it its gradient (-1: none). Below ``op``, down to
    ``alloc``, the new gradient lives beside the one ``op`` received wherever another member handed that one (by
    an op after ``op``; for a view, ``sender``, the op that handed the view its gradient: the view's siblings) still
    holds it; one handed on by an op before ``op`` is the new one (``y.add_(h); y.relu_()``).
    ``v = h * 1.5; v.mul_(0.5); v.add_(h)``: the add hands the loss's gradient to ``h``, where it waits for the
    multiply's, which the in-place multiply's new one gives it (0.82 of the allocator when counted as one tensor).
    ``cat([a, h[..., 3:]])``: the slice's backward makes ``h``'s gradient, while ``a``'s part of the ``cat``'s
    waits (0.93 when counted as one tensor).

    >>> renewed_apart([(0, 1, 2, 1, 64, -1)], {0: [(1, 0, 5, -1), (0, 0, 3, 3)]})
    [(1, 1, 1, 64)]
    >>> renewed_apart([(0, 1, 2, 1, 64, 4)], {0: [(1, 0, 5, 4), (0, 0, 3, 3)]})  # a view: only its sender's others
    []
    """
    found = []
    for group, storage, op, alloc, nbytes, sender in renewals:
        low, high = alloc, op - 1
        overlaps = [
            (max(first, low), min(last, high))
            for index, first, last, by in members.get(group, ())
            if index != storage and by > op and (sender < 0 or by == sender) and max(first, low) <= min(last, high)
        ]
        if overlaps:
            found.append((storage, min(a for a, _ in overlaps), max(b for _, b in overlaps), nbytes))
    return found


def _writes(profile: ActivationProfile, op: int, name: str) -> bool:
    """Whether op ``op`` writes the value ``name`` in place: its later readers read the written version, and the
    gradient of ``name``'s storage arrives from theirs."""
    if op not in profile.in_place:
        return False
    result, read = profile.values.get(profile.op_names[op]), profile.values.get(name)
    return result is not None and read is not None and bool(set(result.storages) & set(read.storages))


def apart_receivers(
    profile: ActivationProfile,
    readers: Mapping[tuple[str, Hashable], Collection[int]],
    device_of: Mapping[int, Hashable],
) -> set[tuple[int, int]]:
    """``(op, other)`` of :attr:`~fxsplit.memory.activationprofile.ActivationProfile.grad_passthrough` where the
    gradient ``op``'s backward hands on as is, to several values, is summed with another gradient of ``other``
    while another recipient still holds it (its backward comes later than that other gradient): the sum is not
    the tensor handed on, so ``other``'s gradient is a tensor of its own from there, not one with theirs. Handed
    into a gradient already there, it is added in place into that one; met by one arriving later, the sum is made
    out of place. ``v3 + sdpa(q, k, v3)`` returned, the attention's result also read by a softmax: 0.958 of the
    allocator when the attention's gradient was taken to be the one the add hands ``v3``. A residual stream
    ``h + f(h)`` stays one tensor: ``f``'s last op has taken its gradient before ``f``'s first adds to ``h``'s.

    >>> from fxsplit.memory.activationprofile import ActivationProfile, ValueMemory
    >>> values = {name: ValueMemory(64, (k,), True) for k, name in enumerate(("m", "att", "soft", "add"))}
    >>> profile = ActivationProfile(op_names=("m", "att", "soft", "add"), reads=((), ("m",), ("att",), ("m", "att")),
    ...     values=values, storage_bytes={}, grad_passthrough=((3, 0), (3, 1)))
    >>> readers = {("m", 0): {1, 3}, ("att", 0): {2, 3}}
    >>> apart_receivers(profile, readers, dict.fromkeys(range(4), 0))  # the softmax's reaches att first
    {(3, 1)}
    """
    names = profile.op_names
    passed: dict[str, set[int]] = {}
    receivers: dict[int, list[int]] = {}
    for op, other in profile.grad_passthrough:
        passed.setdefault(names[other], set()).add(op)
        receivers.setdefault(op, []).append(other)
    found, pairs = set(), set(profile.grad_passthrough)
    for op, others in receivers.items():
        if len(others) < 2 or op not in device_of:
            continue
        device = device_of[op]
        through = set(profile.reads[op]) if op < len(profile.reads) else set()  # a reader of other's whose result
        # op reads, or that returns other itself (a dropout with p=0, an Identity between a projection and the
        # add), sends op's gradient back through it: one of its own only if it hands that on too ((v + 1) + v)
        for other in others:
            name = names[other]
            sending = [
                r
                for r in readers.get((name, device), ())
                if r != op
                and _sends(profile, r)
                and ((names[r] not in through and not _same(profile, r, name)) or (r, other) in pairs)
            ]
            made = handed_from(profile, readers, device, passed.get(name, ()), passed)
            if any(k < made.get(r, r) for r in sending for k in others if k != other):
                found.add((op, other))
    return found


def _sends(profile: ActivationProfile, op: int) -> bool:
    """Whether op ``op`` sends a gradient back to what it reads (its result needs one; not an item of a tuple)."""
    result = profile.values.get(profile.op_names[op])
    return (result is None or result.requires_grad) and op not in profile.items


def _same(profile: ActivationProfile, op: int, name: str) -> bool:
    """Whether op ``op`` returns the value ``name`` itself: all of its storages, its bytes (no new tensor)."""
    result, read = profile.values.get(profile.op_names[op]), profile.values.get(name)
    return result is not None and read is not None and result.storages == read.storages and result.nbytes == read.nbytes
