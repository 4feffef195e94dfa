"""What one op of a traced graph computes, from its recorded shapes: FLOPs, bytes moved, and what kind of op it
is (a product and its sizes, a lookup, a batch norm, a view that computes nothing). :mod:`fxsplit.cost.compute`
adds them up per op, forward and backward, and turns them into seconds."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx

from fxsplit.tracing.dynamic import traced_size
from fxsplit.tracing.graphinfo import element_size, value_bytes

__all__ = [
    "LOOKUPS",
    "LOOKUP_MODULES",
    "bytes_moved",
    "flops_of",
    "is_batch_norm",
    "is_free",
    "is_product",
    "numel",
    "op_name",
    "operands",
    "conv_stride",
    "product_sizes",
    "value_of",
]

_MATMULS = {"matmul", "mm", "bmm"}  # first argument times second
_ADD_MATMULS = {"addmm", "baddbmm"}  # input plus first times second
_CONVS = {"conv1d", "conv2d", "conv3d"}
_TRANSPOSED_CONVS = {"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}
_PRODUCTS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "linear", "scaled_dot_product_attention"}
_PRODUCTS |= {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}
LOOKUPS = {"embedding", "embedding_bag"}
LOOKUP_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)
_PRODUCT_MODULES = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)
_NORM_MODULES = (
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.LocalResponseNorm,
)
_NOT_PRODUCTS = (*LOOKUP_MODULES, *_NORM_MODULES)
_BATCH_NORMS = {"batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional"}
_VIEW_NAMES = {
    "view",
    "reshape",
    "permute",
    "transpose",
    "t",
    "unsqueeze",
    "squeeze",
    "flatten",
    "unflatten",
    "expand",
    "narrow",
    "select",
    "split",
    "chunk",
    "unbind",
    "view_as",
    "expand_as",
    "size",
    "dim",
    "contiguous",
    "detach",
    "alias",
    "getitem",
}


def is_product(node: torch.fx.Node, module: torch.nn.Module | None) -> bool:
    if module is not None:
        return isinstance(module, _PRODUCT_MODULES) or (_has_weights(module) and not isinstance(module, _NOT_PRODUCTS))
    name = op_name(node)
    return name in _PRODUCTS or name == "convolution"


def product_sizes(node: torch.fx.Node, module: torch.nn.Module | None) -> tuple[float, float, float]:
    """A product's reduction length, and a convolution's output positions per image and input channels (per
    group), each 0 where none (see :mod:`fxsplit.cost.compute`'s notes)."""
    name = op_name(node) if module is None else ""
    conv = isinstance(module, torch.nn.modules.conv._ConvNd) or name in (_CONVS | _TRANSPOSED_CONVS | {"convolution"})
    shape = getattr(value_of(node), "shape", None)
    if shape is None:
        return 0.0, 0.0, 0.0
    if conv and len(shape) >= 3:
        weight = _shape(node.args[1] if module is None else module.weight)
        return float(math.prod(weight[1:])), float(math.prod(traced_size(s) for s in shape[2:])), float(weight[1])
    if isinstance(module, torch.nn.Linear):
        return float(module.in_features), 0.0, 0.0
    if name in _MATMULS or name in _ADD_MATMULS or name == "linear":
        first = node.args[1] if name in _ADD_MATMULS else node.args[0]
        return float(_shape(first)[-1]), 0.0, 0.0
    return 0.0, 0.0, 0.0


def conv_stride(node: torch.fx.Node, module: torch.nn.Module | None) -> float:
    """A convolution's largest stride (1: unstrided), 0 where the op is no convolution (nor a transposed one,
    whose stride spreads its output rather than skipping input positions)."""
    if isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
        return 0.0
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        stride: Any = module.stride
    else:
        name = op_name(node) if module is None else ""
        if name in _CONVS:  # conv2d(input, weight, bias, stride, ...)
            stride = node.args[3] if len(node.args) > 3 else node.kwargs.get("stride", 1)
        elif name == "convolution":  # aten: (input, weight, bias, stride, padding, dilation, transposed, ...)
            if len(node.args) > 6 and node.args[6]:
                return 0.0
            stride = node.args[3] if len(node.args) > 3 else node.kwargs.get("stride", 1)
        else:
            return 0.0
    steps = list(stride) if isinstance(stride, (list, tuple)) else [stride]
    return float(max((step for step in steps if type(step) is int), default=1))  # a stride not fixed: as none


def is_batch_norm(node: torch.fx.Node, module: torch.nn.Module | None) -> bool:
    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm) or op_name(node) in _BATCH_NORMS


