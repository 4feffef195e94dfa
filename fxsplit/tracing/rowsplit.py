"""Split a linear op by the rows of its weight, so that pipeline stages can each compute some of its outputs.

A linear op ``y = x @ W.T + b`` with ``W`` of ``R`` rows (output features) is
the same as ``cat([x @ W[a:b].T + b[a:b] for each row range], dim=-1)``. One
such op can be the slowest part of a pipeline: GPT-2's tied LM head (50,257
rows) takes about five of its blocks' time, more than a stage of four.
:func:`split_rows` rewrites the op, in the traced graph (never the user's
model), into one op per row range and a ``cat`` that keeps the op's name, so
every reader of the op is unchanged. Each range's rows of ``W`` (and ``b``)
become a parameter of their own, under ``_fxsplit_rows`` in the graph module,
that *shares the storage* of the model's weight: a stage run in its own
process holds only its rows, and its optimizer step writes them in place.

Those parameters are leaves of their own, so autograd gives each its own
gradient: the model's ``W.grad`` does not get it. Only
:func:`fxsplit.pipeline_stages`, whose ``reduce_tied_grads`` sums the row
gradients with any other holder of ``W`` (a tied input embedding), runs such a
graph; a split run in one process refuses a plan with row splits.

Piece ``k`` of op ``linear`` is the node ``linear_rows{k}`` reading
``_fxsplit_rows.linear_rows{k}_weight`` (and ``..._bias``): the names depend
only on the op and its row bounds, so a plan that records them
(:attr:`Plan.row_splits <fxsplit.planning.plan.Plan.row_splits>`) can be
applied to a fresh trace.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from fxsplit.attrpath import attr_at

__all__ = [
    "ROWS_MODULE",
    "LinearOp",
    "RowParameters",
    "RowShard",
    "covered_sources",
    "linear_op",
    "row_shards",
    "row_splits_of",
    "split_rows",
    "splittable_ops",
]

ROWS_MODULE = "_fxsplit_rows"  # the graph module's child that holds the row parameters
_FUNCTIONS = (torch._C._nn.linear, torch.nn.functional.linear)


@dataclass(frozen=True)
class LinearOp:
    """A linear op whose weight (and bias) the graph reads from the model.

    Attributes:
        node: the op.
        inputs: the node it multiplies.
        weight: graph path of its 2-D weight (a parameter).
        bias: graph path of its bias, or None.
        rows: the weight's rows: the op's output features.
    """

    node: torch.fx.Node
    inputs: torch.fx.Node
    weight: str
    bias: str | None
    rows: int


@dataclass(frozen=True)
class RowShard:
    """One row parameter made by :func:`split_rows`: rows ``start:stop`` of the model's tensor at ``source``."""

    source: str
    start: int
    stop: int


class RowParameters(torch.nn.Module):
    """The graph module's ``_fxsplit_rows``: the row parameters, what rows each holds, and the ops split."""

    def __init__(self) -> None:
        super().__init__()
        self.shards: dict[str, RowShard] = {}  # graph path of a row parameter -> where its rows come from
        self.splits: dict[str, tuple[int, ...]] = {}  # op name -> its row bounds


def _holder(graph_module: torch.fx.GraphModule) -> RowParameters | None:
    holder = getattr(graph_module, ROWS_MODULE, None)
    return holder if isinstance(holder, RowParameters) else None


