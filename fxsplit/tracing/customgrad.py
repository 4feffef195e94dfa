"""Custom autograd Functions met while tracing: each call kept whole, so the split runs its backward.

A ``torch.autograd.Function`` subclass defines its own backward (a gradient
reversal layer returns ``-grad``; a straight-through estimator passes the
gradient of ``round`` through unchanged; Bloom's GeLU and RecurrentGemma's
clipped square root in Hugging Face transformers). Left to themselves, both
tracers record the ops of its ``forward`` and drop its ``backward``, so a split
would compute the model's values but, in backward, the gradients of those ops
(``-grad`` becomes ``grad``, the estimator's gradient becomes zero).

:func:`recording_functions` wraps ``Function.apply`` while a tracer runs
(torch's own Functions aside: activation checkpointing is
:mod:`fxsplit.tracing.checkpoints`) and keeps each call on traced values as one
node that calls the Function:

* torch.fx (``keep="fx"``): a ``call_function`` node whose target,
  :func:`function_call`, calls the Function's ``apply``;
* torch.export (``keep="export"``): an op of :mod:`fxsplit.tracing.functionop`,
  which export keeps as one node and which calls ``apply`` when run.

A kept call is opaque to the graph, so :func:`note_aliases` (once the graph's
shapes are known) records where its result is its argument, written in place
(``ctx.mark_dirty``), or a view of it (``x.view_as(x)``), for the analysis of
in-place writes (:mod:`fxsplit.tracing.graphinfo`).

>>> import torch
>>> class Flip(torch.autograd.Function):
...     @staticmethod
...     def forward(ctx, x):
...         return x.clone()
...     @staticmethod
...     def backward(ctx, grad):
...         return -grad
>>> with recording_functions() as met:
...     _ = Flip.apply(torch.ones(2))
>>> met.dropped
['Flip']
>>> graph = torch.fx.Graph()
>>> with recording_functions(keep="fx") as met:
...     x = torch.fx.Proxy(graph.placeholder("x"), torch.fx.proxy.GraphAppendingTracer(graph))
...     _ = Flip.apply(x)
>>> met.kept, [node.target.__name__ for node in graph.nodes if node.op == "call_function"]
(['Flip'], ['Flip_apply'])
"""

from __future__ import annotations

import functools
import operator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch.autograd.function import Function
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten

from fxsplit.tracing.functionop import exported_call, function_of_op, inside_kept_call
from fxsplit.tracing.keptcheckpoint import is_kept_checkpoint, label_kept_checkpoints

__all__ = [
    "FUNCTION_RESULT",
    "FunctionCalls",
    "function_call",
    "kept_function",
    "note_aliases",
    "recording_functions",
    "unfollowed_message",
]

FUNCTION_RESULT = "fxsplit_function_result"
"""``node.meta`` key of a kept Function call whose result is one of its arguments: ``("write", argument node)``
when it wrote that argument in place and returned it, ``("view", argument node)`` when it returned a view of it."""


@dataclass
class FunctionCalls:
    """The custom Functions a trace met (qualified names, in call order).

    Attributes:
        kept: called on traced values and kept as one graph node each.
        dropped: run while tracing, on no traced value (their result is a constant of the graph), or (``keep=""``)
            on any: the graph then holds their forward's ops and lacks their backward.
    """

    kept: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


@contextmanager
def recording_functions(keep: str = "") -> Iterator[FunctionCalls]:
    """Inside the block, each call of a ``torch.autograd.Function`` defined outside torch is recorded. ``keep``
    says what becomes of a call on traced values: ``"fx"``, one node (:func:`function_call`) when a
    :class:`torch.fx.Proxy` is among its arguments; ``"export"``, one op (:func:`~fxsplit.tracing.functionop.
    exported_call`) when a tensor is; ``""``, nothing: it runs as before, and the graph gets its forward's ops."""
    met = FunctionCalls()
    original = Function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls.__module__.startswith("torch.") or inside_kept_call():  # (a call inside a kept one is part of it)
            return original.__func__(cls, *args, **kwargs)
        if keep == "fx":
            proxy = next((a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.fx.Proxy)), None)
            if proxy is not None:
                met.kept.append(cls.__qualname__)
                return _fx_node(cls, proxy.tracer, args, kwargs)
        elif keep == "export" and any(isinstance(a, torch.Tensor) for a in tree_leaves((args, kwargs))):
            met.kept.append(cls.__qualname__)
            return exported_call(cls, original.__func__, args, kwargs)
        met.dropped.append(cls.__qualname__)
        return original.__func__(cls, *args, **kwargs)

    Function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield met
    finally:
        Function.apply = original  # type: ignore[method-assign]


@functools.cache
def function_call(function: type) -> Callable[..., Any]:
    """The target of a kept call of ``function`` (one per Function class): ``function.apply(*args, **kwargs)``,
    named ``<Function>_apply`` in the generated code."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return function.apply(*args, **kwargs)  # type: ignore[attr-defined]

    return _named(call, function)


def _named(call: Callable[..., Any], function: type) -> Callable[..., Any]:
    """``call``, named ``<Function>_apply`` and marked as running ``function`` (:func:`kept_function`)."""
    call.__name__ = call.__qualname__ = f"{function.__name__}_apply"
    call.__module__ = function.__module__
    call.__doc__ = f"{function.__qualname__}.apply, kept whole in the traced graph (fxsplit)"
    call.fxsplit_function = function  # type: ignore[attr-defined]
    return call


_PLAIN = (
    torch.fx.Proxy,
    int,
    float,
    bool,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
"""What a node's arguments can hold as they are."""


