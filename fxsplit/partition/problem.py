"""The partitioning problem as plain data: no torch needed.

A model's graph becomes a sequence of *ops* (the compute nodes, in the
graph's topological order) and a list of *values* that flow between them:

* an op's output (``start`` is the producing op), and
* free-floating values - inputs and parameters/buffers - whose home is the
  device of their first consumer (``start`` is that consumer).

Moving a value to another device costs ``nbytes`` once per destination
device. A value with ``weight > 0`` is resident memory (parameters, buffers)
charged to the budget of its home device. A value that is not ``movable``
(state mutated in place) must have every consumer on its home device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, NamedTuple, Sequence

import numpy as np

__all__ = ["PartitionProblem", "Value"]


class Value(NamedTuple):
    """One value of the graph, as the partitioner sees it.

    A named tuple, not a dataclass: the cost model makes one per op and one per weight (200k on a 100k-op
    graph), and a tuple is made and freed in a third of a frozen dataclass's time. Change one with
    ``value._replace(...)``.

    Attributes:
        name: the graph node (or parameter) that holds it.
        nbytes: bytes moved when it is copied to another device.
        start: index of the producing op, or of the first consumer for inputs
            and parameters (their home is wherever that op runs).
        consumers: sorted indices of the ops that read it.
        weight: bytes of resident memory (parameters and buffers) it charges to
            its home device's budget.
        movable: False when the value is mutated in place, so every consumer
            must run on its home device.
    """

    name: str
    nbytes: int
    start: int
    consumers: tuple[int, ...]
    weight: int = 0
    movable: bool = True

    @property
    def last(self) -> int:
        """Index of the last op that reads the value (``start`` if none)."""
        return self.consumers[-1] if self.consumers else self.start


@dataclass(frozen=True)
class PartitionProblem:
    """Ops in order, the values between them, and placement constraints.

    Attributes:
        op_names: one name per op, in execution order.
        values: every value that ops read.
        pinned: op index -> device index it must run on.
        together: groups of op indices that must share one device, and every
            op between them too (no cut may fall inside a group's span).
        op_labels: optional human-readable label per op (module path), for errors.
        op_extra: optional resident bytes charged to the device that runs each
            op, on top of the weights (e.g. activations saved for backward).
        op_transient: optional bytes that must be free on the device while
            each op runs (e.g. live activations); a device's load adds the
            largest of these over the ops it runs.
        colocated: groups of op indices that must share one device while
            the ops between them may run anywhere: the ops that write one
            tensor in place (and make views of it) and the op that makes it,
            or reads it first, which decides where it lives.
        held: indices of values (weights) that every device running one of
            their readers holds a copy of, as pipeline stages run one per
            process do: its ``weight`` is charged on each such device, not
            only at home. Only contiguous placements are sought for a
            problem that holds any (:func:`~fxsplit.partition.solve.partition`).

    A device running ops ``[i, j)`` needs the weights whose home is one of
    those ops, plus ``sum(op_extra[i:j])``, plus ``max(op_transient[i:j])``,
    plus the ``held`` weights read there whose home is elsewhere.
    """

    op_names: tuple[str, ...]
    values: tuple[Value, ...]
    pinned: Mapping[int, int] = field(default_factory=dict)
    together: tuple[tuple[int, ...], ...] = ()
    op_labels: tuple[str, ...] = ()
    op_extra: tuple[int, ...] = ()
    op_transient: tuple[int, ...] = ()
    colocated: tuple[tuple[int, ...], ...] = ()
    held: tuple[int, ...] = ()

    @property
    def num_ops(self) -> int:
        return len(self.op_names)

    def held_loads(self, op_devices: Sequence[int], num_devices: int) -> list[int]:
        """Bytes each device holds of the ``held`` values whose home is another device, for a placement."""
        loads = [0] * num_devices
        last = self.num_ops - 1
        for index in self.held:
            value = self.values[index]
            if not value.weight or not value.consumers:
                continue
            home = op_devices[min(value.start, last)]
            for device in {op_devices[op] for op in value.consumers} - {home}:
                loads[device] += value.weight
        return loads

    def op_weights(self) -> list[int]:
        """Resident bytes charged at each op: the weights whose home is that op, plus ``op_extra``."""
        return list(self._op_weights)

    @cached_property
    def _op_weights(self) -> tuple[int, ...]:
        weights = list(self.op_extra) if self.op_extra else [0] * self.num_ops
        for value in self.values:
            if value.weight and self.num_ops:
                weights[min(value.start, self.num_ops - 1)] += value.weight
        return tuple(weights)

    @cached_property
    def op_reads(self) -> tuple[tuple[int, ...], ...]:
        """Indices of the values each op reads (once per reading, as ``consumers`` lists them)."""
        reads: list[list[int]] = [[] for _ in range(self.num_ops)]
        for index, value in enumerate(self.values):
            for op in value.consumers:
                reads[op].append(index)
        return tuple(tuple(r) for r in reads)

    @cached_property
    def op_homes(self) -> tuple[tuple[int, ...], ...]:
        """Indices of the values whose home is each op: read or resident ones with ``start`` there."""
        n = self.num_ops
        homes: list[list[int]] = [[] for _ in range(n)]
        for index, value in enumerate(self.values):
            if (value.consumers or value.weight) and n:
                homes[min(value.start, n - 1)].append(index)
        return tuple(tuple(h) for h in homes)

    @cached_property
    def read_edges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(value, reader, start, bytes)`` arrays, one entry per read (value index, reading op)."""
        pairs = [(i, op, v.start, v.nbytes) for i, v in enumerate(self.values) for op in v.consumers]
        columns = np.array(pairs, dtype=np.int64).reshape(-1, 4).T
        return columns[0], columns[1], columns[2], columns[3]

    @cached_property
    def values_by_size(self) -> tuple[int, ...]:
        """Value indices, largest ``nbytes`` first (ties in index order)."""
        return tuple(sorted(range(len(self.values)), key=lambda i: (-self.values[i].nbytes, i)))

    def transients(self) -> list[int]:
        """``op_transient`` with one entry per op (zeros when not given)."""
        return list(self.op_transient) if self.op_transient else [0] * self.num_ops

    def glued(self) -> PartitionProblem:
        """The same problem with every colocated group held as a span (no cut inside it): stricter, and
        what contiguous placements need."""
        if not self.colocated:
            return self
        return dataclasses.replace(self, together=self.together + self.colocated, colocated=())

    def no_cut_spans(self) -> list[tuple[int, int]]:
        """Spans ``(a, b)`` of ops that must share a device, from constraints."""
        spans: list[tuple[int, int]] = []
        for group in self.together:
            if len(group) > 1:
                spans.append((min(group), max(group)))
        for value in self.values:
            if not value.movable and value.consumers:
                lo = min(value.start, value.consumers[0])
                if value.last > lo:
                    spans.append((lo, value.last))
        return spans

    def forbidden_cuts(self) -> list[bool]:
        """``forbidden[t]``: no device boundary may fall just before op ``t``."""
        diff = [0] * (self.num_ops + 2)
        for lo, hi in self.no_cut_spans():
            diff[lo + 1] += 1
            diff[hi + 1] -= 1
        forbidden: list[bool] = []
        running = 0
        for t in range(self.num_ops + 1):
            running += diff[t]
            forbidden.append(running > 0)
        return forbidden

    def label(self, op: int) -> str:
        """The op's name with its module path, for messages."""
        name = self.op_names[op]
        if self.op_labels and self.op_labels[op] and self.op_labels[op] != name:
            return f"'{name}' (in '{self.op_labels[op]}')"
        return f"'{name}'"


def consumers_sorted(indices: Sequence[int]) -> tuple[int, ...]:
    """Deduplicated, sorted consumer indices."""
    return tuple(sorted(set(indices)))
