"""Which input sizes a ``torch.export`` split accepts: the ``dynamic_shapes`` option.

``torch.export`` fixes every input size it is not told may vary, and the split
it yields then refuses other sizes. ``dynamic_shapes`` says what may vary:

* ``None`` (default): nothing; the split runs at the example inputs' sizes.
* ``"batch"``: the first dimension of every tensor input (the batch), shared
  by all inputs. fxsplit checks that torch.export really kept it variable and
  says which input's code fixed it if not.
* ``"all"``: every dimension of every tensor input that the model lets vary
  (``Dim.AUTO``: whatever torch.export can keep symbolic).
* anything else: passed to ``torch.export.export(dynamic_shapes=...)`` as is.

Graphs traced by ``torch.fx`` carry no sizes and accept any shape, so the
option changes nothing for them. Either way the plan's byte counts (cut
sizes, activation memory) are those of the example inputs.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch
import torch.utils._pytree as pytree

from fxsplit.errors import FxsplitError, SpecError, TraceError
from fxsplit.options import DYNAMIC_SHAPES

__all__ = [
    "TRACED_INPUTS",
    "DataDependentSize",
    "check_kept_dynamic",
    "describe",
    "describe_inputs",
    "dynamic_shapes_for",
    "export_spec",
    "is_symbolic",
    "traced_size",
]


def describe(dynamic_shapes: Any) -> str | None:
    """What a plan records: the shorthand, ``"custom"`` for a torch.export spec, or None."""
    if dynamic_shapes is None:
        return None
    if isinstance(dynamic_shapes, str):
        if dynamic_shapes not in DYNAMIC_SHAPES:
            raise SpecError(
                f"dynamic_shapes must be one of {', '.join(DYNAMIC_SHAPES)}, a torch.export dynamic_shapes "
                f"spec, or None (got {dynamic_shapes!r})"
            )
        return dynamic_shapes
    return "custom"


def export_spec(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], dynamic_shapes: Any) -> Any:
    """``dynamic_shapes`` in the form torch.export takes (a shorthand expanded per input)."""
    if not isinstance(dynamic_shapes, str):
        return dynamic_shapes
    describe(dynamic_shapes)
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError) as error:
        raise TraceError(
            f"dynamic_shapes={dynamic_shapes!r}: the example inputs do not fit {type(model).__name__}.forward: {error}"
        ) from error
    spec: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            spec[name] = tuple(_leaf_specs(v, dynamic_shapes) for v in value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            spec[name] = {k: _leaf_specs(v, dynamic_shapes) for k, v in value.items()}
        else:
            spec[name] = _leaf_specs(value, dynamic_shapes)
    return spec


def _leaf_specs(value: Any, which: str) -> Any:
    def one(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            return None
        dims = range(1) if which == "batch" else range(leaf.dim())
        return {d: torch.export.Dim.AUTO for d in dims}

    return pytree.tree_map(one, value)


TRACED_INPUTS = "fxsplit_traced_inputs"
"""``graph_module.meta`` key: the inputs as traced, described before planning reads (and pins) any size."""


def describe_inputs(graph: torch.fx.Graph) -> str:
    """``input_ids: int64[any, 64], use_cache: False`` from the placeholders' example values."""
    described = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            sizes = ", ".join("any" if is_symbolic(s) else str(int(s)) for s in value.shape)
            described.append(f"{node.name}: {str(value.dtype).removeprefix('torch.')}[{sizes}]")
        elif value is not None:
            described.append(f"{node.name}: {value!r}")
    return ", ".join(described) or "no inputs"


def is_symbolic(size: Any) -> bool:
    """True for a size torch.export kept variable (a SymInt that is not pinned to one value)."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return isinstance(size, torch.SymInt) and not is_concrete_int(size)


class DataDependentSize(FxsplitError, ValueError):
    """A size that depends on the values of the data (torch.export's unbacked size): no example inputs give it a
    value. Raised where a size is read as a number; planning catches it and plans without activations (warned)."""


def traced_size(size: Any) -> int:
    """A size (or byte count) as a plain int: a symbolic one (a dynamic batch) at the example inputs' value.

    >>> traced_size(12)
    12
    """
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise DataDependentSize(
                f"the size {size} depends on the values of the data (as the tokens a router sends to each expert), "
                "so the example inputs give it no value"
            )
        return int(hint)
    return int(size)


def check_kept_dynamic(graph_module: torch.fx.GraphModule, dynamic_shapes: Any) -> None:
    """For ``"batch"``: the inputs' batch size must have stayed symbolic; say which input's did not.

    Inputs whose first size is 1 while others vary (a mask or position ids
    broadcast over the batch) may stay fixed.

    Raises:
        TraceError: naming each input whose batch size the model's code fixed.
    """
    if dynamic_shapes != "batch":
        return
    rows = []
    for node in graph_module.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            size = value.shape[0]
            symbolic = is_symbolic(size)
            rows.append((node.name, traced_size(size), symbolic))
    varying = {size for _, size, symbolic in rows if symbolic}
    if not varying:
        fixed = [(name, size) for name, size, _ in rows]
    else:
        fixed = [(name, size) for name, size, symbolic in rows if not symbolic and size in varying and size > 1]
    if not fixed:
        return
    listed = ", ".join(f"'{name}' (batch {size})" for name, size in fixed)
    why = (
        "torch.export always fixes a size of 1, so use an example batch of at least 2"
        if all(size == 1 for _, size in fixed)
        else "the model's code depends on its value (a Python branch on it, or a size used as a constant)"
    )
    raise TraceError(
        f"dynamic_shapes='batch': torch.export kept the batch size fixed for {listed}: {why}. Otherwise split "
        "without dynamic_shapes (the split then runs at that batch size only), or use trace='fx', whose graphs "
        "take any size"
    )


def dynamic_shapes_for(plan: Any, given: Any) -> Any:
    """What to trace a saved plan's model with: ``given``, else the plan's shorthand.

    Raises:
        FxsplitError: the plan was traced with a custom spec and none is given.
    """
    if given is not None:
        return given
    recorded = getattr(plan, "dynamic_shapes", None)
    if recorded == "custom":
        raise FxsplitError(
            "this plan was traced by torch.export with a custom dynamic_shapes spec; pass the same "
            "dynamic_shapes=... again so that the graph is the same"
        )
    return recorded
