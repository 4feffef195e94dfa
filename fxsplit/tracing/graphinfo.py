"""Facts about FX nodes that the cost model and the code generator share.

What kind of value a node holds (tensor, not a tensor, unknown), how many
bytes it is, which module it belongs to, and which of its inputs it mutates.
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.fx

from fxsplit.attrpath import attr_at
from fxsplit.tracing.customgrad import FUNCTION_RESULT
from fxsplit.tracing.gradmode import is_mode_node
from fxsplit.tracing.nnmodules import TENSOR_MODULES
from fxsplit.tracing.viewops import VIEW_ATTRS, VIEW_FUNCTIONS, VIEW_METHODS

__all__ = [
    "NONTENSOR",
    "TENSOR",
    "UNKNOWN",
    "alias_root",
    "is_guard",
    "element_size",
    "input_writers",
    "module_path",
    "mutated_inputs",
    "tensor_origin",
    "value_bytes",
    "value_kind",
]

TENSOR, NONTENSOR, UNKNOWN = "tensor", "nontensor", "unknown"

_NONTENSOR_METHODS = frozenset(
    {
        "size",
        "dim",
        "numel",
        "ndimension",
        "nelement",
        "element_size",
        "item",
        "tolist",
        "stride",
        "is_contiguous",
        "data_ptr",
        "get_device",
        "is_floating_point",
        "__len__",
    }
)
_NONTENSOR_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "is_sparse"})
_STAT_OPS = ("batch_norm", "instance_norm")


def _tensors_in(value: Any) -> Iterator[Any]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


def _meta_value(node: torch.fx.Node) -> Any:
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("tensor_meta")


def value_kind(node: torch.fx.Node) -> str:
    """TENSOR for a plain tensor, NONTENSOR for data with no tensor inside, else UNKNOWN."""
    if "val" in node.meta or "tensor_meta" in node.meta:
        value = _meta_value(node)
        if isinstance(value, torch.Tensor) or type(value).__name__ == "TensorMetadata":
            return TENSOR
        return UNKNOWN if any(True for _ in _tensors_in(value)) else NONTENSOR
    if node.op == "call_module" and _returns_one_tensor(node):
        return TENSOR
    if node.op == "call_method" and node.target in _NONTENSOR_METHODS:
        return NONTENSOR
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        if node.args[1] in _NONTENSOR_ATTRS:
            return NONTENSOR
    if node.op == "call_function" and (node.target is len or is_mode_node(node)):
        return NONTENSOR
    if node.op in ("call_function", "call_method") and node.all_input_nodes:
        if all(value_kind(n) == NONTENSOR for n in node.all_input_nodes):
            return NONTENSOR
    return UNKNOWN


def _returns_one_tensor(node: torch.fx.Node) -> bool:
    """True for leaf modules from torch.nn whose forward returns a single tensor."""
    root = node.graph.owning_module
    if root is None:
        return False
    try:
        module = root.get_submodule(str(node.target))
    except AttributeError:
        return False
    return (
        type(module).forward is not None
        and isinstance(module, TENSOR_MODULES)
        and (type(module).__module__.startswith("torch.nn."))
    )


def value_bytes(node: torch.fx.Node, *, float_dtype: torch.dtype | None = None) -> int | None:
    """Bytes of the tensors the node's value holds, or None when shapes are unknown.

    With ``float_dtype``, floating-point tensors count as if they had that
    dtype (planning a float32 model as if cast to bfloat16).
    """
    if "val" not in node.meta and "tensor_meta" not in node.meta:
        return None
    value = _meta_value(node)
    if type(value).__name__ == "TensorMetadata":
        numel = _numel(value.shape)
        return None if numel is None else numel * element_size(value.dtype, float_dtype)
    total = 0
    for tensor in _tensors_in(value):
        numel = _numel(tensor.shape)
        if numel is None:
            return None
        total += numel * element_size(tensor.dtype, float_dtype)
    return total


def element_size(dtype: torch.dtype, float_dtype: torch.dtype | None = None) -> int:
    """Bytes per element of ``dtype``, or of ``float_dtype`` when given and ``dtype`` is floating."""
    if float_dtype is not None and dtype.is_floating_point:
        dtype = float_dtype
    return dtype.itemsize


def _numel(shape: Any) -> Any:
    count = 1
    for dim in shape:
        try:
            count *= int(dim)
        except Exception:  # noqa: BLE001 - an unbacked symbolic size
            return None
    return count


def is_guard(node: torch.fx.Node) -> bool:
    """True for torch.export's input-checking call (``_guards_fn``): no compute, no placement.

    It reads the inputs as the caller passed them, so it never causes a copy.
    """
    return node.op == "call_module" and str(node.target).startswith("_guards")


def module_path(node: torch.fx.Node) -> str:
    """Qualified name of the module the node belongs to ('' for the root)."""
    if node.op == "call_module":
        target = str(node.target)
        return "" if target.startswith("_guards") else target
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = str(next(reversed(stack.values()))[0])
        # torch.export's placeholder for nodes it made outside any module (a dynamic size's check): no module
        return "" if path.startswith("_empty_nn_module_stack") else path
    return ""


def mutated_inputs(node: torch.fx.Node, modules: Mapping[str, torch.nn.Module]) -> list[torch.fx.Node]:
    """Input nodes that ``node`` writes to in place."""
    mutated: list[torch.fx.Node] = []
    op, target = node.op, node.target
    if op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator):
        return _subgraph_writes(node, modules)
    if op == "call_function" and isinstance(target, torch._ops.OpOverload):
        positions, stat = _schema_writes(target)
        args = node.args
        for index, name in positions:
            value = args[index] if index < len(args) else node.kwargs.get(name)
            if isinstance(value, torch.fx.Node):
                mutated.append(value)
        if stat:
            mutated.extend(n for n in node.all_input_nodes if n.op == "get_attr")
        return mutated
    out = node.kwargs.get("out")
    if out is not None:
        mutated.extend(n for n in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(n, torch.fx.Node))
    first = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if op == "call_method" and isinstance(target, str):
        if (_is_inplace_name(target) or target == "__setitem__") and first is not None:
            mutated.append(first)
    elif op == "call_function":
        name = getattr(target, "__name__", "")
        if (_is_inplace_name(name) or _inplace_by_argument(node)) and first is not None:
            mutated.append(first)
        kept = node.meta.get(FUNCTION_RESULT)  # a custom Function that wrote an argument (ctx.mark_dirty)
        if kept is not None and kept[0] == "write":
            mutated.append(kept[1])
        if target is operator.setitem and first is not None:
            mutated.append(first)
        if _is_stat(name):
            mutated.extend(n for n in node.all_input_nodes if n.op == "get_attr")
    elif op == "call_module" and first is not None and _inplace_flag(modules.get(str(target))):
        mutated.append(first)
    return mutated


@functools.cache
def _schema_writes(target: torch._ops.OpOverload) -> tuple[tuple[tuple[int, str], ...], bool]:
    """``((position, name) of each argument an ATen op writes, whether it updates running statistics)``."""
    schema = target._schema
    writes = tuple(
        (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )
    return writes, _is_stat(schema.name.split("::")[-1])


@functools.cache
def _is_stat(name: str) -> bool:
    return any(stat in name for stat in _STAT_OPS)


def _inplace_by_argument(node: torch.fx.Node, modules: Mapping[str, torch.nn.Module] | None = None) -> bool:
    """Whether ``node`` is an op made in-place by an argument: ``F.relu(x, inplace=True)`` (keyword or
    positional) or a module built with ``inplace=True`` (``nn.ReLU(inplace=True)``). Such an op writes its
    first argument and returns it."""
    if node.op == "call_module":
        if modules is None:  # one module by its path, not a table of all of them per call (quadratic over a graph)
            return _inplace_flag(attr_at(node.graph.owning_module, str(node.target), None))
        return _inplace_flag(modules.get(str(node.target)))
    if node.op != "call_function" or isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.kwargs.get("inplace") is True:
        return True
    try:
        position = _inplace_position(node.target)
    except TypeError:  # an unhashable callable
        position = None
    return position is not None and len(node.args) > position and node.args[position] is True


def _inplace_flag(module: object) -> bool:
    """``getattr(module, "inplace", False) is True`` without nn.Module's slow miss (see :func:`_plain_lookup`)."""
    kind: type = type(module)
    if module is not None and _plain_lookup(kind):
        return vars(module).get("inplace", False) is True
    return getattr(module, "inplace", False) is True


