"""A solved placement (:class:`Partition`), what it costs (:func:`transfer_bytes`) and whether it is valid.

>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> skip = PartitionProblem(("a", "b", "c"), (Value("a", 8, 0, (1, 2)), Value("w", 0, 2, (2,), weight=10)))
>>> transfer_bytes(skip, [0, 1, 1]), transfer_bytes(skip, [0, 1, 2])
(8, 16)
>>> placement_problems(skip, [0, 1, 1], [100, 5])
['device 1 needs 10 bytes, more than its budget of 5']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fxsplit.partition.problem import PartitionProblem

__all__ = ["Partition", "placement_problems", "transfer_bytes"]


@dataclass(frozen=True)
class Partition:
    """A solved placement.

    Attributes:
        op_devices: device index of every op, in op order.
        transfer_bytes: bytes copied between devices per forward pass.
        device_weights: bytes each device needs, by device index: resident bytes (parameters,
            buffers, ``op_extra``) plus its largest ``op_transient``.
        output_device: the device index the graph's outputs go to, when the partitioner placed them too
            (:mod:`fxsplit.partition.outputs`; ``transfer_bytes`` then counts their copies), else None.
    """

    op_devices: tuple[int, ...]
    transfer_bytes: int
    device_weights: tuple[int, ...]
    output_device: int | None = None


def transfer_bytes(problem: PartitionProblem, op_devices: Sequence[int]) -> int:
    """Bytes copied per forward: each value once per device, other than its home, that reads it."""
    values, readers, starts, nbytes = problem.read_edges
    if not len(values):
        return 0
    devices = np.asarray(op_devices, dtype=np.int64)
    destination, home = devices[readers], devices[starts]
    away = (destination != home) & (nbytes > 0)
    copies = np.unique(values[away] * (int(devices.max()) + 1) + destination[away], return_index=True)[1]
    return int(nbytes[away][copies].sum())


def placement_problems(problem: PartitionProblem, op_devices: Sequence[int], budgets: Sequence[int]) -> list[str]:
    """Every rule ``op_devices`` breaks: one device index per op, within ``budgets`` (resident bytes with the
    ``held`` weights read there, plus the largest transient, as :func:`~fxsplit.partition.refine.device_loads`
    counts), pins and together-constraints held (ops that no cut may separate share a device). Empty when it
    is valid."""
    if len(op_devices) != problem.num_ops:
        return [f"it places {len(op_devices)} ops, but the problem has {problem.num_ops}"]
    devices = np.asarray(op_devices)
    if problem.num_ops and (devices.dtype.kind not in "iu" or devices.min() < 0 or devices.max() >= len(budgets)):
        bad = sorted({repr(d) for d in op_devices if not (_is_int(d) and 0 <= d < len(budgets))})
        return [f"device indices must be ints from 0 to {len(budgets) - 1} (got {', '.join(bad[:5])})"]
    loads = np.zeros(len(budgets), dtype=np.int64)
    peaks = np.zeros(len(budgets), dtype=np.int64)
    np.add.at(loads, devices, np.asarray(problem.op_weights(), dtype=np.int64))
    np.maximum.at(peaks, devices, np.asarray(problem.transients(), dtype=np.int64))
    if problem.held:
        loads += np.asarray(problem.held_loads(devices.tolist(), len(budgets)), dtype=np.int64)
    problems = [
        f"device {k} needs {load} bytes, more than its budget of {budget}"
        for k, (load, budget) in enumerate(zip((loads + peaks).tolist(), budgets, strict=True))
        if load > budget
    ]
    problems += [
        f"op {problem.label(op)} is pinned to device {device} but placed on {op_devices[op]}"
        for op, device in sorted(problem.pinned.items())
        if op_devices[op] != device
    ]
    for lo, hi in problem.no_cut_spans():
        if len(set(devices[lo : hi + 1].tolist())) > 1:
            problems.append(
                f"ops {problem.label(lo)} to {problem.label(hi)} must share a device (a together-group or a value "
                f"changed in place) but run on {sorted(set(devices[lo : hi + 1].tolist()))}"
            )
    for group in problem.colocated:
        shared = sorted({int(devices[op]) for op in group})
        if len(shared) > 1:
            problems.append(
                f"ops {', '.join(problem.label(op) for op in sorted(group)[:4])} write one tensor in place, so they "
                f"must share a device, but run on {shared}"
            )
    return problems


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
