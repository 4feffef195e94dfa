"""Which computed buffers a model cast to a dtype needs at that dtype too.

A model cast for a dtype (a checkpoint loaded as bf16, or :func:`fxsplit.plan`
with ``dtype=``) keeps its non-persistent buffers at the dtype it made them
(:mod:`fxsplit.checkpoint.cast`): no checkpoint holds them, and transformers
keeps a rotary table in float32 on purpose. But a model built at float32 made
*every* such buffer float32, including those its code makes at the default
dtype and means to be the model's: timm's EVA attention keeps the key bias as
a zeros buffer and concatenates it with the query and value biases, so kept at
float32 the bias of its projection is float32 beside bf16 weights, and the
CPU refuses the matmul (``self and mat2 must have the same dtype``) when the
split first runs. Fake kernels do not check that, so the plan itself passed.

:func:`meeting_buffers` finds those in the traced graph: a kept buffer whose
value (or a value computed from it that is still of its dtype) is an input of
an op beside a tensor of the cast dtype. A table the model converts before it
meets the model's tensors (``cos.to(x.dtype)``) meets none, and stays; so does
one that meets them in an elementwise op that promotes (``q * cos``, float32,
then ``.to(q.dtype)``: OLMo-2's rotary table, which transformers keeps float32,
was cast to bf16, and its split's logits differed from the bf16 model's by 0.002).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.fx
from torch.utils._pytree import tree_leaves

from fxsplit.attrpath import attr_at
from fxsplit.cost.opwork import op_name
from fxsplit.cost.walk import module_table

__all__ = ["kept_buffers", "meeting_buffers"]

_PROMOTING = frozenset(  # ops whose result takes the widest dtype of their inputs
    {"add", "sub", "mul", "div", "true_divide", "rsub", "where", "maximum", "minimum", "pow", "cat", "stack", "lerp"}
    | {"__add__", "__sub__", "__mul__", "__truediv__", "__radd__", "__rmul__", "__rsub__", "addcmul", "addcdiv"}
)


def kept_buffers(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Name -> tensor of each floating non-persistent buffer of ``model`` not of ``dtype`` (under each name)."""
    found: dict[str, torch.Tensor] = {}
    for prefix, module in module_table(model).items():
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                found[f"{prefix}.{name}" if prefix else name] = buffer
    return found


def meeting_buffers(graph_module: torch.fx.GraphModule, kept: set[str], dtype: torch.dtype) -> list[str]:
    """The names in ``kept`` (buffers the graph reads at another dtype than ``dtype``) whose values meet a tensor
    of ``dtype`` as inputs of one op of ``graph_module``'s graph (sizes as traced: ``meta["val"]``)."""
    if not kept:
        return []
    carries: dict[torch.fx.Node, frozenset[str]] = {}  # node -> the kept buffers its value is still made of
    found: set[str] = set()
    for node in graph_module.graph.nodes:
        if node.op == "get_attr" and node.target in kept:
            carries[node] = frozenset([str(node.target)])
            continue
        inputs = node.all_input_nodes
        sources = frozenset().union(*(carries[a] for a in inputs if a in carries))
        if not sources or node.op == "output":
            continue
        met = any(dtype in _dtypes(a, graph_module) for a in inputs if a not in carries)
        if met and _promotes(node, graph_module, dtype):  # (computes at the buffer's dtype, as the model does)
            met = False
        if not met and node.op == "call_module":  # a leaf module: its own weights are inputs too
            owner = graph_module.get_submodule(str(node.target))
            met = any(t.dtype == dtype for t in [*owner.parameters(), *owner.buffers()])
        if met:
            found |= sources
        if any(d != dtype for d in _dtypes(node, graph_module)):  # its value still of the buffer's dtype
            carries[node] = sources
    return sorted(found)


def _promotes(node: torch.fx.Node, graph_module: torch.fx.GraphModule, dtype: torch.dtype) -> bool:
    """Whether ``node`` is an elementwise op (or a ``cat``) that promoted its inputs past ``dtype`` (float32 times
    bf16 is float32): it runs at any mix of dtypes, so meeting there needs nothing cast; where its value goes on
    at the buffer's dtype, a later op may still meet it (EVA's ``cat`` of biases, then the projection)."""
    made = _dtypes(node, graph_module)
    return op_name(node) in _PROMOTING and bool(made) and dtype not in made


def _dtypes(node: torch.fx.Node, graph_module: torch.fx.GraphModule) -> set[torch.dtype]:
    """The floating dtypes of the tensors of ``node``'s value (as traced)."""
    return {t.dtype for t in _tensors(node, graph_module) if t.dtype.is_floating_point}


def _tensors(node: torch.fx.Node, graph_module: torch.fx.GraphModule) -> Iterator[Any]:
    value = node.meta.get("val", node.meta.get("tensor_meta"))
    if value is None and node.op == "get_attr":
        value = attr_at(graph_module, str(node.target), None)
    for leaf in tree_leaves(value):
        if hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
            yield leaf
