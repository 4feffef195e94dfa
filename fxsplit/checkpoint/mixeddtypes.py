"""Ops of a model cast to a dtype that take tensors of two floating dtypes where kernels need one.

A model planned at bf16 is traced with its weights at bf16, but on fake tensors,
whose kernels do not check dtypes: a model that computes ``x.float() @ w`` with
``w`` now bf16 is traced and planned, and fails when it first runs (the CPU's
and CUDA's matrix products, convolutions and attention refuse mixed dtypes;
norms and elementwise ops accept them). :func:`mixed_dtype_ops` finds such ops
in the traced graph, so that the plan can say so before the weights are loaded.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

__all__ = ["mixed_dtype_message", "mixed_dtype_ops"]

_aten = torch.ops.aten
_ONE_DTYPE = {  # target -> how many leading arguments must share a dtype (None: all tensor arguments)
    **dict.fromkeys(
        (
            _aten.linear.default,
            _aten.mm.default,
            _aten.bmm.default,
            _aten.addmm.default,
            _aten.baddbmm.default,
            _aten.matmul.default,
            _aten.mv.default,
            _aten.addmv.default,
            _aten.einsum.default,
            _aten.conv1d.default,
            _aten.conv2d.default,
            _aten.conv3d.default,
            _aten.convolution.default,
            _aten.conv_transpose1d.default,
            _aten.conv_transpose2d.input,
            _aten.conv_transpose3d.input,
            F.linear,
            F.conv1d,
            F.conv2d,
            F.conv3d,
            F.conv_transpose1d,
            F.conv_transpose2d,
            F.conv_transpose3d,
            torch.matmul,
            torch.mm,
            torch.bmm,
            torch.addmm,
            torch.baddbmm,
            torch.mv,
            torch.einsum,
            operator.matmul,
        ),
        None,
    ),
    **dict.fromkeys((_aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention), 3),  # q, k, v
}
_METHODS = {"matmul", "mm", "bmm", "__matmul__", "__rmatmul__"}
_MODULES = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)


def mixed_dtype_ops(graph_module: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, list[str]]]:
    """Each op of the graph that needs one floating dtype and takes two or more, with those dtypes' names."""
    found = []
    for node in graph_module.graph.nodes:
        dtypes = _input_dtypes(node, graph_module)
        if dtypes is not None and len(dtypes) > 1:
            found.append((node, sorted(str(d).removeprefix("torch.") for d in dtypes)))
    return found


def mixed_dtype_message(found: list[tuple[torch.fx.Node, list[str]]], dtype: str) -> str:
    """The warning for :func:`mixed_dtype_ops`'s ops of the model at ``dtype``."""
    named = "; ".join(f"'{node.name}' takes {' and '.join(dtypes)}{_line(node)}" for node, dtypes in found[:3])
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return (
        f"the model at {dtype} mixes floating dtypes where kernels need one: {named}{more}; traced on fake tensors, "
        f"which do not check this, it was planned, but it will fail there when it runs at {dtype}: give those ops "
        "inputs of one dtype (cast the other tensor, or keep that part of the model at its dtype)"
    )


def _input_dtypes(node: torch.fx.Node, graph_module: torch.fx.GraphModule) -> set[torch.dtype] | None:
    """The floating dtypes of the tensors an op that needs one dtype takes; None for any other node."""
    if node.op == "call_function":
        try:
            leading = _ONE_DTYPE.get(node.target, -1)
        except TypeError:  # an unhashable target
            return None
        if leading == -1:
            return None
        arguments: list[Any] = list(node.args[:leading]) if leading is not None else [*node.args, *node.kwargs.values()]
        extra: list[Any] = []
    elif node.op == "call_method" and node.target in _METHODS:
        arguments, extra = [*node.args, *node.kwargs.values()], []
    elif node.op == "call_module" and isinstance(owner := graph_module.get_submodule(str(node.target)), _MODULES):
        arguments, extra = list(node.args[:1]), [t for t in owner.parameters(recurse=False)]
    else:
        return None
    values = [a.meta.get("val") for a in tree_leaves(arguments) if isinstance(a, torch.fx.Node)]
    tensors = [v for v in [*values, *extra] if isinstance(v, torch.Tensor)]
    return {t.dtype for t in tensors if t.dtype.is_floating_point}


def _line(node: torch.fx.Node) -> str:
    """`` (at file:line: code)``: the innermost frame of the node's recorded stack outside torch, or ""."""
    lines = [line.strip() for line in str(node.meta.get("stack_trace") or "").strip().splitlines()]
    frames = [
        (at, "" if code.startswith("File ") else code)
        for at, code in zip(lines, [*lines[1:], ""], strict=False)
        if at.startswith("File ")
    ]
    outside = [(at, code) for at, code in frames if "/torch/" not in at.replace("\\", "/")]
    if not outside:
        return ""
    at, code = outside[-1]
    return f" (at {at.removeprefix('File ')}{': ' + code if code else ''})"
