"""The dtype a model cast for a plan is fed its floating example inputs at: as given, or the plan's.

A split of a model cast to bf16 takes inputs of the dtypes it was traced with
(torch.export checks each input's dtype). A model that converts its inputs
itself (Hugging Face's vision models cast the pixels to their weights' dtype)
runs on float32 inputs, and its split should take them as the model does; a
model that does not (a ``Linear`` first) cannot run them at bf16, so it is
fed at the dtype, as it will be. :func:`traced_as_fed` traces the cast model
on the inputs as given, and again at the dtype only when the first graph has
ops that take two floating dtypes where kernels need one
(:mod:`fxsplit.tracing.mixeddtypes`: the model cannot run them as given), or
has no shapes that the second has. ``fxsplit.plan(dtype=...)``, ``fxsplit.fxsplit(checkpoint=...,
dtype=...)`` and ``fxsplit.apply`` of their plans so choose alike, and make
one plan of one model.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from torch.utils._pytree import tree_leaves

from fxsplit.checkpoint.standin import planning_inputs
from fxsplit.errors import TraceError
from fxsplit.tracing.mixeddtypes import mixed_dtype_ops

__all__ = ["at_dtype", "retraced_as_fed", "traced_as_fed"]

_Made = TypeVar("_Made")


def at_dtype(inputs: Any, dtype: torch.dtype) -> Any | None:
    """``inputs`` with each floating tensor at ``dtype`` (:func:`planning_inputs`), or None when that changes
    none of them (no floating input, or all of the dtype already)."""
    cast = planning_inputs(inputs, dtype)
    same = all(a is b for a, b in zip(tree_leaves(cast), tree_leaves(inputs), strict=True))
    return None if same else cast


def traced_as_fed(
    tracing: Callable[[Any, Any], _Made],
    inputs: tuple[Any, Any],
    dtype: torch.dtype,
    graph: Callable[[_Made], torch.fx.GraphModule],
) -> tuple[_Made, tuple[Any, Any]]:
    """``tracing(*fed)`` and ``fed``: the example inputs ``(positional, keyword)`` as given, or at ``dtype`` when
    the model traced on them as given fails, mixes floating dtypes (it cannot run them) or, traced with fx, has no
    shapes that the inputs at the dtype give. A trace at the dtype that fails raises (the caller's fallback)."""
    cast = at_dtype(inputs, dtype)
    if cast is None:
        return tracing(*inputs), inputs
    try:
        made = tracing(*inputs)
    except TraceError:  # (a fake kernel that checks dtypes: attention's query, key and value)
        return tracing(*cast), cast
    if mixed_dtype_ops(graph(made)):
        return tracing(*cast), cast
    if not getattr(made, "shapes_missing", None):
        return made, inputs
    try:
        other = tracing(*cast)
    except TraceError:
        return made, inputs
    return (made, inputs) if getattr(other, "shapes_missing", None) else (other, cast)


def retraced_as_fed(
    retrace: Callable[[Any, Any], _Made],
    inputs: tuple[Any, Any],
    dtype: torch.dtype | None,
    mismatch: type[Exception],
    traced_of: Callable[[_Made], Any],
) -> _Made:
    """``retrace(*inputs)`` of a saved plan's cast model on the example inputs as given, or at ``dtype`` where the
    graph as given is not the plan's (``mismatch``), does not trace, or (as :func:`traced_as_fed` chooses) mixes
    floating dtypes or, traced with fx, has no shapes that the inputs at the dtype give: the plan was traced on
    them at the dtype (torch.fx's graph is the same at either dtype, so the plan's check alone let a float32 trace
    stand for a bf16 one). ``traced_of``: the trace in what ``retrace`` returns. The first error is raised when
    neither is the plan's; the error at the dtype, when the graph as given mixes dtypes and that one fails to
    trace."""
    cast = at_dtype(inputs, dtype) if dtype is not None else None
    try:
        made = retrace(*inputs)
    except (mismatch, TraceError):  # (as traced_as_fed: a fake kernel that checks dtypes fails the trace)
        if cast is None:
            raise
        try:
            return retrace(*cast)
        except (mismatch, TraceError):
            pass
        raise
    if cast is None:
        return made
    mixed = bool(mixed_dtype_ops(traced_of(made).graph_module))
    if not mixed and not traced_of(made).shapes_missing:
        return made
    try:
        other = retrace(*cast)
    except mismatch:
        return made
    except TraceError:
        if mixed:  # the model cannot run the inputs as given: the caller's fallback (computed buffers cast too)
            raise
        return made
    return other if mixed or not traced_of(other).shapes_missing else made
