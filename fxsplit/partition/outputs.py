"""The graph's outputs as one more reader, so that the partitioner also places where they are returned.

A split module returns its outputs on one device, so every output made
elsewhere is copied there once per forward, like any value read on another
device. :func:`with_output_reader` adds an op that reads every output (no
weight, no memory) after the last op; the partitioner then minimises the
bytes copied between ops *and* to the outputs' device together, and places
that op where the fewest output bytes must travel (or where ``device`` pins
it, when the caller fixed the output device). :func:`without_output_reader`
takes it out of the answer again: the ops' devices, and the outputs' device
beside them.

>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> towers = PartitionProblem(("a", "b"), (Value("wa", 0, 0, (0,), weight=60), Value("wb", 0, 1, (1,), weight=60)))
>>> seen = with_output_reader(towers, [("a", 100, 0), ("b", 4, 1)])
>>> seen.op_names, seen.values[-2:]
(('a', 'b', 'output'), (Value(name='a', nbytes=100, start=0, consumers=(2,), weight=0, movable=True), \
Value(name='b', nbytes=4, start=1, consumers=(2,), weight=0, movable=True)))
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.result import Partition
from fxsplit.partition.throughput import Timing

__all__ = ["OUTPUT_READER", "with_output_reader", "with_output_seconds", "without_output_reader"]

OUTPUT_READER = "output"
"""The name of the op :func:`with_output_reader` adds (the graph's output node is named so)."""


def with_output_reader(
    problem: PartitionProblem, outputs: Sequence[tuple[str, int, int]], device: int | None = None
) -> PartitionProblem:
    """``problem`` with one more op, last, that reads every output.

    Args:
        problem: the ops and values.
        outputs: ``(value name, bytes, start)`` of each value the graph returns: a value of ``problem`` of that
            name gets the new op as one more reader (of a weight held in copies for groups of its readers,
            :func:`~fxsplit.planning.replicas.replicated_problem`, the copy its last readers read), another is
            added (an op's result that no op reads: ``start`` is that op).
        device: the device index the outputs must be returned on (the op is pinned there), or None (anywhere).
    """
    reader = problem.num_ops
    by_name = {name: (nbytes, start) for name, nbytes, start in outputs if nbytes > 0}
    values = list(problem.values)
    latest: dict[str, int] = {}  # name -> the value read last: of a weight held in copies, the one the last ops read
    for index, value in enumerate(values):
        if value.name in by_name and (value.name not in latest or value.last >= values[latest[value.name]].last):
            latest[value.name] = index
    for name, index in latest.items():  # a weight too: returned, it is copied from its home like an activation
        by_name.pop(name)
        values[index] = values[index]._replace(consumers=(*values[index].consumers, reader))
    values += [Value(name, nbytes, start, (reader,)) for name, (nbytes, start) in by_name.items()]
    pinned = dict(problem.pinned)
    if device is not None:
        pinned[reader] = device
    return dataclasses.replace(
        problem,
        op_names=(*problem.op_names, OUTPUT_READER),
        values=tuple(values),
        pinned=pinned,
        op_labels=(*problem.op_labels, "") if problem.op_labels else (),
        op_extra=(*problem.op_extra, 0) if problem.op_extra else (),
        op_transient=(*problem.op_transient, 0) if problem.op_transient else (),
    )


def with_output_seconds(timing: Timing | None) -> Timing | None:
    """``timing`` with the added reader taking no time on any device."""
    if timing is None:
        return None
    zero = np.zeros((timing.op_seconds.shape[0], 1), dtype=timing.op_seconds.dtype)
    return Timing(np.hstack([timing.op_seconds, zero]), timing.bandwidth, timing.latency)


def without_output_reader(found: Partition) -> Partition:
    """The partition of the problem before :func:`with_output_reader`: its ops' devices, and the reader's device as
    ``output_device``. ``transfer_bytes`` still counts the outputs' copies (what the placement was chosen by)."""
    *ops, output = found.op_devices
    return dataclasses.replace(found, op_devices=tuple(ops), output_device=output)
