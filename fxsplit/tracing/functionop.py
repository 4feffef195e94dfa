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

A call site lives as long as the process: the split's code refers to it by
number (``torch.ops.fxsplit_functions.GeLUFunction.default([x], [], 3)``).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from fxsplit.errors import TraceError

__all__ = ["NAMESPACE", "CallSite", "exported_call", "function_of_op", "inside_kept_call"]

NAMESPACE = "fxsplit_functions"


@dataclass
class CallSite:
    """One call of a Function met while tracing.

    Attributes:
        function: the ``torch.autograd.Function`` subclass.
        spec: the structure of ``(args, kwargs)``.
        leaves: its leaves, None where a tensor or a size goes (they come with each run, in order).
        tensor_positions: where the tensors go among ``leaves``.
        size_positions: where the sizes (``torch.SymInt``, under dynamic shapes) go among ``leaves``.
        result: the structure of the result and its non-tensor leaves (None where a tensor goes), once run.
    """

    function: type
    spec: TreeSpec
    leaves: list[Any]
    tensor_positions: list[int]
    size_positions: list[int]
    result: tuple[TreeSpec, list[Any]] | None = None


_SITES: list[CallSite] = []
_OPS: dict[type, torch._ops.OpOverload] = {}
_FUNCTIONS: dict[torch._ops.OpOverload, type] = {}
_LOCK = threading.Lock()
_library: torch.library.Library | None = None
_inside = threading.local()  # depth: how many kept calls this thread runs inside


def exported_call(function: type, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``function.apply(*args, **kwargs)`` while torch.export traces, as one op (see the module docstring); when no
    tensor is among the arguments, ``original`` (``Function.apply``'s own function) runs it."""
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if not positions:
        return original(function, *args, **kwargs)
    sizes = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.SymInt)]
    if any(isinstance(leaf, (torch.SymFloat, torch.SymBool)) for leaf in leaves):
        raise TraceError(_symbolic_message(function, "takes"))
    taken = {*positions, *sizes}
    site = CallSite(function, spec, [None if i in taken else leaf for i, leaf in enumerate(leaves)], positions, sizes)
    with _LOCK:
        _SITES.append(site)
        number = len(_SITES) - 1
    outputs = _op_for(function)([leaves[i] for i in positions], [leaves[i] for i in sizes], number)
    assert site.result is not None  # the kernel ran on the tracer's fake tensors, which recorded it
    shape, constants = site.result
    produced = iter(outputs)
    return tree_unflatten([next(produced) if leaf is None else leaf for leaf in constants], shape)


def function_of_op(target: object) -> type | None:
    """The Function class an op of :data:`NAMESPACE` runs; None for any other target."""
    return _FUNCTIONS.get(target) if isinstance(target, torch._ops.OpOverload) else None  # type: ignore[arg-type]


def _run(tensors: list[torch.Tensor], sizes: list[int], number: int) -> list[torch.Tensor]:
    """The kernel: the Function called on the site's arguments with ``tensors`` and ``sizes`` in place; the tensors
    of its result returned."""
    site = _SITES[number]
    leaves = list(site.leaves)
    for position, value in zip([*site.tensor_positions, *site.size_positions], [*tensors, *sizes], strict=True):
        leaves[position] = value
    args, kwargs = tree_unflatten(leaves, site.spec)
    _inside.depth = _depth() + 1
    try:
        result = site.function.apply(*args, **kwargs)  # type: ignore[attr-defined]
    finally:
        _inside.depth -= 1
    flat, shape = tree_flatten(result)
    if any(isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)) for leaf in flat):
        raise TraceError(_symbolic_message(site.function, "returns"))
    if site.result is None:
        site.result = (shape, [None if isinstance(leaf, torch.Tensor) else leaf for leaf in flat])
    return [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]


def _symbolic_message(function: type, does: str) -> str:
    what = "takes a float or a bool" if does == "takes" else "returns a number"
    return (
        f"the custom autograd Function {function.__qualname__!r} {what} computed from a dynamic size, which "
        "fxsplit cannot keep beside the Function's call in a torch.export graph; trace with trace='fx', or keep "
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
    global _library
    with _LOCK:
        found = _OPS.get(function)
        if found is not None:
            return found
        if _library is None:
            _library = torch.library.Library(NAMESPACE, "FRAGMENT")
        base = re.sub(r"\W", "_", function.__qualname__)
        name, count = base, 1
        while _defined(name):  # two Functions of one name (defined in two places), or this module loaded twice
            count += 1
            name = f"{base}_{count}"
        _library.define(f"{name}(Tensor[] tensors, SymInt[] sizes, int call) -> Tensor[]")
        _library.impl(name, _run, "CompositeImplicitAutograd")
        op = getattr(getattr(torch.ops, NAMESPACE), name).default
        _OPS[function], _FUNCTIONS[op] = op, function
        return op
