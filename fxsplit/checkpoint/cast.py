"""Cast a model to the plan's dtype before it is traced, when a checkpoint will fill it at that dtype.

A checkpoint is loaded as the plan's ``dtype`` (``dtype="bfloat16"``), so the
split runs a bf16 model. Its graph must be that model's: a trace bakes the
dtypes it saw into the graph (torch.export's ``_assert_tensor_metadata``
checks, a mask made with ``dtype=self.weight.dtype``), and a graph traced at
float32 then fails, or computes in float32, on bf16 weights. So the floating
parameters and persistent buffers are cast first (the same tensor objects, new
data; on ``meta`` this costs nothing), and put back if the call fails.

Non-persistent buffers are no checkpoint's: the model computes them when it is
built (a rotary embedding's ``inv_freq``), and keeps them at the dtype it made
them, as transformers' ``from_pretrained(dtype=...)`` does (a bf16 rotary
table would turn every position's angle by a bf16 rounding). The graph is then
traced at the dtypes the split runs at, so the plan counts its tensors as traced
(:class:`CastForLoad` says so), not as if all were the plan's dtype: a causal
LM's loss casts the bf16 logits to float32, and counted at bf16 that tensor
was half its size.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from fxsplit.callsite import user_stacklevel
from fxsplit.cost.walk import named_tensors
from fxsplit.errors import FxsplitWarning

__all__ = ["CastForLoad", "cast_floating", "warn_uncast"]


def cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> Callable[[], None]:
    """Give every floating parameter and persistent buffer of ``model`` the ``dtype``; returns what undoes it."""
    changed: list[tuple[torch.Tensor, torch.Tensor]] = []
    computed = {  # non-persistent buffers: the model's own, kept at their dtype
        id(buffer)
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name in module._non_persistent_buffers_set
    }
    seen: set[int] = set()
    for _, tensor, _ in named_tensors(model):
        if id(tensor) in seen or id(tensor) in computed or not tensor.is_floating_point() or tensor.dtype == dtype:
            continue
        seen.add(id(tensor))
        changed.append((tensor, tensor.data))
        tensor.data = tensor.data.to(dtype)

    def undo() -> None:
        for tensor, data in changed:
            tensor.data = data

    return undo


class CastForLoad:
    """``with CastForLoad(model, loads) as cast:`` ... ``cast(dtype)`` casts ``model`` (when ``loads``: a
    checkpoint will fill it) to the plan's dtype once it is known, and says whether it did: then the model holds
    what the split will hold, and its trace the dtypes the split runs at. The cast is undone if the block fails."""

    def __init__(self, model: torch.nn.Module, loads: bool) -> None:
        self.model = model
        self.loads = loads
        self.undo: list[Callable[[], None]] = []

    def __call__(self, dtype: str | None) -> bool:
        if self.loads and dtype:
            self.undo.append(cast_floating(self.model, getattr(torch, dtype)))
            return True
        return False

    def __enter__(self) -> CastForLoad:
        return self

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        if error is not None:  # a failed call leaves the model as it was
            for undo in reversed(self.undo):
                undo()


def warn_uncast(model: torch.nn.Module, dtype: str | None) -> None:
    """Warn when a split without a checkpoint keeps floating tensors at another dtype than the plan counted:
    their bytes on the devices are not those the budgets were checked against."""
    if not dtype:
        return
    planned = getattr(torch, dtype)
    held = {t.dtype for _, t, _ in named_tensors(model) if t.is_floating_point() and t.dtype != planned}
    if held:
        found = ", ".join(sorted(str(d).removeprefix("torch.") for d in held))
        warnings.warn(
            FxsplitWarning(
                f"the plan counts floating weights as {dtype}, but the model's are {found} and are moved as they "
                f"are, so devices hold other bytes than the budgets were checked for; cast the model first "
                f"(model.to(torch.{dtype})) or pass checkpoint= to load it as {dtype}"
            ),
            stacklevel=user_stacklevel(),
        )
