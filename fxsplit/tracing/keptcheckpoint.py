"""Activation checkpointing kept: a ``torch.utils.checkpoint`` call becomes one node that checkpoints it again.

Traced through, a checkpoint call leaves its function's ops in the graph and
its recomputation out. While a tracer runs,
:func:`~fxsplit.tracing.checkpoints.plain_checkpoints` catches each call of
``torch.utils.checkpoint.checkpoint`` (``checkpoint_sequential`` and Hugging
Face's ``gradient_checkpointing_enable`` call it too) and, where
:func:`checkpointed_call` can, records it whole: one node whose inputs are the
call's tensors and the parameters and buffers of the modules it runs, and which
calls ``checkpoint`` when run, with the call's own options
(:class:`CheckpointedCall`). The split then holds what eager checkpointing
holds, the call's inputs, and recomputes the rest in backward, on the device
that runs the node.

Under torch.export the node is an op of :mod:`fxsplit.tracing.functionop`,
``torch.ops.fxsplit_functions.checkpointed`` (:func:`kept_checkpoint`). torch.fx
runs no code while it traces, so what a call returns is known only once it is
traced: there the call is traced plainly and its nodes then folded into one
(:mod:`fxsplit.tracing.fxcheckpoint`). The weights are inputs so that the
partitioner places them with the node, and the call runs its modules with them
(``torch.func.functional_call``'s substitution), so it reads the weights where
the split put them.

Each kept call is recomputed the non-reentrant way (``use_reentrant=False``,
PyTorch's recommended form, whose memory fxsplit models exactly), whatever
the model chose. Where that would differ, a reentrant checkpoint of inputs
that need no gradient, the call runs as eager PyTorch runs it: without
gradients (torch's warning included), so its parameters get none.

A call is kept when grad mode is on (else there is nothing to recompute), the
function runs modules of the model (itself a module, a bound method of one, a
``functools.partial`` of either, or a function whose closure holds modules or
a list of them, as ``checkpoint_sequential``'s segments do) and holds no
tensor of its own in a closure (such a tensor would be a constant of the graph,
not the value of this call); under torch.export, the modules it runs are not
the whole model (its op would read every weight). Any other call is traced as
a plain call.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.fx
import torch.utils.checkpoint as torch_checkpoint
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from fxsplit.tracing.functionop import as_traced, call_site, define_op, inside_kept_call, kept_op_call

__all__ = [
    "CHECKPOINT_OPTIONS",
    "CheckpointedCall",
    "checkpoint_of",
    "is_kept_checkpoint",
    "checkpointed_call",
    "kept_checkpoint",
    "label_kept_checkpoints",
]

_op: torch._ops.OpOverload | None = None


@dataclass(frozen=True)
class CheckpointedCall:
    """One checkpoint call kept whole: called with ``(weights, bound, args, kwargs)`` it runs
    ``checkpoint(function, *args, **kwargs)`` as the model did, ``weights`` standing in for its modules' own.

    Attributes:
        function: the checkpointed function, partials taken apart (their arguments come in ``bound``).
        owners: the modules of the model it runs.
        names: per weight, the index of its owner and its name there.
        reentrant: ``use_reentrant`` as the model chose (the call is recomputed the non-reentrant way).
        options: ``checkpoint``'s other options as given (``preserve_rng_state``, ``context_fn``, ...).
        path: what it checkpoints, for the generated code and messages.
    """

    function: Callable[..., Any]
    owners: tuple[torch.nn.Module, ...]
    names: tuple[tuple[int, str], ...]
    reentrant: bool
    options: Mapping[str, Any] = field(default_factory=dict)
    path: str = ""

    def __call__(self, weights: list[torch.Tensor], bound: Any, args: Any, kwargs: Any) -> Any:
        leaves, spec = tree_flatten((bound, args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

        def region(*tensors: torch.Tensor) -> Any:
            given = list(leaves)
            for position, tensor in zip(positions, tensors, strict=True):
                given[position] = tensor
            (bound_args, bound_kwargs), call_args, call_kwargs = tree_unflatten(given, spec)
            with self._weights(weights), as_traced(tensors):  # on fakes, its recomputation too takes the traced path
                return self.function(*bound_args, *call_args, **{**bound_kwargs, **call_kwargs})

        inputs = [leaves[i] for i in positions]
        if self.reentrant and torch.is_grad_enabled() and not any(t.requires_grad for t in inputs):
            # a reentrant checkpoint of inputs that need no gradient gives none, to its parameters either
            warnings.warn("None of the inputs have requires_grad=True. Gradients will be None", stacklevel=2)
            with torch.no_grad():
                return region(*inputs)
        return torch_checkpoint.checkpoint(region, *inputs, use_reentrant=False, **self.options)  # (see the module)

    def stashed_bytes(self) -> int:
        """Host bytes the call holds until its backward beside its inputs: the CPU generator's state (and, on
        GPUs, a few bytes per device), stashed to replay random ops when it recomputes."""
        return torch.get_rng_state().numel() if self.options.get("preserve_rng_state", True) else 0

    def _weights(self, weights: list[torch.Tensor]) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for index, owner in enumerate(self.owners):
            own = {name: w for (at, name), w in zip(self.names, weights, strict=True) if at == index}
            stack.enter_context(_reparametrize_module(owner, own, tie_weights=True, strict=False))
        return stack


def checkpoint_of(node: torch.fx.Node) -> CheckpointedCall | None:
    """The kept checkpoint call ``node`` runs, or None."""
    if node.op != "call_function" or not is_kept_checkpoint(node.target):
        return None
    call = getattr(node.target, "fxsplit_checkpoint", None) or call_site(node.args[2]).run  # type: ignore[arg-type]
    return call if isinstance(call, CheckpointedCall) else None


def is_kept_checkpoint(target: object) -> bool:
    """Whether a node's target runs a kept checkpoint call (an op of torch.export's, a torch.fx call's function:
    :mod:`fxsplit.tracing.fxcheckpoint`)."""
    return (_op is not None and target is _op) or getattr(target, "fxsplit_checkpoint", None) is not None


def kept_checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    options: dict[str, Any],
    use_reentrant: bool | None,
    paths: Mapping[int, str],
) -> tuple[str, Any] | None:
    """``checkpoint(function, *args, use_reentrant=..., **options)`` met by a torch.export trace, kept whole (see
    the module docstring): ``(its path, its result)``; None when it cannot be kept. ``paths``: the model's
    modules by id."""
    found = checkpointed_call(function, args, options, use_reentrant, paths, torch.Tensor)
    if found is None:
        return None
    call, arguments = found
    weights = [_weight(call, at, name) for at, name in call.names]
    return call.path, kept_op_call(
        _checkpoint_op(), call, f"the checkpoint of {call.path!r}", (weights, *arguments), {}
    )


def checkpointed_call(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    options: dict[str, Any],
    use_reentrant: bool | None,
    paths: Mapping[int, str],
    traced: type,
) -> tuple[CheckpointedCall, tuple[Any, Any, Any]] | None:
    """The call as a :class:`CheckpointedCall` and its ``(bound, args, kwargs)``, or None when it cannot be kept
    (see the module docstring). ``traced``: the type of the tracer's values (a tensor, a torch.fx proxy). Under
    torch.export a call that runs the model itself (a method of it, a function closing over it) is not kept: its
    op would read every weight of the model (under fx the folded call reads what its nodes read)."""
    if not torch.is_grad_enabled() or inside_kept_call():
        return None
    call_kwargs = {k: v for k, v in options.items() if k not in CHECKPOINT_OPTIONS}
    bound, base = _bound_arguments(function)
    if not any(isinstance(leaf, traced) for leaf in tree_leaves((bound, args, call_kwargs))):
        return None
    owners = _owners(base, bound[0][:1], paths)
    if owners is None or (traced is torch.Tensor and any(not paths[id(owner)] for owner in owners)):
        return None  # (torch.export: a call that runs the whole model would read every weight, and pins none)
    names = tuple(
        (at, name)
        for at, owner in enumerate(owners)
        for name, tensor in [*owner.named_parameters(remove_duplicate=False), *owner.named_buffers()]
        if tensor is not None
    )
    path = ", ".join(paths[id(owner)] or "the model" for owner in owners) or getattr(base, "__qualname__", "call")
    chosen = {k: v for k, v in options.items() if k in CHECKPOINT_OPTIONS}
    reentrant = True if use_reentrant is None else use_reentrant  # torch's default
    return CheckpointedCall(base, tuple(owners), names, reentrant, chosen, path), (bound, args, call_kwargs)


CHECKPOINT_OPTIONS = ("preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")
"""``checkpoint``'s own keyword arguments; any other is the function's."""


def _owners(base: Callable[..., Any], first: list[Any], paths: Mapping[int, str]) -> list[torch.nn.Module] | None:
    """The model's modules ``base`` runs: itself, its ``self``, ``first`` (a partial's first argument), modules
    its closure holds; None when its closure holds a tensor (a value of the graph the call would not see)."""
    candidates = [base, getattr(base, "__self__", None), *first]
    closure = _closure(base)
    if any(isinstance(leaf, (torch.Tensor, torch.fx.Proxy)) for leaf in tree_leaves(list(closure.values()))):
        return None
    if _SEGMENT in getattr(base, "__qualname__", "") and _segment(closure):
        closure = {"segment": closure["functions"][closure["start"] : closure["end"] + 1]}  # the modules it runs
    for held in closure.values():
        candidates += list(held) if isinstance(held, (list, tuple)) else [held]
    owners: list[torch.nn.Module] = []
    for candidate in candidates:
        if isinstance(candidate, torch.nn.Module) and id(candidate) in paths and candidate not in owners:
            owners.append(candidate)
    return owners


_SEGMENT = ".<locals>.run_function"
"""In the qualified name of what runs a segment of torch's ``checkpoint_sequential`` or timm's ``checkpoint_seq``
(``model.set_grad_checkpointing()`` in ViT, ConvNeXt, ...): ``run_function(start, end, functions)`` makes the
function that runs modules ``start`` to ``end`` of ``functions``; the others it closes over are not its owners."""


def _segment(closure: Mapping[str, Any]) -> bool:
    """Whether ``closure`` is a segment runner's: integers ``start`` and ``end``, a list or tuple ``functions``."""
    start, end = closure.get("start"), closure.get("end")
    return type(start) is int and type(end) is int and isinstance(closure.get("functions"), (list, tuple))


