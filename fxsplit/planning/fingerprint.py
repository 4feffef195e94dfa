"""A model's structure as a short hash, and what differs when two do not match.

The structure is the name, shape and dtype of every parameter and buffer, and
which names are one tensor (tied). A plan records it, so that applying a saved
plan to another model fails with a list of differences instead of a wrong split.

>>> import torch
>>> model = torch.nn.Linear(4, 2)
>>> fingerprint, tensors, tied = describe(model)
>>> tensors
{'weight': 'float32[2, 4]', 'bias': 'float32[2]'}
>>> differences(tensors, tied, torch.nn.Linear(4, 3))
["changed: 'weight' is float32[3, 4] in the model, float32[2, 4] in the plan", \
"changed: 'bias' is float32[3] in the model, float32[2] in the plan"]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Iterable, Sequence

from fxsplit.gcpause import gc_paused

__all__ = [
    "Structure",
    "describe",
    "differences",
    "fingerprint_of",
    "graph_constants",
    "record_origin",
    "tensor_signature",
]

Structure = tuple[str, dict[str, str], tuple[tuple[str, ...], ...]]
"""What :func:`describe` says of a model: ``(fingerprint, name -> signature, tied name groups)``."""


def tensor_signature(tensor: Any) -> str:
    """``"float32[256, 256]"``: dtype and shape, nothing about values or device."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}[{', '.join(str(int(d)) for d in tensor.shape)}]"


@gc_paused()
def describe(model: Any) -> Structure:
    """``(fingerprint, name -> signature, tied name groups)`` of ``model``'s parameters and buffers."""
    from fxsplit.cost.build import named_tensors  # torch: only here, so that a plan's fingerprint checks without it

    tensors: dict[str, str] = {}
    signatures: dict[tuple[Any, Any], str] = {}  # (dtype, shape) -> signature: models repeat a few shapes
    named = named_tensors(model)
    for name, tensor, _ in named:
        key = (tensor.dtype, tensor.shape)
        signature = signatures.get(key)
        if signature is None:
            signature = signatures[key] = tensor_signature(tensor)
        tensors[name] = signature
    tied: tuple[tuple[str, ...], ...] = ()
    if len(set(map(id, (tensor for _, tensor, _ in named)))) < len(named):  # some tensor has two names
        by_id: dict[int, list[str]] = {}
        for name, tensor, _ in named:
            by_id.setdefault(id(tensor), []).append(name)
        tied = tuple(tuple(names) for names in by_id.values() if len(names) > 1)
    return fingerprint_of(tensors, tied), tensors, tied


def graph_constants(placed: Iterable[str], tensors: dict[str, str], graph_module: Any) -> dict[str, str]:
    """Name -> signature of the tensors a plan places that are not the model's: constants its trace made
    (``torch.export`` lifts tensor attributes that are not parameters or buffers, such as a static KV cache
    kept on a plain object, into the graph). They are not part of the fingerprint: a re-trace makes them again.
    """
    from fxsplit.attrpath import attr_at

    placed = list(placed)
    if tensors.keys() >= set(placed):  # the usual case: every placed tensor is the model's
        return {}
    found: dict[str, str] = {}
    for name in placed:
        if name not in tensors:
            tensor = attr_at(graph_module, name, None)
            if tensor is not None:
                found[name] = tensor_signature(tensor)
    return found


def fingerprint_of(tensors: dict[str, str], tied: tuple[tuple[str, ...], ...]) -> str:
    """``"sha256:<16 hex digits>"`` over the signatures and tied groups."""
    by_name = [(name, tensors[name]) for name in sorted(tensors)]  # names are unique: sort them, not the pairs
    blob = json.dumps([by_name, sorted(sorted(g) for g in tied)], separators=(",", ":"), check_circular=False)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def differences(
    tensors: dict[str, str],
    tied: tuple[tuple[str, ...], ...],
    model: Any,
    *,
    dtype: str | None = None,
) -> list[str]:
    """What differs between a plan's recorded structure and ``model``; empty when they match.

    With ``dtype`` (the plan's planning dtype), a floating tensor recorded as
    float32 that is ``dtype`` in the model matches: the plan was made for the
    cast model.
    """
    _, found, found_tied = describe(model)
    lines = [
        f"missing: the plan has '{name}' ({sig}), the model does not"
        for name, sig in tensors.items()
        if name not in found
    ]
    lines += [
        f"extra: the model has '{name}' ({sig}), the plan does not"
        for name, sig in found.items()
        if name not in tensors
    ]
    for name, sig in found.items():
        if name in tensors and sig != tensors[name] and not _cast_of(tensors[name], sig, dtype):
            lines.append(f"changed: '{name}' is {sig} in the model, {tensors[name]} in the plan")
    planned, actual = {frozenset(g) for g in tied}, {frozenset(g) for g in found_tied}
    lines += [f"tied: the plan ties {sorted(g)}, the model does not" for g in sorted(planned - actual, key=sorted)]
    lines += [f"tied: the model ties {sorted(g)}, the plan does not" for g in sorted(actual - planned, key=sorted)]
    return lines


_FLOATING = ("float64", "float32", "float16", "bfloat16")


def _cast_of(recorded: str, actual: str, dtype: str | None) -> bool:
    if dtype is None:
        return False
    old_dtype, _, old_shape = recorded.partition("[")
    new_dtype, _, new_shape = actual.partition("[")
    return old_shape == new_shape and old_dtype in _FLOATING and new_dtype == dtype


def record_origin(
    made: Any,
    model: Any,
    dtype: str | None,
    leaves: Sequence[type | str],
    dynamic: str | None = None,
    graph_module: Any = None,
    *,
    given: Structure | None = None,
) -> Any:
    """The plan with what it was made from: the model's structure (and the tensors only its trace holds),
    the planning dtype, how to re-trace (and which ops' rows the graph splits). ``given``: the structure of the
    model as the caller gave it, when it was cast for planning (:func:`describe` of it then)."""
    fingerprint, tensors, tied = given if given is not None else describe(model)
    constants = graph_constants(made.param_devices, tensors, graph_module) if graph_module is not None else {}
    if graph_module is not None:
        from fxsplit.planning.rowsplits import recorded_splits

        made = dataclasses.replace(made, row_splits=recorded_splits(graph_module, model))
    names = tuple(leaf if isinstance(leaf, str) else f"{leaf.__module__}.{leaf.__qualname__}" for leaf in leaves)
    return dataclasses.replace(
        made,
        fingerprint=fingerprint,
        tensors=tensors,
        tied=tied,
        dtype=dtype,
        leaf_modules=names,
        dynamic_shapes=dynamic,
        constants=constants,
    )