@functools.cache
def _plain_lookup(kind: type) -> bool:
    """Whether ``kind`` reads attributes as nn.Module does, with no ``inplace`` of its own (so only ``__dict__``)."""
    plain = getattr(kind, "__getattr__", None) is torch.nn.Module.__getattr__ and not hasattr(kind, "inplace")
    return plain and issubclass(kind, torch.nn.Module) and kind.__getattribute__ is object.__getattribute__


@functools.cache
def _inplace_position(function: Callable[..., Any]) -> int | None:
    """The position of a Python function's ``inplace`` parameter, if it has one (``F.relu(x, True)``)."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # builtins without a signature
        return None
    return parameters.index("inplace") if "inplace" in parameters else None


def _subgraph_writes(node: torch.fx.Node, modules: Mapping[str, torch.nn.Module]) -> list[torch.fx.Node]:
    """The operands a higher-order op's subgraph writes (export's ``wrap_with_set_grad_enabled(False, g, *xs)``).

    The operands follow the subgraph argument and feed its placeholders in order.
    """
    for position, arg in enumerate(node.args):
        graph_module = modules.get(str(arg.target)) if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" else None
        if isinstance(graph_module, torch.fx.GraphModule):
            operands = node.args[position + 1 :]
            inner = dict(graph_module.named_modules())
            placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
            written = {alias_root(t) for n in graph_module.graph.nodes for t in mutated_inputs(n, inner)}
            return [
                value
                for p, value in zip(placeholders, operands, strict=False)
                if p in written and isinstance(value, torch.fx.Node)
            ]
    return []


def _is_inplace_name(name: str) -> bool:
    """``add_``, ``copy_``: torch's naming of in-place ops (not ``__iadd__``-style dunders)."""
    return name.endswith("_") and not name.endswith("__")


