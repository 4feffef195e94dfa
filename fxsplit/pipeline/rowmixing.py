"""Find the ops that mix the rows of a batch, which a pipeline's micro-batches change.

A pipeline cuts every batched input along dim 0 and runs the model once per
micro-batch, then joins the outputs along dim 0. That equals the unsplit
model only where each row of the batch is computed on its own. An op that
reduces over the batch (``h.mean(0)``, ``h - h.mean(0)``), indexes it
(``h[0]``), runs along it (``softmax(h, 0)``, ``cumsum(h, 0)``, ``cat([a, b])``
along the batch), joins rows with rows (``h @ h.T``), or reshapes it into
another dimension (``h.view(2, -1)`` of a ``[T, B]`` tensor) sees one
micro-batch's rows; so does an output that is not joined along its batch
dimension (returned as ``[T, B, ...]``, or with no batch dimension at all).

:func:`row_mixing` finds these from shapes alone: it runs the graph on fake
tensors twice, with the batch at its traced size and at twice that, and
follows the dimensions that grow. That needs a graph whose shapes follow the
batch: fx's, and torch.export's with ``dynamic_shapes="batch"`` or without
sizes written into it; one that torch.export traced with fixed shapes (a view
to literal sizes, as Hugging Face models' are) does not run at another batch
size and is not checked (None). A mean over the samples taken into a loss the model returns (a 0-dim
value) is not counted here: the pipeline averages such outputs, weighted by
rows (:mod:`fxsplit.pipeline.microbatch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from fxsplit.memory.activations import graph_tensors
from fxsplit.tracing.dynamic import traced_size
from fxsplit.tracing.example_inputs import quiet_fake_tensor_log

__all__ = ["RowMixing", "row_mixing"]


@dataclass(frozen=True)
class RowMixing:
    """One op (or output) that mixes the rows of the batch: its node's name, its module path and why."""

    node: str
    module: str
    why: str

    def __str__(self) -> str:
        where = f" (in {self.module!r})" if self.module else ""
        return f"{self.node!r}{where} {self.why}"


Shapes = list[tuple[int, ...] | None]  # a node's result, leaf by leaf: a tensor's shape, or None


def row_mixing(graph_module: torch.fx.GraphModule, whole: Collection[str] = ()) -> list[RowMixing] | None:
    """The ops and outputs of ``graph_module`` that mix the rows of the batch (dim 0 of each tensor input of its
    placeholders but those named in ``whole``, which every micro-batch gets whole), in graph order; None when
    the graph does not run at twice its traced batch (shapes fixed by torch.export, or asserted by the model).

    Example:
        >>> import torch
        >>> class Centred(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x - x.mean(0), x.softmax(-1)
        >>> gm = torch.fx.symbolic_trace(Centred())
        >>> x = torch.randn(4, 8)
        >>> next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"] = x
        >>> [str(found) for found in row_mixing(gm)]
        ["'mean' reduces over the batch dimension (or indexes it): its result does not grow with the batch"]
    """
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("val", n.meta.get("tensor_meta")) for n in placeholders]
    batched = [n.name not in whole and str(n.target) not in whole for n in placeholders]
    traced = _shapes_at(graph_module, values, batched, 1)
    doubled = _shapes_at(graph_module, values, batched, 2) if traced is not None else None
    if traced is None or doubled is None:
        return None
    grown = {name: [_grown(a, b) for a, b in zip(traced[name], doubled[name], strict=False)] for name in traced}
    found = []
    kept = _reaching_outputs(graph_module)
    for node in graph_module.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") and node in kept and node.name in grown:
            why = _module_over_batch(graph_module, node, grown) or _mixes(node, grown, traced)
            if why:
                found.append(RowMixing(node.name, _module_of(node), why))
        elif node.op == "output":
            found += _outputs_joined_wrong(node, grown, traced, {f.node for f in found})
    return found


def _shapes_at(
    graph_module: torch.fx.GraphModule, values: Sequence[Any], batched: Sequence[bool], factor: int
) -> dict[str, Shapes] | None:
    """Each node's result shapes when run on fake inputs shaped as ``values`` with dim 0 of the batched ones times
    ``factor``; None when that fails."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    run = _ShapeRun(graph_module)
    try:
        with mode:  # fake copies of the weights: an update in place (a counter, running stats) never reaches them
            inputs = [
                pytree.tree_map(lambda v, b=b: _fake(v, factor if b else 1), value)
                for value, b in zip(values, batched, strict=True)
            ]
            state = _empty_like_each(graph_tensors(graph_module))
        with (
            mode,
            torch.no_grad(),
            quiet_fake_tensor_log(),
            _reparametrize_module(graph_module, state, tie_weights=True, strict=False),
        ):
            run.run(*inputs)
    except Exception:  # noqa: BLE001 (a graph that cannot run at this batch size is not checked)
        return None
    return run.shapes


def _empty_like_each(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Name -> an empty tensor (fake, made inside the mode) like each weight, one per tensor object (a tied one under
    each of its names); on the CPU for weights on meta, whose shapes are all the check needs."""
    made: dict[int, torch.Tensor] = {}
    for _, tensor in named:
        if id(tensor) not in made:
            device = "cpu" if tensor.device.type in ("cpu", "meta") else tensor.device
            made[id(tensor)] = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    return {name: made[id(tensor)] for name, tensor in named}