def _fx_node(function: type, tracer: torch.fx.proxy.TracerBase, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The node of a call on traced values: ``function_call(function)(*args, **kwargs)`` when a node's arguments
    can hold them; else a call of the traced values alone, the other arguments (an object, a tensor constant)
    bound into its target as they were (:func:`_bound_call`)."""
    leaves, spec = tree_flatten((args, kwargs))
    if all(isinstance(leaf, _PLAIN) for leaf in leaves):
        return tracer.create_proxy("call_function", function_call(function), args, kwargs)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.fx.Proxy)]
    target = _bound_call(function, spec, leaves, positions)
    return tracer.create_proxy("call_function", target, tuple(leaves[i] for i in positions), {})


def _bound_call(function: type, spec: TreeSpec, leaves: list[Any], positions: list[int]) -> Callable[..., Any]:
    """A target like :func:`function_call`'s for one call: it takes the traced values (``positions`` among
    ``leaves``, the flat arguments of structure ``spec``) and puts them among the others."""
    constants = [None if i in positions else leaf for i, leaf in enumerate(leaves)]

    def call(*traced: Any) -> Any:
        given = list(constants)
        for position, value in zip(positions, traced, strict=True):
            given[position] = value
        args, kwargs = tree_unflatten(given, spec)
        return function.apply(*args, **kwargs)  # type: ignore[attr-defined]

    return _named(call, function)


def kept_function(target: object) -> type | None:
    """The Function class a node target calls, when it is a :func:`function_call` or an op of
    :mod:`~fxsplit.tracing.functionop`; else None."""
    if isinstance(target, torch._ops.OpOverload):
        return function_of_op(target)
    return getattr(target, "fxsplit_function", None) if callable(target) else None


def note_aliases(graph_module: torch.fx.GraphModule) -> list[str]:
    """Record :data:`FUNCTION_RESULT` where a kept call's result holds an argument's memory: on a torch.fx call
    whose one tensor result is an argument, written in place, or a view of one; on the ``getitem`` of a
    torch.export op's result that is a view of an argument or the argument itself (export reads a tensor the
    Function wrote through that ``getitem`` from then on, so it is a view for the analysis of writes). Returns
    the Functions, traced by fx, whose result holds an argument's memory inside a tuple or list (what
    :data:`FUNCTION_RESULT` cannot say).

    Each call is run once more, alone, on fake tensors of its arguments' sizes: the shapes pass keeps copies of
    its values, so only a fresh call shows whether the result is the argument itself (``ctx.mark_dirty``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    label_kept_checkpoints(graph_module)
    unfollowed = []
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for node in graph_module.graph.nodes:
        name = _kept_name(node.target) if node.op == "call_function" else None
        if name is None or "val" not in node.meta:
            continue
        fakes: dict[torch.fx.Node, Any] = {}
        for argument in node.all_input_nodes:
            value = argument.meta.get("val")
            if isinstance(value, torch.Tensor):  # (at the example inputs' sizes, under dynamic shapes)
                shape, stride = [int(d) for d in value.shape], [int(d) for d in value.stride()]
                fakes[argument] = mode.from_tensor(torch.empty_strided(shape, stride, dtype=value.dtype, device="meta"))
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), functools.partial(_fake_of, fakes))
        with mode, torch.no_grad():
            result = node.target(*args, **kwargs)
        storages = {_storage(fake): argument for argument, fake in fakes.items()}
        if isinstance(node.target, torch._ops.OpOverload) or is_kept_checkpoint(node.target):  # read by getitem
            for user in node.users:
                index = user.args[1] if user.target is operator.getitem else None
                source = storages.get(_storage(result[index])) if isinstance(index, int) else None
                if source is not None:
                    user.meta[FUNCTION_RESULT] = ("view", source)
        elif isinstance(result, torch.Tensor):
            source = storages.get(_storage(result))
            if source is not None:
                written = any(result is fake for fake in fakes.values())
                node.meta[FUNCTION_RESULT] = ("write" if written else "view", source)
        elif any(_storage(t) in storages for t in tree_leaves(result) if isinstance(t, torch.Tensor)):
            unfollowed.append(name)
    return unfollowed


def _kept_name(target: object) -> str | None:
    """What a node's target runs whole, a custom Function or a checkpoint call, by name; None for other targets."""
    function = kept_function(target)
    if function is not None:
        return repr(function.__qualname__)
    return "a checkpoint" if is_kept_checkpoint(target) else None


def _fake_of(fakes: dict[torch.fx.Node, Any], node: torch.fx.Node) -> Any:
    if node in fakes:
        return fakes[node]
    value = node.meta.get("val")
    return int(value) if isinstance(value, torch.SymInt) else value


def _storage(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


def unfollowed_message(calls: Sequence[str]) -> str:
    """Why fxsplit cannot split a model whose kept calls ``calls`` (custom Functions, checkpoints; names) return an
    argument's memory in a tuple."""
    shown = ", ".join(dict.fromkeys(calls))
    return (
        f"{shown} return, among several results, a tensor that is one of their arguments or a view of one; "
        "fxsplit keeps each such call whole under torch.fx and cannot follow that memory across devices. Return "
        "one tensor, or a new one (x.clone() for x), or trace with trace='export', which follows it"
    )
