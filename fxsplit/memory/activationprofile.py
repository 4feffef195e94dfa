"""What the activation profile of a traced graph holds: plain data, measured once per model.

:class:`ActivationProfile` is made by :mod:`fxsplit.memory.activations` (a run on fake tensors) and
simulated for any placement by :mod:`fxsplit.memory.lifetimes`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import AbstractSet, Mapping

__all__ = ["ActivationProfile", "ValueMemory", "without_dead_gradients"]


@dataclass(frozen=True)
class ValueMemory:
    """What one value of the graph holds.

    Attributes:
        nbytes: bytes of the value itself (what a copy to another device costs).
        storages: ids of the storages it keeps alive (a view: its base's).
        requires_grad: whether autograd computes its gradient in the backward (training): the value needs one
            and something that gets one reads it (:func:`without_dead_gradients`).
    """

    nbytes: int
    storages: tuple[int, ...]
    requires_grad: bool = False


@dataclass(frozen=True)
class ActivationProfile:
    """Reads, storages and saved tensors of every op, in execution order.

    Attributes:
        op_names: the ops, in the order of the partition problem.
        reads: per op, the names of the values it reads (op names, input
            names, canonical weight names).
        values: every value by name: op results, model inputs, weights.
        storage_bytes: bytes of each storage id.
        inputs: names of the model's inputs.
        outputs: names of the values the graph returns.
        weights: names of the values that are parameters or buffers; they
            cost nothing on their home device (counted as weights) but their
            copies on other devices are activations there.
        saved: per op, the storage ids autograd saves for its backward that
            a value it reads or returns holds (training only).
        internal: per op, the peak bytes it allocates inside beyond its
            result (intermediates of a composite op).
        internal_saved: per op, bytes it saves for backward that no value of
            the graph holds (a layer norm's statistics, a dropout mask).
        backward_internal: per op, the peak bytes its backward allocates
            inside beyond the gradients it returns, where a weight's gradient becomes its ``.grad`` (the
            first backward after ``zero_grad()``).
        backward_accumulating: the same where each weight's gradient is added to a ``.grad`` that exists
            (gradient accumulation, a pipeline's micro-batches): held until then. :meth:`accumulating` plans
            with it.
        grad_passthrough: ``(i, k)``: op ``i``'s backward hands the gradient
            of its result on, as the same tensor, as the gradient of op
            ``k``'s result (an add, a clone): one tensor, not two.
        training: whether the profile was taken with autograd recording.
        extracts: op -> the storages it takes out of the one value it reads, a tuple (``getitem``): the rest
            of the tuple gets no gradient from it.
        in_place: the ops that write a value they read and return it (their result shares its storage, as a
            view's does).
        foreign_sums: op -> earlier op -> bytes of a sum made out of place, in the op's backward, into the
            gradient of the earlier op's result (the one waiting is a view of another gradient). When the two
            ops run on different devices the sum happens where the earlier op's gradient waits, as the copy's
            gradient arrives: the simulation charges it there.
        items: the ops that take an item out of a tuple or list they read (``getitem``): no backward of their
            own, and no gradient of their own to add; the tuple's op's backward takes every item's gradient at
            once (``split``'s concatenates them, ``unbind``'s stacks them).
        renewed: ``(i, k)``: op ``i`` shares a storage with op ``k``'s result (it writes it in place, or is a view of
            it) and its backward returns a new tensor as the gradient of ``k``'s result. Where the gradient ``i``
            received was also handed to another value (``v.add_(h)`` hands it to ``h`` too; ``cat([a, h[:, 3:]])``
            hands parts of its own to ``a`` and the slice), that one waits while the new one lives.
        repeated_outputs: the outputs the graph returns more than once (``(y, y)``). Each return gets a gradient
            of its own from the loss; they are added, one by one, into the first as the backward starts.
    """

    op_names: tuple[str, ...]
    reads: tuple[tuple[str, ...], ...]
    values: Mapping[str, ValueMemory]
    storage_bytes: Mapping[int, int]
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    weights: frozenset[str] = frozenset()
    saved: tuple[tuple[int, ...], ...] = ()
    internal: tuple[int, ...] = ()
    internal_saved: tuple[int, ...] = ()
    backward_internal: tuple[int, ...] = ()
    backward_accumulating: tuple[int, ...] = ()
    grad_passthrough: tuple[tuple[int, int], ...] = ()
    training: bool = False
    extracts: Mapping[int, frozenset[int]] = field(default_factory=dict)
    in_place: frozenset[int] = frozenset()
    items: frozenset[int] = frozenset()
    foreign_sums: Mapping[int, Mapping[int, int]] = field(default_factory=dict)
    repeated_outputs: frozenset[str] = frozenset()
    renewed: tuple[tuple[int, int], ...] = ()

    @functools.cached_property
    def positions(self) -> dict[str, int]:
        """Op name -> its index in ``op_names``."""
        return {name: op for op, name in enumerate(self.op_names)}

    def accumulating(self) -> ActivationProfile:
        """This profile for a backward that adds each weight's gradient to a ``.grad`` that exists."""
        if not self.backward_accumulating:
            return self
        return dataclasses.replace(self, backward_internal=self.backward_accumulating)

    def per_op(self, field_name: str) -> list:
        """``saved``, ``internal``, ``internal_saved`` or ``backward_internal``, one entry per op."""
        data = getattr(self, field_name)
        empty: object = () if field_name == "saved" else 0
        return list(data) if data else [empty] * len(self.op_names)


def without_dead_gradients(
    op_names: tuple[str, ...],
    reads: tuple[tuple[str, ...], ...],
    values: Mapping[str, ValueMemory],
    outputs: tuple[str, ...],
    weights: AbstractSet[str],
) -> dict[str, ValueMemory]:
    """``values``, with ``requires_grad`` cleared on those no gradient reaches in the backward: neither returned nor
    read by an op whose result gets one (a result the model drops, as ``self.conv(h)`` never used, and what only
    such ops read). Autograd never runs their backward, so they send none to what they read. Weights keep theirs
    (their gradients are charged with the parameters).

    >>> h, dead = ValueMemory(8, (1,), True), ValueMemory(8, (2,), True)
    >>> kept = without_dead_gradients(("h", "dead", "out"), (("x",), ("h",), ("h",)),
    ...     {"x": ValueMemory(8, (0,)), "h": h, "dead": dead, "out": h}, ("out",), frozenset())
    >>> kept["h"].requires_grad, kept["dead"].requires_grad
    (True, False)
    """
    reached = {name for name in outputs if name in values and values[name].requires_grad}
    for op in range(len(op_names) - 1, -1, -1):
        if op_names[op] in reached:
            reached.update(name for name in reads[op] if name in values and values[name].requires_grad)
    return {
        name: value
        if not value.requires_grad or name in reached or name in weights
        else dataclasses.replace(value, requires_grad=False)
        for name, value in values.items()
    }