def _fake(value: Any, factor: int) -> Any:
    """An empty tensor (fake, made inside the mode) like the placeholder's ``value``, dim 0 times ``factor``."""
    if isinstance(value, torch.Tensor) or type(value).__name__ == "TensorMetadata":
        shape = [traced_size(size) for size in value.shape]
        if shape and factor != 1:
            shape[0] *= factor
        device = getattr(value, "device", torch.device("cpu"))
        if device.type in ("meta", "cpu"):  # cpu:1 is the CPU: the weights' fake copies say "cpu"
            device = torch.device("cpu")
        return torch.empty(shape, dtype=value.dtype, device=device)
    return value


class _ShapeRun(torch.fx.Interpreter):
    def __init__(self, graph_module: torch.fx.GraphModule) -> None:
        super().__init__(graph_module, garbage_collect_values=True)
        self.shapes: dict[str, Shapes] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "call_module" and str(n.target).startswith("_guards"):  # torch.export's input check
            return None
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            args, kwargs = pytree.tree_map(_the_cpu, (args, kwargs))  # one CPU: fake tensors keep "cpu:1"'s index
            result = getattr(self, n.op)(n.target, args, kwargs)
        leaves = _leaves(result)
        self.shapes[n.name] = [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        return result


def _the_cpu(value: Any) -> Any:
    """``"cpu:1"`` (a logical device, as a string or a ``torch.device``) as ``"cpu"``."""
    if isinstance(value, torch.device) and value.type == "cpu":
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cpu:"):
        return "cpu"
    return value


def _leaves(value: Any) -> list[Any]:
    return list(pytree.tree_leaves(value))


RANK_CHANGED = (-1,)  # a tensor whose rank differs between the two batch sizes (``squeeze()`` of one row)


def _grown(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The dimensions that grew with the batch (None: not a tensor; :data:`RANK_CHANGED`: not the same rank)."""
    if a is None or b is None:
        return None
    if len(a) != len(b):
        return RANK_CHANGED
    return tuple(d for d in range(len(a)) if a[d] != b[d])


def _reaching_outputs(graph_module: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes some output is computed from (an op whose result the model drops mixes nothing it returns)."""
    output = next(n for n in reversed(graph_module.graph.nodes) if n.op == "output")
    seen: set[torch.fx.Node] = set()
    stack = list(output.all_input_nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _mixes(node: torch.fx.Node, grown: dict[str, list[Any]], traced: dict[str, Shapes]) -> str:
    """Why ``node`` mixes the rows of the batch, or ""."""
    inputs = [(i, dims) for i in node.all_input_nodes for dims in grown.get(i.name, ()) if dims]
    if not inputs or any(dims == RANK_CHANGED for _, dims in inputs):  # the op that changed the rank is named
        return ""
    results = [dims for dims in grown[node.name] if dims is not None]
    if RANK_CHANGED in results:
        return (
            "changes its result's number of dimensions with the batch size (a squeeze() of a micro-batch of one "
            "row drops the batch dimension): squeeze the dimensions it means by number"
        )
    if any(len(dims) > 1 for dims in results) and all(len(dims) == 1 for _, dims in inputs):
        return "joins rows of the batch with each other: its result grows with the batch in two dimensions"
    if results and not any(results) and not _scalar_tail(node, traced):
        return "reduces over the batch dimension (or indexes it): its result does not grow with the batch"
    along = _dim_along_batch(node, inputs, traced)
    if along:
        return along
    return _reshaped_across(node, inputs, grown, traced)


def _scalar_tail(node: torch.fx.Node, traced: dict[str, Shapes]) -> bool:
    """Whether ``node``'s result is 0-dim and so is everything computed from it up to the outputs (a loss the model
    returns: the pipeline averages it over the micro-batches)."""
    stack, seen = [node], set()
    while stack:
        here = stack.pop()
        if here.op == "output":
            continue
        if here in seen:
            continue
        seen.add(here)
        shapes = [s for s in traced.get(here.name, [None]) if s is not None]
        if any(len(s) > 0 for s in shapes):
            return False
        stack.extend(here.users)
    return True


_ALONG_DIM = {  # ops that run along one dimension -> the name of their dim argument
    "softmax": "dim",
    "log_softmax": "dim",
    "_softmax": "dim",
    "_log_softmax": "dim",
    "cumsum": "dim",
    "cumprod": "dim",
    "logcumsumexp": "dim",
    "cummax": "dim",
    "cummin": "dim",
    "sort": "dim",
    "argsort": "dim",
    "flip": "dims",
    "roll": "dims",
    "cat": "dim",
    "concat": "dim",
    "concatenate": "dim",
    "diff": "dim",
}
_POSITION = {"flip": 1, "roll": 2, "cat": 1, "concat": 1, "concatenate": 1}  # the dim argument's place (else 1)
_DEFAULT_DIM = {"cat": 0, "concat": 0, "concatenate": 0, "diff": -1, "sort": -1, "argsort": -1}


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", "")


def _dim_along_batch(node: torch.fx.Node, inputs: list[tuple[torch.fx.Node, tuple[int, ...]]], traced: Any) -> str:
    """An op that runs along the batch dimension (softmax, cumsum, sort, flip, cat ...), or an attention or a
    recurrent module over it."""
    if node.op == "call_module":
        return ""  # see _module_over_batch
    name = _op_name(node)
    if name == "scaled_dot_product_attention":
        first, dims = inputs[0]
        rank = len(traced[first.name][0] or ())
        if dims and dims[0] >= rank - 2:
            return "attends over the batch dimension: the batch is in the sequence or feature dimension of q, k, v"
        return ""
    key = _ALONG_DIM.get(name)
    if key is None:
        return ""
    value = node.kwargs.get(key, node.args[_POSITION.get(name, 1)] if len(node.args) > _POSITION.get(name, 1) else None)
    if value is None:
        value = _DEFAULT_DIM.get(name)
    if value is None:
        return ""
    wanted = {v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int)}
    for source, dims in inputs:
        rank = len(traced[source.name][0] or ())
        if rank and {d % rank for d in wanted} & set(dims):
            return f"runs along the batch dimension ({name} over dim {dims[0]})"
    return ""


_RESHAPES = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as", "reshape_as"}


def _reshaped_across(
    node: torch.fx.Node,
    inputs: list[tuple[torch.fx.Node, tuple[int, ...]]],
    grown: dict[str, list[Any]],
    traced: dict[str, Shapes],
) -> str:
    """A reshape that moves the batch under another dimension (``[T, B] -> [T * B]`` or ``[B, C] -> [2, B * C / 2]``):
    the dimensions before the batch must keep their product, or the rows of micro-batches interleave differently."""
    if _op_name(node) not in _RESHAPES and node.target not in (torch.reshape, torch.flatten):
        return ""
    if node.op == "call_module":
        return ""
    source, dims = inputs[0]
    before = traced[source.name][0]
    after = traced[node.name][0] if traced[node.name] else None
    result = grown[node.name][0] if grown[node.name] else None
    if before is None or after is None or not result:
        return ""
    if math.prod(before[: dims[0]]) != math.prod(after[: result[0]]):
        return "reshapes the batch dimension into another one, so the rows of micro-batches land elsewhere"
    return ""


def _module_over_batch(graph_module: torch.fx.GraphModule, node: torch.fx.Node, grown: dict[str, list[Any]]) -> str:
    """A module with a ``batch_first`` setting (``nn.LSTM``, ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``)
    whose first input grows with the batch in its sequence dimension: it runs over the batch as over a sequence."""
    if node.op != "call_module" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return ""
    module = graph_module.get_submodule(str(node.target))
    batch_first = getattr(module, "batch_first", None)
    dims = grown.get(node.args[0].name, [None])[0]
    if not isinstance(batch_first, bool) or not dims or dims == RANK_CHANGED:
        return ""
    expected = 0 if batch_first else 1
    if dims[0] != expected:
        return (
            f"runs over dim {dims[0]} as its sequence, which grows with the batch "
            f"({type(module).__name__} with batch_first={batch_first} takes its batch in dim {expected})"
        )
    return ""


def _module_of(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(next(reversed(stack.values()))[0])
    return str(node.target) if node.op == "call_module" else ""


def _outputs_joined_wrong(
    node: torch.fx.Node, grown: dict[str, list[Any]], traced: dict[str, Shapes], reported: Collection[str]
) -> list[RowMixing]:
    """Outputs the pipeline joins along dim 0 whose batch is elsewhere, or which have none (each micro-batch's
    copy joined to the others: ``chunks`` times as many rows). 0-dim ones are averaged instead."""
    found = []
    for leaf in _leaves(node.args[0]):
        if not isinstance(leaf, torch.fx.Node) or leaf.name in reported or len(grown.get(leaf.name, ())) != 1:
            continue
        dims, shape = grown[leaf.name][0], traced[leaf.name][0]
        if dims is None or shape is None or not shape or dims in ((0,), RANK_CHANGED):
            continue
        if dims:
            why = f"is returned with its batch in dim {dims[0]}, but micro-batches' outputs are joined along dim 0"
        else:
            why = "is returned without a batch dimension, but micro-batches' outputs are joined along dim 0"
        found.append(RowMixing(leaf.name, _module_of(leaf), why))
    return found
