"""Custom autograd Functions met while tracing: kept whole by torch.fx, traced through by torch.export.

A ``torch.autograd.Function`` subclass defines its own backward (a gradient
reversal layer returns ``-grad``; a straight-through estimator passes the
gradient of ``round`` through unchanged). Left to themselves, both tracers
record the ops of its ``forward`` and drop its ``backward``, so a split would
compute the model's values but, in backward, the gradients of those ops
(``-grad`` becomes ``grad``, the estimator's gradient becomes zero).

:func:`recording_functions` wraps ``Function.apply`` while a tracer runs
(torch's own Functions aside: activation checkpointing is
:mod:`fxsplit.tracing.checkpoints`):

* under torch.fx (``keep=True``), a call on traced values becomes one graph
  node whose target, :func:`function_call`, calls the Function's ``apply``:
  the split runs the Function as written, backward included;
* under torch.export (``keep=False``), the call runs as before and is recorded:
  the graph holds its forward's ops only, and :func:`custom_backward_message`
  says what that means (a training plan is refused, any other plan warns).

A kept call is opaque to the graph, so :func:`note_aliases` (after the fx
graph's shapes are known) records where its result is its argument, written in
place (``ctx.mark_dirty``), or a view of it (``x.view_as(x)``), for the
analysis of in-place writes (:mod:`fxsplit.tracing.graphinfo`).

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
>>> with recording_functions(keep=True) as met:
...     x = torch.fx.Proxy(graph.placeholder("x"), torch.fx.proxy.GraphAppendingTracer(graph))
...     _ = Flip.apply(x)
>>> met.kept, [node.target.__name__ for node in graph.nodes if node.op == "call_function"]
(['Flip'], ['Flip_apply'])
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch.autograd.function import Function
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fxsplit.callsite import user_stacklevel

__all__ = [
    "FUNCTION_RESULT",
    "FunctionCalls",
    "custom_backward_message",
    "function_call",
    "fx_for_custom_functions",
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
        kept: called on traced values and kept as one graph node each (torch.fx).
        dropped: run while tracing, so the graph holds their forward's ops and lacks their backward.
    """

    kept: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


@contextmanager
def recording_functions(keep: bool = False) -> Iterator[FunctionCalls]:
    """Inside the block, each call of a ``torch.autograd.Function`` defined outside torch is recorded; with
    ``keep`` (torch.fx tracing), a call with a :class:`torch.fx.Proxy` among its arguments becomes a node
    (:func:`function_call`) instead of running. Any other call runs as before."""
    met = FunctionCalls()
    original = Function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls.__module__.startswith("torch."):
            return original.__func__(cls, *args, **kwargs)
        if keep:
            proxy = next((a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.fx.Proxy)), None)
            if proxy is not None:
                met.kept.append(cls.__qualname__)
                return proxy.tracer.create_proxy("call_function", function_call(cls), args, kwargs)
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

    call.__name__ = call.__qualname__ = f"{function.__name__}_apply"
    call.__module__ = function.__module__
    call.__doc__ = f"{function.__qualname__}.apply, kept whole in the traced graph (fxsplit)"
    call.fxsplit_function = function  # type: ignore[attr-defined]
    return call


def kept_function(target: object) -> type | None:
    """The Function class a node target calls, when it is a :func:`function_call`; else None."""
    return getattr(target, "fxsplit_function", None) if callable(target) else None


