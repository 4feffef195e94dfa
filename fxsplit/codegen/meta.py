"""What codegen writes into ``node.meta`` of the split graph, for the stages that read it back.

Memory measurement, pipeline stages and the invariant checks read which
device each node runs on (``DEVICE_META``) and what each copy moves
(``COPY_META``, a :class:`CopyRecord`), by field name. :func:`kept_on_copy` sets
attributes of a split that its copies (``copy.deepcopy``) must have too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.fx

__all__ = ["COPY_META", "DEVICE_META", "REPLICA_STORE", "CopyRecord", "kept_on_copy", "kept_on_copy_attributes"]

COPY_META = "fxsplit_copy"
"""``node.meta`` key: the :class:`CopyRecord` of a copy the generated code makes (``.to(device)``)."""

DEVICE_META = "fxsplit_device"
"""``node.meta`` key: the device an emitted op, copy or weight read runs on (placeholders have none)."""

REPLICA_STORE = "_fxsplit_replicas"
"""Attribute of a split that holds its replicas (:class:`fxsplit.runtime.ReplicaStore`), when its plan has any."""


class CopyRecord(NamedTuple):
    """One copy of a value from one device to another, as emitted (a plan's :class:`~fxsplit.planning.plan.Cut`).

    A tuple, so it compares equal to ``(producer, source, destination)``.

    Attributes:
        producer: the value copied, named as the plan's cuts name it: the
            graph node that makes it (a placeholder for a model input) or, for
            a parameter or buffer, its canonical qualified name.
        source: the device it is copied from; None for a model input brought
            from wherever the caller's tensor is to the device of its first
            reader.
        destination: the device it is copied to.
    """

    producer: str
    source: str | None
    destination: str


_PRESERVED = "_user_preserved_attributes"  # torch.fx's: GraphModule.__deepcopy__ sets these on the copy


def kept_on_copy(split: torch.fx.GraphModule, **attributes: Any) -> None:
    """Set ``attributes`` on ``split``, and on every deep copy of it (a copy of a graph module is built from its
    graph, submodules and tensors, and would have the class's defaults instead)."""
    for name, value in attributes.items():
        setattr(split, name, value)
    split.meta.setdefault(_PRESERVED, {}).update(attributes)


def kept_on_copy_attributes(meta: dict[str, Any]) -> dict[str, Any]:
    """The attributes :func:`kept_on_copy` set, from a split's ``meta``."""
    return dict(meta.get(_PRESERVED, {}))
