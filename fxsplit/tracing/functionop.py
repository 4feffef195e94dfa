"""Custom autograd Functions under torch.export: each call kept as one op that runs the Function, backward included.

torch.export records the ops of a ``torch.autograd.Function``'s forward and
drops its backward. While export traces, :func:`exported_call` (installed by
:func:`~fxsplit.tracing.customgrad.recording_functions`) routes each call of a
Function defined outside torch through an op of its own,
``torch.ops.fxsplit_functions.<Function>``, registered here once per Function
class. Its schema is ``(Tensor[] tensors, SymInt[] sizes, int call) ->
Tensor[]``: the call's tensor arguments, the sizes among its arguments (which
a graph with dynamic shapes computes on each call), and the number of its
:class:`CallSite`, which holds everything else (the Function, where the
tensors and sizes go among the other arguments, the other arguments as they
were, the structure of the result). Its kernel is registered for ``CompositeImplicitAutograd``, which
torch.export keeps as one node; run, it rebuilds the arguments and calls
``Function.apply``, so autograd records the Function's own backward.

The split's code refers to a call site by number
(``torch.ops.fxsplit_functions.GeLUFunction.default([x], [], 3)``); the node
holds it in its ``meta`` (:func:`holding_call_sites`), so it lives as long as a
graph that calls it, and what it holds (a checkpointed module of the model)
is let go with the last such graph.
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from fxsplit.errors import TraceError

__all__ = [
    "CALL_SITE",
    "holding_call_sites",
    "NAMESPACE",
    "CallSite",
    "as_traced",
    "call_site",
    "define_op",
    "exported_call",
    "function_of_op",
    "inside_kept_call",
    "kept_op_call",
]

NAMESPACE = "fxsplit_functions"


@dataclass
class CallSite:
    """One call kept whole, met while tracing.

    Attributes:
        run: what the call runs, given its arguments rebuilt (a Function's ``apply``; a kept checkpoint, see
            :mod:`fxsplit.tracing.keptcheckpoint`).
        name: what it runs, for messages.
        spec: the structure of ``(args, kwargs)``.
        leaves: its leaves, None where a tensor or a size goes (they come with each run, in order).
        tensor_positions: where the tensors go among ``leaves``.
        size_positions: where the sizes (``torch.SymInt``, under dynamic shapes) go among ``leaves``.
        result: the structure of the result, its leaves (None where a tensor goes) and where its tensors go among
            them (a leaf may be None itself: a layer returning ``(hidden, None)``), once run.
    """

    run: Callable[..., Any]
    name: str
    spec: TreeSpec
    leaves: list[Any]
    tensor_positions: list[int]
    size_positions: list[int]
    result: tuple[TreeSpec, list[Any], tuple[int, ...]] | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> CallSite:
        return self  # one site, however many copies of the graph call it (a deep copy would copy the model)

    def __copy__(self) -> CallSite:
        return self


CALL_SITE = "fxsplit_call_site"
"""``node.meta`` key: the :class:`CallSite` a kept call's op node runs (which keeps it alive)."""

_SITES: dict[int, weakref.ref[CallSite]] = {}
_numbers = itertools.count()
_made = threading.local()  # sites made by the trace under way: held until its graph holds them
_OPS: dict[type, torch._ops.OpOverload] = {}
_FUNCTIONS: dict[torch._ops.OpOverload, type] = {}
_LOCK = threading.RLock()
_library: torch.library.Library | None = None
_inside = threading.local()  # depth: how many kept calls this thread runs inside


def exported_call(function: type, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``function.apply(*args, **kwargs)`` while torch.export traces, as one op (see the module docstring); when no
    tensor is among the arguments, ``original`` (``Function.apply``'s own function) runs it."""
    if not any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten((args, kwargs))[0]):
        return original(function, *args, **kwargs)
    name = f"the custom autograd Function {function.__qualname__!r}"
    return kept_op_call(_op_for(function), function.apply, name, args, kwargs)  # type: ignore[attr-defined]


def kept_op_call(
    op: torch._ops.OpOverload, run: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``run(*args, **kwargs)`` while torch.export traces, as one call of ``op`` (an op :func:`define_op` made):
    its tensors and sizes are the op's inputs, the rest is kept in a :class:`CallSite`."""
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    sizes = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.SymInt)]
    if any(isinstance(leaf, (torch.SymFloat, torch.SymBool)) for leaf in leaves):
        raise TraceError(_symbolic_message(name, "takes"))
    taken = {*positions, *sizes}
    constants = [None if i in taken else leaf for i, leaf in enumerate(leaves)]
    site = CallSite(run, name, spec, constants, positions, sizes)
    with _LOCK:
        number = next(_numbers)
        _SITES[number] = weakref.ref(site, functools.partial(_forget, number))
    getattr(_made, "sites", []).append(site)
    outputs = op([leaves[i] for i in positions], [leaves[i] for i in sizes], number)
    assert site.result is not None  # the kernel ran on the tracer's fake tensors, which recorded it
    shape, results, places = site.result
    leaves = list(results)
    for place, output in zip(places, outputs, strict=True):
        leaves[place] = output
    return tree_unflatten(leaves, shape)


