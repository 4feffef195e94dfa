"""A value read both before and after an in-place write to its tensor: one value per version, as the run copies it.

A copy made for another device holds the tensor as it was when copied; after a write to the tensor (to its alias
root: a view written in place writes its base), a reader on that device needs a new copy
(:class:`~fxsplit.planning.build.WriteVersions`, which the code and the plan's cuts follow). Counted as one value,
the partitioner charged one copy where the run makes one per version read there: random program 14072's ``a_l0``,
read on cpu:1 before and after ``a_l0[..., 38:75].add_(0.5)``, was charged 36,864 B and copied twice, and a plan
the partitioner scored at 58,368 B copied 95,232 B, more than the 92,160 B of a smaller budget's plan.

:func:`split_by_version` gives such a value's readers of each later version a value of their own, made by the
write that made the version (it runs where the tensor lives: writers share a device with it,
:func:`~fxsplit.cost.build.written_tensors`).
"""

from __future__ import annotations

import bisect
from typing import Mapping, Sequence

import torch.fx

from fxsplit.partition.problem import Value
from fxsplit.tracing.graphinfo import alias_root

__all__ = ["split_by_version"]


def split_by_version(
    values: list[Value],
    nodes: Sequence[torch.fx.Node],
    index: Mapping[torch.fx.Node, int],
    mutations: Mapping[torch.fx.Node, Sequence[torch.fx.Node]],
) -> list[Value]:
    """``values`` (of activations and inputs, not weights) with each value whose readers read its tensor at several
    versions split into one value per version read.

    Args:
        values: the values, each named by its node.
        nodes: the nodes the values are named by (placeholders and ops).
        index: op -> its position.
        mutations: op -> the nodes whose tensors it writes in place (:func:`~fxsplit.tracing.writers.writing_ops`).
    """
    writes: dict[torch.fx.Node, list[int]] = {}  # alias root -> the positions of the ops that write it, in order
    for writer, targets in mutations.items():
        for target in targets:
            root = alias_root(target)
            if root.op != "get_attr":  # a weight written in place stays where its first reader runs
                writes.setdefault(root, []).append(index[writer])
    if not writes:
        return values
    for found in writes.values():
        found.sort()
    by_name = {node.name: node for node in nodes}
    split: list[Value] = []
    for value in values:
        node = by_name.get(value.name)
        at = writes.get(alias_root(node)) if node is not None and len(value.consumers) > 1 else None
        if at is None:
            split.append(value)
            continue
        versions: dict[int, list[int]] = {}  # version -> its readers (a writer reads the version before its write)
        for reader in value.consumers:
            versions.setdefault(bisect.bisect_left(at, reader), []).append(reader)
        if len(versions) == 1:
            split.append(value)
            continue
        first = min(versions)
        for version, readers in sorted(versions.items()):
            start = value.start if version == first else at[version - 1]
            split.append(value._replace(start=start, consumers=tuple(readers)))
    return split