def _has_weights(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def operands(node: torch.fx.Node) -> list[Any]:
    """A product's multiplied operands (not an ``addmm``'s added bias)."""
    name = op_name(node)
    if name in _ADD_MATMULS:
        return list(node.args[1:3])
    if name == "scaled_dot_product_attention":
        return list(node.args[:3])
    return list(node.args[:2])


def is_free(node: torch.fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return bool(target.is_view) or target.overloadpacket.__name__ in ("sym_size", "_assert_tensor_metadata")
    name = getattr(target, "__name__", target) if node.op == "call_function" else target
    return node.op in ("call_method", "call_function") and str(name) in _VIEW_NAMES


def value_of(node: Any) -> Any:
    if not isinstance(node, torch.fx.Node):
        return node
    return node.meta.get("val", node.meta.get("tensor_meta"))


def _shape(value: Any) -> tuple[int, ...]:
    """Its sizes, a symbolic one at the example inputs' value; one that depends on the data raises
    :class:`~fxsplit.tracing.dynamic.DataDependentSize`."""
    return tuple(traced_size(s) for s in value_of(value).shape)


def numel(value: Any) -> float:
    shape = getattr(value, "shape", None)
    if shape is None:
        return 0.0
    return float(math.prod(traced_size(s) for s in shape))


def op_name(node: torch.fx.Node) -> str:
    """The op's name: an ATen op's packet name, a torch function's name, or a method's name."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket.__name__)
    if node.op == "call_method":
        return str(target)
    where = getattr(target, "__module__", None) or ""
    torch_made = where.startswith("torch") or where in ("_operator", "operator") or where == ""
    return str(getattr(target, "__name__", "")) if torch_made else ""


def flops_of(node: torch.fx.Node, module: torch.nn.Module | None) -> float:
    out = value_of(node)
    if module is not None:
        return _module_flops(module, node, out)
    name = op_name(node)
    if name in _MATMULS or name in _ADD_MATMULS or name == "linear":
        first = node.args[1] if name in _ADD_MATMULS else node.args[0]
        return 2.0 * numel(out) * _shape(first)[-1]
    if name in _CONVS:
        return 2.0 * numel(out) * math.prod(_shape(node.args[1])[1:])
    if name in _TRANSPOSED_CONVS:
        return 2.0 * numel(value_of(node.args[0])) * math.prod(_shape(node.args[1])[1:])
    if name == "scaled_dot_product_attention":
        query, key = _shape(node.args[0]), _shape(node.args[1])
        return 4.0 * math.prod(query[:-1]) * key[-2] * query[-1]
    if name in LOOKUPS:
        return 0.0
    if isinstance(node.target, torch._ops.OpOverload):
        from torch.utils.flop_counter import flop_registry

        formula = flop_registry.get(node.target.overloadpacket)
        if formula is not None:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value_of)
            return float(formula(*args, **kwargs, out_val=out))
    return numel(out)


def _module_flops(module: torch.nn.Module, node: torch.fx.Node, out: Any) -> float:
    if isinstance(module, torch.nn.Linear):
        return 2.0 * numel(out) * module.in_features
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        kernel = math.prod(module.weight.shape[1:])
        if module.transposed:
            return 2.0 * numel(value_of(node.args[0])) * kernel
        return 2.0 * numel(out) * kernel
    if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return 0.0
    if isinstance(module, _NORM_MODULES):
        return numel(out)  # elementwise: normalise, scale and shift each element
    params = sum(p.numel() for p in module.parameters())
    shape = getattr(out, "shape", None)
    if params and shape is not None and len(shape) >= 1 and traced_size(shape[-1]):
        rows = numel(out) / traced_size(shape[-1])
        return 2.0 * params * rows
    return numel(out)


def bytes_moved(node: torch.fx.Node, module: torch.nn.Module | None, dtype: Any) -> float:
    out = float(value_bytes(node, float_dtype=dtype) or 0)
    if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) or op_name(node) in LOOKUPS:
        return 2.0 * out  # a lookup reads the rows it returns, not the whole table
    total = out
    for source in dict.fromkeys(node.all_input_nodes):
        total += float(value_bytes(source, float_dtype=dtype) or 0)
    if module is not None:
        for tensor in [*module.parameters(), *module.buffers()]:
            total += tensor.numel() * element_size(tensor.dtype, dtype)
    return total