def linear_op(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> LinearOp | None:
    """``node`` as a :class:`LinearOp`, or None when it is not one whose rows can be split.

    That is ``aten.linear``, ``F.linear`` or an ``nn.Linear`` module call, with a 2-D
    weight parameter (and a bias parameter, if any) that the graph reads from the
    model, and a tensor input.
    """
    bias: str | None
    if node.op == "call_module":
        module = attr_at(graph_module, str(node.target), None)
        if type(module) is not torch.nn.Linear or len(node.args) != 1 or node.kwargs:
            return None
        source, weight = node.args[0], f"{node.target}.weight"
        bias = f"{node.target}.bias" if module.bias is not None else None
    elif node.op == "call_function" and (node.target is torch.ops.aten.linear.default or node.target in _FUNCTIONS):
        names = ("input", "weight", "bias")
        given = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
        if set(given) - set(names) or "weight" not in given:
            return None
        source = given["input"]
        read, bias = _read_path(given["weight"]), _read_path(given.get("bias"))
        if read is None or (given.get("bias") is not None and bias is None):
            return None
        weight = read
    else:
        return None
    if not isinstance(source, torch.fx.Node):
        return None
    tensor = attr_at(graph_module, weight, None)
    extra = attr_at(graph_module, bias, None) if bias is not None else None
    if not isinstance(tensor, torch.nn.Parameter) or tensor.dim() != 2 or tensor.shape[0] < 2:
        return None
    if bias is not None and (not isinstance(extra, torch.nn.Parameter) or extra.shape != tensor.shape[:1]):
        return None
    return LinearOp(node, source, weight, bias, int(tensor.shape[0]))


def _read_path(value: Any) -> str | None:
    """The graph path a ``get_attr`` node reads, or None for anything else."""
    if isinstance(value, torch.fx.Node) and value.op == "get_attr":
        return str(value.target)
    return None


def splittable_ops(graph_module: torch.fx.GraphModule) -> dict[str, LinearOp]:
    """Node name -> :class:`LinearOp`, for every op of the graph whose rows :func:`split_rows` can split."""
    found = {}
    for node in graph_module.graph.nodes:
        if node.op in ("call_function", "call_module") and (op := linear_op(graph_module, node)) is not None:
            found[node.name] = op
    return found


def row_shards(graph_module: torch.fx.GraphModule) -> dict[str, RowShard]:
    """Graph path of each row parameter :func:`split_rows` made -> where its rows come from (empty: none)."""
    holder = _holder(graph_module)
    return dict(holder.shards) if holder is not None else {}


def covered_sources(graph_module: torch.fx.GraphModule) -> dict[int, str]:
    """``id()`` of each tensor whose every row some row parameter holds -> the graph path of its first rows'.

    Such a tensor takes no memory of its own once split: its storage is its row parameters'.
    """
    pieces: dict[str, list[tuple[int, int, str]]] = {}
    for path, shard in row_shards(graph_module).items():
        pieces.setdefault(shard.source, []).append((shard.start, shard.stop, path))
    found = {}
    for source, ranges in pieces.items():
        ranges.sort()
        tensor = attr_at(graph_module, source)
        whole = ranges[0][0] == 0 and ranges[-1][1] == tensor.shape[0]
        if whole and all(a[1] == b[0] for a, b in itertools.pairwise(ranges)):
            found[id(tensor)] = ranges[0][2]
    return found


def row_splits_of(graph_module: torch.fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """Op name -> row bounds, for each op :func:`split_rows` split in ``graph_module`` (empty: none)."""
    holder = _holder(graph_module)
    return dict(holder.splits) if holder is not None else {}


def split_rows(graph_module: torch.fx.GraphModule, splits: Mapping[str, Sequence[int]]) -> Callable[[], None]:
    """Rewrite each op named in ``splits`` into one linear op per row range, in place; returns the undo.

    Args:
        graph_module: the traced graph (fxsplit's own; the model is not changed).
        splits: op name -> row bounds ``(0, b1, ..., rows)``, strictly increasing: piece ``k`` computes the
            outputs ``b_k:b_{k+1}``.

    Raises:
        ValueError: an op is not in the graph or not a splittable linear op, or its bounds are not
            ``0 < b1 < ... < rows``; the graph is left as it was.
    """
    graph = graph_module.graph
    by_name = {node.name: node for node in graph.nodes}
    found: list[tuple[LinearOp, tuple[int, ...]]] = []
    for name, bounds in splits.items():
        op = linear_op(graph_module, by_name[name]) if name in by_name else None
        if op is None:
            raise ValueError(f"op {name!r} is not a linear op of the graph whose weight rows can be split")
        bounds = tuple(int(b) for b in bounds)
        if len(bounds) < 3 or bounds[0] != 0 or bounds[-1] != op.rows or any(map(operator.ge, bounds, bounds[1:])):
            raise ValueError(
                f"the row bounds of {name!r} must rise from 0 to its {op.rows} rows in at least two steps "
                f"(got {list(bounds)})"
            )
        found.append((op, bounds))
    if not found:
        return lambda: None
    taken = set(by_name) | set(getattr(getattr(graph, "_graph_namespace", None), "_used_names", ()))
    clash = sorted(name for op, bounds in found for name in _piece_names(op, len(bounds) - 1) if name in taken)
    if clash:
        raise ValueError(f"the graph already has nodes named {clash}, which the row pieces must be named")
    holder = _holder(graph_module)
    if holder is None:
        holder = RowParameters()
        graph_module.add_submodule(ROWS_MODULE, holder)
    undos = [_split_one(graph_module, holder, op, bounds) for op, bounds in found]
    holder.splits.update((op.node.name, bounds) for op, bounds in found)
    graph_module.recompile()

    def undo() -> None:
        for step in reversed(undos):
            step()
        for op, _ in found:
            del holder.splits[op.node.name]
        if not holder.splits:
            delattr(graph_module, ROWS_MODULE)
        graph_module.recompile()

    return undo


def _split_one(
    graph_module: torch.fx.GraphModule, holder: RowParameters, op: LinearOp, bounds: tuple[int, ...]
) -> Callable[[], None]:
    graph, node = graph_module.graph, op.node
    aten = isinstance(node.target, torch._ops.OpOverload) or node.op == "call_module" and _aten_graph(graph)
    linear = torch.ops.aten.linear.default if aten else torch.nn.functional.linear
    weight = attr_at(graph_module, op.weight)
    bias = attr_at(graph_module, op.bias) if op.bias is not None else None
    meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
    if node.op == "call_module" and "nn_module_stack" not in meta:
        meta["nn_module_stack"] = {str(node.target): (str(node.target), type(attr_at(graph_module, str(node.target))))}
    mode = getattr(op.inputs.meta.get("val"), "fake_mode", None)  # shapes, when the trace recorded them
    made: list[tuple[str, torch.fx.Node]] = []
    pieces = []
    with graph.inserting_before(node):
        for k, (start, stop) in enumerate(itertools.pairwise(bounds)):
            name = f"{node.name}_rows{k}"
            args = [op.inputs, _shard(graph_module, holder, (f"{name}_weight", weight, op.weight), (start, stop), mode)]
            if bias is not None:
                assert op.bias is not None
                args.append(_shard(graph_module, holder, (f"{name}_bias", bias, op.bias), (start, stop), mode))
            made.extend((str(a.target).rpartition(".")[2], a) for a in args[1:])
            piece = _named(graph.create_node("call_function", linear, tuple(args), name=name), name)
            piece.meta.update(meta)
            _fake_value(piece, linear, [a.meta.get("val") for a in args])
            pieces.append(piece)
    old = (node.op, node.target, node.args, node.kwargs, dict(node.meta))
    node.op, node.target = "call_function", torch.ops.aten.cat.default if aten else torch.cat
    node.args, node.kwargs = (pieces, -1), {}
    node.meta.update(meta)

    def undo() -> None:
        node.op, node.target, node.args, node.kwargs = old[:4]
        node.meta.clear()
        node.meta.update(old[4])
        for piece in reversed(pieces):
            _erase(graph, piece)
        for attribute, reader in reversed(made):
            _erase(graph, reader)
            delattr(holder, attribute)
            del holder.shards[f"{ROWS_MODULE}.{attribute}"]

    return undo


def _piece_names(op: LinearOp, pieces: int) -> list[str]:
    """The names of the nodes :func:`split_rows` makes for ``op`` in ``pieces`` pieces."""
    kinds = ("", "_weight", "_bias") if op.bias is not None else ("", "_weight")
    return [f"{op.node.name}_rows{k}{kind}" for k in range(pieces) for kind in kinds]


def _named(node: torch.fx.Node, name: str) -> torch.fx.Node:
    """``node``, which must have got ``name``: a plan names the pieces, and a fresh trace must name them alike."""
    if node.name != name:
        raise ValueError(f"the graph already has a node named {name!r}, which a row piece must be named")
    return node


def _erase(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and free its name (torch.fx keeps erased names taken), so that splitting the op again, with
    other bounds, names its pieces as a fresh trace would."""
    graph.erase_node(node)
    used = getattr(getattr(graph, "_graph_namespace", None), "_used_names", None)
    if isinstance(used, set):
        used.discard(node.name)


def _aten_graph(graph: torch.fx.Graph) -> bool:
    return any(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes if n.op == "call_function")


def _shard(
    graph_module: torch.fx.GraphModule,
    holder: RowParameters,
    what: tuple[str, torch.Tensor, str],
    rows: tuple[int, int],
    mode: Any,
) -> torch.fx.Node:
    """A parameter over rows ``start:stop`` of ``tensor`` (its storage, not a copy), read by a new get_attr node
    (``what``: the parameter's name under :data:`ROWS_MODULE`, the tensor, its graph path)."""
    attribute, tensor, source = what
    start, stop = rows
    shard = torch.nn.Parameter(tensor.detach()[start:stop], requires_grad=tensor.requires_grad)
    holder.register_parameter(attribute, shard)
    path = f"{ROWS_MODULE}.{attribute}"
    holder.shards[path] = RowShard(source, start, stop)
    reader = _named(graph_module.graph.create_node("get_attr", path, name=attribute), attribute)
    if mode is not None:
        reader.meta["val"] = mode.from_tensor(shard, static_shapes=True)
    return reader


def _fake_value(node: torch.fx.Node, function: Any, args: list[Any]) -> None:
    """``node.meta["val"]``: ``function`` run on the fake values of its arguments (nothing when one has none)."""
    mode = getattr(args[0], "fake_mode", None)
    if mode is None or any(a is None for a in args):
        return
    with mode:
        node.meta["val"] = function(*args)