def _forget(number: int, _: object) -> None:
    _SITES.pop(number, None)


def call_site(number: int) -> CallSite:
    """The call site a kept call's op names by ``number`` (its last argument)."""
    found = _SITES.get(number)
    site = found() if found is not None else None
    if site is None:
        raise RuntimeError(
            f"fxsplit: call site {number} of a kept call is gone with the graph that held it; run the module that "
            "fxsplit returned, not a graph rebuilt from its code"
        )
    return site


@contextmanager
def holding_call_sites() -> Iterator[Callable[[torch.fx.GraphModule], None]]:
    """Around a torch.export trace: the sites its kept calls make are held until the function yielded is called
    with the traced graph, which puts each on its node's ``meta`` (:data:`CALL_SITE`); else they are let go."""
    outer = getattr(_made, "sites", None)
    _made.sites = []

    def attach(graph_module: torch.fx.GraphModule) -> None:
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                if node.target.namespace == NAMESPACE:
                    node.meta[CALL_SITE] = call_site(node.args[2])

    try:
        yield attach
    finally:
        _made.sites = outer


def function_of_op(target: object) -> type | None:
    """The Function class an op of :data:`NAMESPACE` runs; None for any other target."""
    return _FUNCTIONS.get(target) if isinstance(target, torch._ops.OpOverload) else None  # type: ignore[arg-type]


def _run(tensors: list[torch.Tensor], sizes: list[int], number: int) -> list[torch.Tensor]:
    """The kernel: the Function called on the site's arguments with ``tensors`` and ``sizes`` in place; the tensors
    of its result returned."""
    site = call_site(number)
    leaves = list(site.leaves)
    for position, value in zip([*site.tensor_positions, *site.size_positions], [*tensors, *sizes], strict=True):
        leaves[position] = value
    args, kwargs = tree_unflatten(leaves, site.spec)
    _inside.depth = _depth() + 1
    try:
        with as_traced(tensors):
            result = site.run(*args, **kwargs)
    finally:
        _inside.depth -= 1
    flat, shape = tree_flatten(result)
    if any(isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)) for leaf in flat):
        raise TraceError(_symbolic_message(site.name, "returns"))
    if site.result is None:
        places = tuple(i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor))
        site.result = (shape, [None if isinstance(leaf, torch.Tensor) else leaf for leaf in flat], places)
    return [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]


@contextmanager
def as_traced(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Around a kept call run on fake tensors (planning's runs of the graph, after the trace): torch's compiling and
    exporting flags set, as torch.export set them when it traced the call, so that code choosing its path by them
    takes the path the trace took (Hugging Face's mixture of experts: its fallback, not ``grouped_mm``, whose fake
    kernel takes only bfloat16 on the CPU, though its real one runs float32)."""
    from torch._subclasses.fake_tensor import FakeTensor

    compiler = torch.compiler
    if not any(isinstance(t, FakeTensor) for t in tensors) or compiler.is_compiling():
        yield
        return
    flags = compiler._is_compiling_flag, compiler._is_exporting_flag
    compiler._is_compiling_flag = compiler._is_exporting_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag, compiler._is_exporting_flag = flags


def _symbolic_message(name: str, does: str) -> str:
    what = "takes a float or a bool" if does == "takes" else "returns a number"
    return (
        f"{name} {what} computed from a dynamic size, which "
        "fxsplit cannot keep beside the call in a torch.export graph; trace with trace='fx', or keep "
        "that size static (dynamic_shapes=None)"
    )


def inside_kept_call() -> bool:
    """Whether this thread is running a kept call (a Function called there is part of it, not kept again)."""
    return _depth() > 0


def _depth() -> int:
    return int(getattr(_inside, "depth", 0))


def _defined(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except AttributeError:
        return False
    return True


def _op_for(function: type) -> torch._ops.OpOverload:
    """The op that runs ``function`` (defined on first use)."""
    with _LOCK:
        found = _OPS.get(function)
        if found is None:
            found = _OPS[function] = define_op(re.sub(r"\W", "_", function.__qualname__))
            _FUNCTIONS[found] = function
        return found


def define_op(base: str) -> torch._ops.OpOverload:
    """A new op of :data:`NAMESPACE` named ``base`` (or ``base_2``, ... when taken) with the kernel that runs a
    :class:`CallSite`."""
    global _library
    if _library is None:
        _library = torch.library.Library(NAMESPACE, "FRAGMENT")
    name, count = base, 1
    while _defined(name):  # two Functions of one name (defined in two places), or this module loaded twice
        count += 1
        name = f"{base}_{count}"
    _library.define(f"{name}(Tensor[] tensors, SymInt[] sizes, int call) -> Tensor[]")
    _library.impl(name, _run, "CompositeImplicitAutograd")
    return getattr(getattr(torch.ops, NAMESPACE), name).default  # type: ignore[no-any-return]