def _closure(function: Callable[..., Any]) -> dict[str, Any]:
    """The variables a function closes over (of a bound method, its function's), by name (filled cells only)."""
    function = getattr(function, "__func__", function)
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    found = {}
    for name, cell in zip(code.co_freevars if code else (), cells, strict=False):
        try:
            found[name] = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
    return found


def _bound_arguments(function: Callable[..., Any]) -> tuple[tuple[list[Any], dict[str, Any]], Callable[..., Any]]:
    """``((positional, keyword), base)``: the arguments ``functools.partial`` bound into ``function``, and what
    they are bound to."""
    positional: list[Any] = []
    keywords: dict[str, Any] = {}
    while isinstance(function, functools.partial):
        positional = [*function.args, *positional]
        keywords = {**function.keywords, **keywords}
        function = function.func
    return (positional, keywords), function


def _weight(call: CheckpointedCall, at: int, name: str) -> Any:
    owner: Any = call.owners[at]
    for part in name.split("."):
        owner = getattr(owner, part)
    return owner


def _checkpoint_op() -> torch._ops.OpOverload:
    global _op
    if _op is None:
        _op = define_op("checkpointed")
    return _op


def label_kept_checkpoints(graph_module: torch.fx.GraphModule) -> None:
    """Give each kept call of one module that module's path as its innermost module (``nn_module_stack``): the
    call is made from its caller's forward, but it runs the module, and pins and plans name it by its path."""
    for node in graph_module.graph.nodes:
        call = checkpoint_of(node)
        if call is not None and len(call.owners) == 1 and call.path != "the model":
            stack = dict(node.meta.get("nn_module_stack") or {})
            stack[call.path] = (call.path, type(call.owners[0]))
            node.meta["nn_module_stack"] = stack
