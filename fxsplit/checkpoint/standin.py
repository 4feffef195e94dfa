"""A model with real weights planned at another dtype: meta tensors of that dtype stand in for its weights.

``fxsplit.plan(model, dtype="bfloat16")`` of a float32 model with real weights
should plan the bf16 model: its attention softmax, norms and loss compute in
float32, and a float32 graph counted as bf16 counts those tensors at half their
size (a Llama's inference activations at 46% of the bf16 model's). Casting the
real weights would copy them. Instead, for the length of the call, each
parameter and buffer in the module tree is replaced by an empty ``meta`` tensor
of the dtype (floating ones, but a non-persistent buffer such as a rotary
table, which keeps its dtype as a checkpoint load keeps it, unless the cast
model needs it at the dtype: :mod:`fxsplit.checkpoint.computed`; and those the
model keeps at a dtype of its own: :mod:`fxsplit.cost.keptdtype`), one per tensor,
so ties stay ties. Nothing is allocated. The example inputs stay where they
are, their floating ones as given or at the dtype (:func:`planning_inputs`), as
the bf16 model can be fed (:mod:`fxsplit.checkpoint.fed`); the trace then runs the meta weights as fakes on the
inputs' device (:mod:`fxsplit.tracing.metaweights`), so the graph is the one
the model's code takes there (Falcon's index constants, which a graph traced
on ``meta`` lacks). :func:`stand_in` puts the model's own tensors back.
"""

from __future__ import annotations

from typing import Any, Callable, Collection

import torch
from torch.utils._pytree import tree_map

from fxsplit.checkpoint.computed import kept_buffers
from fxsplit.cost.keptdtype import kept_tensors
from fxsplit.cost.walk import forget_walk

__all__ = ["planning_inputs", "stand_in"]


def stand_in(model: torch.nn.Module, dtype: torch.dtype, cast_too: Collection[str] = ()) -> Callable[[], None] | None:
    """Replace ``model``'s parameters and buffers by empty meta tensors (floating ones, but non-persistent buffers
    other than those named in ``cast_too``, at ``dtype``); returns what puts them back, or None (nothing changed)
    when some tensor has no meta twin."""
    made: dict[int, torch.Tensor] = {}
    also = {id(tensor) for name, tensor in kept_buffers(model, dtype).items() if name in cast_too}
    kept = kept_tensors(model, dtype)
    replaced: list[tuple[dict[str, Any], str, torch.Tensor]] = []

    def undo() -> None:
        for table, name, tensor in reversed(replaced):
            table[name] = tensor
        forget_walk(model)

    try:
        for module in model.modules():
            computed = module._non_persistent_buffers_set
            tables: tuple[tuple[dict[str, Any], bool], ...] = ((module._parameters, True), (module._buffers, False))
            for table, is_parameter in tables:
                for name, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    twin = made.get(id(tensor))
                    if twin is None:
                        castable = is_parameter or name not in computed or id(tensor) in also or id(tensor) in kept
                        twin = made[id(tensor)] = _twin(tensor, kept.get(id(tensor), dtype), castable)
                    replaced.append((table, name, tensor))
                    table[name] = twin
    except Exception:  # noqa: BLE001 - a tensor subclass with no meta twin: plan the model as it is
        undo()
        return None
    forget_walk(model)  # the walk kept for this call lists the tensors it held
    return undo


def _twin(tensor: torch.Tensor, dtype: torch.dtype, castable: bool) -> torch.Tensor:
    empty = torch.empty_like(tensor, device="meta", dtype=dtype if castable and tensor.is_floating_point() else None)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
    return empty


def planning_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    """``inputs`` (any nesting) with each floating tensor at ``dtype`` (a copy); a tensor that needs its gradient
    still does, and one tensor passed twice is still one (a trace reads the same input for both:
    ``labels=input_ids``). Other values are the same objects."""
    made: dict[int, torch.Tensor] = {}

    def planned(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == dtype:
            return value
        found = made.get(id(value))
        if found is None:
            found = value.detach().to(dtype)
            found = made[id(value)] = found.requires_grad_() if value.requires_grad else found
        return found

    return tree_map(planned, inputs)