def input_writers(graph: torch.fx.Graph, modules: Mapping[str, torch.nn.Module]) -> dict[str, list[str]]:
    """Input (placeholder) name -> the nodes that write it in place, directly or through views, in order."""
    found: dict[str, list[str]] = {}
    for node in graph.nodes:
        for target in mutated_inputs(node, modules):
            root = alias_root(target)
            if root.op == "placeholder" and node.name not in found.get(root.name, ()):
                found.setdefault(root.name, []).append(node.name)
    return found


def alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """Follow view ops back to the node whose storage ``node`` shares."""
    return _followed(node, _view_base)


def _followed(node: torch.fx.Node, step: Callable[[torch.fx.Node], torch.fx.Node | None]) -> torch.fx.Node:
    """``node``, then ``step`` of it, and so on, to the last node ``step`` finds."""
    while (base := step(node)) is not None:
        node = base
    return node


def _view_base(node: torch.fx.Node) -> torch.fx.Node | None:
    if node.op == "call_function" and FUNCTION_RESULT in node.meta:  # a custom Function returned an argument's memory
        return node.meta[FUNCTION_RESULT][1]  # type: ignore[no-any-return]
    out = node.kwargs.get("out") if node.op in ("call_function", "call_method") else None
    if isinstance(out, torch.fx.Node) and not isinstance(node.target, torch._ops.OpOverload):
        return out  # torch.add(a, b, out=buf) returns buf
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    base = node.args[0]
    if _inplace_by_argument(node):  # F.relu(x, inplace=True) and nn.ReLU(inplace=True) return x
        return base
    if node.op == "call_method" and isinstance(node.target, str):
        # In-place methods return the tensor they wrote: ``x.add_(1).mul_(2)`` writes x twice.
        return base if node.target in VIEW_METHODS or _is_inplace_name(node.target) else None
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return _aliased_argument(node, target)
        if target is getattr and len(node.args) > 1 and node.args[1] in VIEW_ATTRS:
            return base
        if target in VIEW_FUNCTIONS or _is_inplace_name(getattr(target, "__name__", "")):
            return base
    return None


def tensor_origin(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose tensor ``node`` is, the same object: followed back through ops that return what they wrote
    in place (``x.add_(1)``, ``F.relu(x, inplace=True)``, ``out=``), not through views (a view is a tensor of its
    own). A copy of ``node`` made for another device is a copy of its origin; one serves both."""
    return _followed(node, _returned_argument)


def _returned_argument(node: torch.fx.Node) -> torch.fx.Node | None:
    """The argument ``node`` writes in place and returns as its result, if it is such an op."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    out = node.kwargs.get("out")
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        returns = target._schema.returns
        if len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write:
            return _aliased_argument(node, target)
        return None
    kept = node.meta.get(FUNCTION_RESULT) if node.op == "call_function" else None
    if kept is not None:  # a custom Function's result: the argument itself when it wrote it in place
        return kept[1] if kept[0] == "write" else None  # type: ignore[no-any-return]
    if isinstance(out, torch.fx.Node):
        return out
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    if _inplace_by_argument(node):
        return node.args[0]
    if node.op == "call_method":
        return node.args[0] if isinstance(target, str) and _is_inplace_name(target) else None
    if node.op == "call_function" and target not in VIEW_FUNCTIONS:
        return node.args[0] if _is_inplace_name(getattr(target, "__name__", "")) else None
    return None


def _aliased_argument(node: torch.fx.Node, target: torch._ops.OpOverload) -> torch.fx.Node | None:
    """The argument an ATen op's first result aliases (a view's base, an in-place op's self, an ``out=``)."""
    returns = target._schema.returns
    if not returns or returns[0].alias_info is None:
        return None
    alias_set = returns[0].alias_info.before_set
    if not alias_set:  # a list of views (split, unbind, tensor_split: ``Tensor(a)[]``) aliases ``Tensor(a -> *)``
        alias_set = {
            a
            for arg in target._schema.arguments
            if arg.alias_info and "*" in arg.alias_info.after_set
            for a in arg.alias_info.before_set
        }
    for index, argument in enumerate(target._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.before_set & alias_set:
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            return value if isinstance(value, torch.fx.Node) else None
    return None
