"""Activation memory from value lifetimes: plain data and a simulation (no torch).

An :class:`ActivationProfile` says, for every op of a traced graph in
execution order, which values it reads and which *storages* (allocations)
its result holds - a view shares its input's storage, a new tensor has its
own - and, for training, which storages autograd saves for backward. It is
measured once per model (:mod:`fxsplit.memory.activations`) and then simulated for
any placement of the ops on devices, the way the generated code runs:

* a storage lives on its device from the op that makes it until the last op
  there that reads it (or a view of it), or until it is copied to a later
  device for the last time; model inputs arrive on their home device when
  first read;
* a value read on another device is copied there right before its first
  reader there (``nbytes`` of the value), and that copy lives until its last
  reader there;
* outputs are copied to the output device and are held by the caller;
* training: a saved storage lives until the backward of the earliest op that
  saved it; the gradient of a storage that needs one lives, in backward,
  from its last reader to the op that made it (the forward lifetime, walked
  backwards; a copy's, at its reader); outputs stay held through the backward.

:func:`simulate` gives each device's peak; :func:`~fxsplit.memory.planloads.planning_loads` gives the
per-op ``op_extra`` and ``op_transient`` that the partitioner adds up for a
contiguous run of ops (an upper bound of the simulation on one device for
most graphs; the exact simulation checks the final plan).

>>> profile = ActivationProfile(
...     op_names=("a", "b"), reads=(("x",), ("a",)),
...     values={"x": ValueMemory(8, (0,)), "a": ValueMemory(16, (1,)), "b": ValueMemory(16, (2,))},
...     storage_bytes={0: 8, 1: 16, 2: 16}, inputs=("x",), outputs=("b",))
>>> simulate(profile, ["cpu:0", "cpu:1"], {"x": "cpu:0"}, "cpu:1").forward
{'cpu:0': 24, 'cpu:1': 32}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

from fxsplit.memory.activationprofile import ActivationProfile, ValueMemory
from fxsplit.memory.contributions import contributions
from fxsplit.memory.gradsums import apart_receivers, foreign_sums, one_tensor, renewed_apart
from fxsplit.memory.outputgrads import loss_gradients
from fxsplit.memory.viewgrads import tuple_items
from fxsplit.memory.weightgrads import Replicas, held_weight_gradients

__all__ = ["ActivationProfile", "Simulated", "ValueMemory", "simulate"]


@dataclass
class _Storage:
    """One allocation on one device, during one forward (and backward)."""

    device: Hashable
    nbytes: int
    alloc: int
    last: int
    last_op: int
    requires_grad: bool
    saved_at: int | None = None
    held: bool = False
    copied: bool = False  # a copy made for a reader on another device, right before it runs

    def touch(self, position: int, is_op: bool) -> None:
        self.last = max(self.last, position)
        if is_op:
            self.last_op = max(self.last_op, position)


@dataclass(frozen=True)
class Simulated:
    """Peak activation bytes per device.

    Attributes:
        forward: peak during the forward.
        backward: peak during the backward (training; empty otherwise).
        saved: bytes saved for backward at the end of the forward.
    """

    forward: dict[Hashable, int]
    backward: dict[Hashable, int] = field(default_factory=dict)
    saved: dict[Hashable, int] = field(default_factory=dict)

    @property
    def peak(self) -> dict[Hashable, int]:
        """The larger of the forward and backward peaks, per device."""
        return {d: max(v, self.backward.get(d, 0)) for d, v in self.forward.items()}


class _Walk:
    """Follows storages through the ops placed on devices, as the generated code runs them."""

    def __init__(self, profile: ActivationProfile, home: Mapping[str, Hashable], replicas: Replicas = None) -> None:
        self.profile = profile
        self.home = home
        self.replicas = replicas or {}  # weight -> other devices holding their own copy (no copy made)
        self.storages: list[_Storage] = []
        self.on: dict[tuple[str, Hashable], dict[int, int | None]] = {}
        self.weight_readers: dict[str, set[int]] = {}  # weight -> the ops that read it
        self.readers: dict[tuple[str, Hashable], set[int]] = {}
        self.device_of: dict[int, Hashable] = {}
        self.returned_on: Hashable = None  # the device the outputs are returned on
        self.sent: set[tuple[str, Hashable]] = set()  # copies whose gradient goes home (a reader sends one back)
        self.items_of = tuple_items(profile)  # a tuple's name -> the ops that take an item out of it
        self._apart: set[tuple[int, int]] | None = None
        self.copies: dict[int, set[tuple[str, Hashable]]] = {}  # storage id -> the copies made of values holding it

    def _new(self, device: Hashable, nbytes: int, position: int, requires_grad: bool, copied: bool = False) -> int:
        self.storages.append(_Storage(device, nbytes, position, position, position, requires_grad, copied=copied))
        return len(self.storages) - 1

    def place(
        self, name: str, device: Hashable, position: int, is_op: bool, only: frozenset[int] | None = None
    ) -> dict[int, int | None]:
        """Storage ids -> simulated storage of value ``name`` on ``device`` (None: a resident weight); an op
        that reads ``only`` some of its storages (takes them out of a tuple) reads the rest for the forward."""
        if is_op and name in self.profile.weights:
            self.weight_readers.setdefault(name, set()).add(position)
        elif is_op and only is None:
            self.readers.setdefault((name, device), set()).add(position)
        found = self.on.get((name, device))
        if found is None:
            info = self.profile.values[name]
            home = self.home[name]
            if not info.storages:
                found = {}
            elif name in self.profile.weights and (device == home or device in self.replicas.get(name, ())):
                found = dict.fromkeys(info.storages)
            elif device == home:  # a model input, arriving where it is first read
                found = dict.fromkeys(info.storages, self._new(device, info.nbytes, position, info.requires_grad))
            else:  # a copy from the value's home, made right before its first reader here
                self.place(name, home, position, is_op, only)
                found = dict.fromkeys(info.storages, self._new(device, info.nbytes, position, info.requires_grad, True))
                for key in info.storages:
                    self.copies.setdefault(key, set()).add((name, device))
                if is_op and self._sends_gradient(position):
                    self.sent.add((name, device))
            self.on[(name, device)] = found
        elif is_op and only is None and (name, device) not in self.sent and self._sends_gradient(position):
            home = self.home[name]
            if device != home and name not in self.profile.weights:  # the copy's first readers send no gradient
                # back (a comparison, fx's x.shape): its gradient goes home from this one's backward
                self.readers.setdefault((name, home), set()).add(position)
                self.sent.add((name, device))
        read = {index for key, index in found.items() if only is None or key in only}
        for index in set(found.values()):
            if index is not None:
                self.storages[index].touch(position, is_op and (index in read or self.storages[index].copied))
        return found

    def _sends_gradient(self, op: int) -> bool:
        result = self.profile.values.get(self.profile.op_names[op])
        return result is None or result.requires_grad

    def run_op(self, op: int, device: Hashable) -> None:
        profile = self.profile
        self.device_of[op] = device
        read: dict[int, list[int | None]] = {}  # storage id -> what it is here (views of one storage copied
        only = profile.extracts.get(op)  # from another device are as many copies)
        for name in profile.reads[op]:
            for key, index in self.place(name, device, op, True, only).items():
                read.setdefault(key, []).append(index)
        result = profile.values.get(profile.op_names[op])
        own: dict[int, int | None] = {}
        if result is not None:
            for key in result.storages:
                own[key] = (
                    read[key][0]
                    if key in read
                    else self._new(device, profile.storage_bytes[key], op, result.requires_grad)
                )
                index = own[key]
                if op in profile.in_place and index is not None and result.requires_grad:  # written in place with
                    self.storages[index].requires_grad = True  # a value needing a gradient: (x * 0.5).mul_(h)
        self.on[(profile.op_names[op], device)] = own
        for key in result.storages if result is not None and op in profile.in_place else ():  # written in place:
            for copy in [c for c in self.copies.pop(key, ()) if c[1] != device]:  # a reader elsewhere after this
                self.on.pop(copy, None)  # gets a new copy, as the generated code makes
                self.sent.discard(copy)
        for key in profile.per_op("saved")[op]:
            for index in [own[key]] if key in own else read.get(key, []):
                if index is not None:
                    storage = self.storages[index]
                    storage.saved_at = op if storage.saved_at is None else min(storage.saved_at, op)
        extra = profile.per_op("internal_saved")[op]
        if extra:
            self.storages[self._new(device, extra, op, False)].saved_at = op

    def held_gradients(self) -> list[tuple[Hashable, int, int, int]]:
        """``(device, first, last, nbytes)``: the gradient of a weight read by several ops, waiting at its home
        for the rest (:func:`~fxsplit.memory.weightgrads.held_weight_gradients`)."""
        return held_weight_gradients(self.profile, self.home, self.replicas, self.weight_readers, self.device_of)

    def gradients(self) -> list[tuple[Hashable, int, int, int]]:
        """``(device, first, last, nbytes)`` of each gradient tensor in backward.

        A storage's gradient lives from its last reader to the op that made
        it; storages whose gradients are one tensor (``grad_passthrough``)
        share one span. Each output's own, which the caller's loss makes, lives
        from the start of the backward to the op that made the output, and what
        its readers send is added into it (:meth:`contributions`).
        """
        parent = list(range(len(self.storages)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        end = len(self.profile.op_names)
        seeds, seeded = loss_gradients(self.profile, self.on, self.home, self.storages, self.returned_on)
        handed: dict[int, int] = {}  # a storage whose gradient is handed on -> the earliest op it is handed to
        handed_by: dict[int, int] = {}  # a storage given a gradient handed on -> the last op to hand it one
        apart = self.apart()
        for op, other in self.profile.grad_passthrough:
            device = self.device_of[op]
            if (op, other) in apart:  # added into the gradient it finds there: that one stays a tensor apart
                continue
            mine = [i for i in self.on.get((self.profile.op_names[op], device), {}).values() if i is not None]
            theirs = [i for i in self.on.get((self.profile.op_names[other], device), {}).values() if i is not None]
            for i in mine[:1]:
                for j in theirs:  # an output's gradient is the loss's: what is passed on to it is added into it
                    if j not in seeded or find(j) == find(i):
                        parent[find(j)] = find(i)
                        handed[i] = min(handed.get(i, self.storages[i].alloc), self.storages[j].alloc)
                        handed_by[j] = max(handed_by.get(j, -1), op)
        members: dict[int, list[tuple[int, int, int, int]]] = {}  # group -> (storage, first, last, handed by)
        for index, s in enumerate(self.storages):
            last = max(s.last_op, end) if index in seeded else s.last_op
            if s.requires_grad and (last > s.alloc or s.copied):  # a copy's: made by its reader's backward
                span = (index, handed.get(index, s.alloc), last, handed_by.get(index, -1))
                members.setdefault(find(index), []).append(span)
        found = [
            (self.storages[root].device, first, last, nbytes)
            for root, spans in members.items()
            for first, last, nbytes in one_tensor([(a, b, self.storages[i].nbytes) for i, a, b, _ in spans])
        ]
        renewals = []
        for op, other in self.profile.renewed:
            # an in-place op's new gradient waits beside what any later op handed its group; a view's, beside what
            # its sender (the op that handed the view its gradient) handed the view's siblings
            written = op in self.profile.in_place
            for renewed in self.on.get((self.profile.op_names[other], self.device_of[other]), {}).values():
                if renewed is None or len(members.get(find(renewed), ())) < 2:
                    continue
                sender = -1 if written else handed_by.get(renewed, -1)
                if written or sender >= 0:
                    storage = self.storages[renewed]
                    renewals.append((find(renewed), renewed, op, storage.alloc, storage.nbytes, sender))
        found += [(self.storages[i].device, a, b, n) for i, a, b, n in renewed_apart(renewals, members)]
        return found + seeds

    def apart(self) -> set[tuple[int, int]]:
        """The gradients handed on as is that stay apart from their recipient's (:func:`apart_receivers`), found
        once, after the walk."""
        if self._apart is None:
            self._apart = apart_receivers(self.profile, self.readers, self.device_of)
        return self._apart

    def contributions(self, weights: bool = True) -> list[tuple[Hashable, int, int, int]]:
        """``(device, first, last, nbytes)``: a value read by several ops gets one gradient from each
        (:func:`~fxsplit.memory.contributions.contributions`; ``weights``: a weight's too)."""
        return contributions(self, weights)

    def return_outputs(self, device: Hashable, position: int) -> None:
        self.returned_on = device
        for name in self.profile.outputs:
            for index in self.place(name, device, position, False).values():
                if index is not None:
                    self.storages[index].held = True


def _walk(
    profile: ActivationProfile,
    op_devices: Sequence[Hashable],
    input_homes: Mapping[str, Hashable],
    weight_homes: Mapping[str, Hashable],
    output_device: Hashable,
    replicas: Replicas = None,
) -> _Walk:
    home: dict[str, Hashable] = dict(zip(profile.op_names, op_devices, strict=True))
    home.update(input_homes)
    home.update(weight_homes)
    for name in profile.values:
        home.setdefault(name, output_device)
    walk = _Walk(profile, home, replicas)
    for op, device in enumerate(op_devices):
        walk.run_op(op, device)
    walk.return_outputs(output_device, len(op_devices))
    return walk


def simulate(
    profile: ActivationProfile,
    op_devices: Sequence[Hashable],
    input_homes: Mapping[str, Hashable],
    output_device: Hashable,
    weight_homes: Mapping[str, Hashable] | None = None,
    replicas: Replicas = None,
) -> Simulated:
    """Peak activation bytes per device when op ``i`` runs on ``op_devices[i]``.

    Args:
        profile: the model's profile.
        op_devices: the device of every op, in op order.
        input_homes: model input name -> the device it is first read on.
        output_device: where the outputs are returned.
        weight_homes: weight name -> its device (default: the output device).
        replicas: weight name -> other devices that hold it too (read there without a copy).
    """
    walk = _walk(profile, op_devices, input_homes, weight_homes or {}, output_device, replicas)
    n = len(op_devices)
    devices = list(dict.fromkeys([*op_devices, output_device]))
    internal = profile.per_op("internal")
    forward = {d: [0] * (n + 2) for d in devices}
    backward = {d: [0] * (n + 2) for d in devices}
    saved = dict.fromkeys(devices, 0)
    for s in walk.storages:
        keep = profile.training and s.saved_at is not None
        _add(forward[s.device], s.alloc, n if keep or s.held else s.last, s.nbytes)
        if not profile.training:
            continue
        if s.saved_at is not None:
            saved[s.device] += s.nbytes
        if s.held:  # the caller holds it through the whole backward
            _add(backward[s.device], 0, n, s.nbytes)
        elif s.saved_at is not None:  # freed after the backward of its first saver
            _add(backward[s.device], s.saved_at, n, s.nbytes)
    if profile.training:
        for device, first, last, nbytes in walk.gradients():
            _add(backward[device], first, last, nbytes)
        for device, first, last, nbytes in walk.held_gradients():
            _add(backward[device], first, last, nbytes)
        for device, first, last, nbytes in walk.contributions():
            _add(backward[device], first, last, nbytes)
    if profile.training:
        for device, at, nbytes in foreign_sums(profile, walk.home, walk.device_of, walk.readers):
            _add(backward[device], at, at, nbytes)
    backward_internal = profile.per_op("backward_internal")
    for op, device in enumerate(op_devices):
        _add(forward[device], op, op, internal[op])
        _add(backward[device], op, op, backward_internal[op])
    result = Simulated({d: _peak(forward[d]) for d in devices})
    if profile.training:
        result = Simulated(result.forward, {d: _peak(backward[d]) for d in devices}, saved)
    return result


def _add(diff: list[int], start: int, stop: int, nbytes: int) -> None:
    """Add ``nbytes`` to positions ``start..stop`` (inclusive) of a difference array."""
    diff[start] += nbytes
    diff[stop + 1] -= nbytes


def _peak(diff: list[int]) -> int:
    best = running = 0
    for delta in diff:
        running += delta
        best = max(best, running)
    return best


def _kept_from(storage: _Storage) -> int | None:
    """The op from which a storage stays until the end of the backward, or None."""
    if storage.held:
        return storage.alloc
    return storage.saved_at