def note_aliases(graph_module: torch.fx.GraphModule) -> list[str]:
    """Record :data:`FUNCTION_RESULT` on each kept call (with shapes) whose one tensor result is an argument,
    written in place, or a view of one. Returns the Functions whose result holds an argument's memory inside a
    tuple or list (what :data:`FUNCTION_RESULT` cannot say).

    Each call is run once more, alone, on fake tensors of its arguments' sizes: the shapes pass keeps copies of
    its values, so only a fresh call shows whether the result is the argument itself (``ctx.mark_dirty``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    unfollowed = []
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for node in graph_module.graph.nodes:
        function = kept_function(node.target) if node.op == "call_function" else None
        if function is None or "val" not in node.meta:
            continue
        fakes: dict[torch.fx.Node, Any] = {}
        for argument in node.all_input_nodes:
            value = argument.meta.get("val")
            if isinstance(value, torch.Tensor):
                fakes[argument] = mode.from_tensor(
                    torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
                )
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), functools.partial(_fake_of, fakes))
        with mode, torch.no_grad():
            result = function.apply(*args, **kwargs)  # type: ignore[attr-defined]
        storages = {_storage(fake): argument for argument, fake in fakes.items()}
        if isinstance(result, torch.Tensor):
            source = storages.get(_storage(result))
            if source is not None:
                written = any(result is fake for fake in fakes.values())
                node.meta[FUNCTION_RESULT] = ("write" if written else "view", source)
        elif any(_storage(t) in storages for t in tree_leaves(result) if isinstance(t, torch.Tensor)):
            unfollowed.append(function.__qualname__)
    return unfollowed


def _fake_of(fakes: dict[torch.fx.Node, Any], node: torch.fx.Node) -> Any:
    return fakes[node] if node in fakes else node.meta.get("val")


def _storage(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


def custom_backward_message(met: Sequence[str], training: bool) -> str:
    """Why a split of a model that calls the custom Functions ``met`` (non-empty) cannot train, and what to do."""
    unique = list(dict.fromkeys(met))
    shown = ", ".join(map(repr, unique[:4])) + (f" and {len(unique) - 4} more" if len(unique) > 4 else "")
    what = (
        f"the model calls custom autograd Functions ({shown}) whose backward the torch.export graph cannot keep: "
        "it holds the ops of their forward, so the split's outputs are the model's but its gradients would not be"
    )
    fix = "trace with trace='fx', which keeps each Function call whole, backward included"
    if training:
        return f"{what}; fxsplit refuses to plan it for training. To train it, {fix}"
    return f"{what}: do not train this split. To train, {fix}, and plan with mode='training'"


def fx_for_custom_functions(tracing: Callable[..., Any], exported: Any) -> Any:
    """For a training plan with ``trace="auto"``: the torch.fx trace of a model whose torch.export graph
    (``exported``, a :class:`~fxsplit.tracing.capture.Traced`) lacks custom Functions' backward, with a warning
    that says so. ``tracing(mode=...)`` traces the model. Raises the refusal, with fx's failure, when fx cannot
    trace it."""
    from fxsplit.errors import FxsplitWarning, TraceError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FxsplitWarning)  # what fx says is below; its own notes are not
            traced = tracing(mode="fx")
    except TraceError as error:
        refusal = custom_backward_message(exported.custom_backward, training=True)
        raise TraceError(f"{refusal}\n\ntorch.fx failed too: {error}") from error
    shown = ", ".join(map(repr, dict.fromkeys(exported.custom_backward)))
    warnings.warn(
        FxsplitWarning(
            f"the model calls custom autograd Functions ({shown}) whose backward torch.export drops; fxsplit traced "
            "it with torch.fx instead, which keeps each call whole. Pass trace='fx' to choose fx (no warning)"
        ),
        stacklevel=user_stacklevel(),
    )
    return dataclasses.replace(traced, notes=(*traced.notes, "torch.export drops custom Functions' backward"))


def unfollowed_message(functions: Sequence[str]) -> str:
    """Why fxsplit cannot split a model whose kept Functions ``functions`` return an argument's memory in a tuple."""
    shown = ", ".join(map(repr, dict.fromkeys(functions)))
    return (
        f"the custom autograd Functions {shown} return, among several results, a tensor that is one of their "
        "arguments or a view of one; fxsplit keeps each call whole under torch.fx and cannot follow that memory "
        "across devices. Return one tensor from such a Function, or a new one (x.clone() for x), or trace with "
        "trace='export' for a split that is not trained (it runs the Function's forward ops)"
    )
