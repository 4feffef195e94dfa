"""The memory model a plan is charged by, from a traced graph: :func:`memory_model` (and the warning when
activations cannot be counted)."""

from __future__ import annotations

import warnings

import torch
import torch.fx

from fxsplit.attrpath import attr_at
from fxsplit.callsite import user_stacklevel
from fxsplit.cost.build import GraphCosts
from fxsplit.cost.walk import named_tensors
from fxsplit.errors import FxsplitWarning
from fxsplit.gcpause import gc_paused
from fxsplit.memory.activations import profile_activations
from fxsplit.memory.model import MemoryModel, MemorySpec
from fxsplit.tracing.capture import Traced
from fxsplit.tracing.dynamic import DataDependentSize
from fxsplit.tracing.rowsplit import row_shards

__all__ = ["memory_model"]


@gc_paused()
def memory_model(
    spec: MemorySpec, traced: Traced, costs: GraphCosts, model: torch.nn.Module, dtype: torch.dtype | None = None
) -> tuple[MemoryModel, str | None]:
    """What the plan charges: trainable parameters and, with shapes, the activation profile.

    Also why the activations are not counted where ``spec`` counts them (warned), else None.
    """
    trainable = _trainable(costs, model, traced.graph_module) if spec.training else {}  # only training charges them
    profile, uncounted, data_sized = None, None, False
    if spec.counts_activations and not traced.has_shapes:
        uncounted = traced.shapes_missing or "the traced graph has no sizes"
    elif spec.counts_activations:
        try:
            profile = profile_activations(traced.graph_module, costs, training=spec.training, dtype=dtype)
        except Exception as error:  # noqa: BLE001 - fake execution of any graph can raise anything
            first = (str(error).strip().splitlines() or [""])[0]
            uncounted = f"profiling them on fake tensors failed ({type(error).__name__}: {first})"
            data_sized = isinstance(error, DataDependentSize)  # no other example inputs would size it
        if profile is None and uncounted is None:
            uncounted = _inputs_without_values(traced.graph_module)
    if uncounted is not None:
        fix = "" if data_sized else " or pass example_inputs the model runs on"
        warnings.warn(
            FxsplitWarning(
                f"activations not counted: {uncounted}; this plan charges parameters and buffers{_also(spec)} but no "
                f"activations (nor cut sizes, where the graph has no sizes), although mode={spec.mode!r} counts them: "
                f"leave room for them in the budgets{fix} (mode='weights' plans without activations and without this "
                "warning)"
            ),
            stacklevel=user_stacklevel(),
        )
    return MemoryModel(spec, costs, trainable, profile), uncounted


def _trainable(costs: GraphCosts, model: torch.nn.Module, graph_module: torch.fx.GraphModule) -> dict[str, int]:
    """Canonical name -> element count of each parameter the graph reads that requires a gradient (the model's,
    and the row parameters of split ops: :mod:`fxsplit.tracing.rowsplit`)."""
    named = {name: tensor for name, tensor, is_buffer in named_tensors(model) if not is_buffer}
    named.update((path, attr_at(graph_module, path)) for path in row_shards(graph_module))
    return {
        w.names[0]: named[w.names[0]].numel()
        for w in costs.weights
        if w.names[0] in named and named[w.names[0]].requires_grad
    }


def _inputs_without_values(graph_module: torch.fx.GraphModule) -> str:
    unknown = [n.name for n in graph_module.graph.nodes if n.op == "placeholder" and "val" not in n.meta]
    return (
        f"no example value recorded for input(s) {', '.join(unknown) or '?'} (fake shape propagation "
        "records tensors and numbers only)"
    )


def _also(spec: MemorySpec) -> str:
    return ", gradients and optimizer state" if spec.training else ""
