"""Activation checkpointing met while tracing: a call kept whole where it can be, else traced as a plain call.

``checkpoint(fn, *args, use_reentrant=True)`` runs ``fn`` under ``no_grad``
inside an autograd Function that recomputes it in backward. Neither tracer
keeps that Function: torch.fx and torch.export both record the ``no_grad``
forward alone, so a split traced through it computed those ops without
gradients. Its parameters got no ``.grad`` and what came before got a gradient
that missed that path, silently when another path carried the loss. The
non-reentrant form (``use_reentrant=False``, Hugging Face's
``gradient_checkpointing_enable`` too) traced to the plain forward, its
recomputation dropped without a word.

While tracing, :func:`plain_checkpoints` handles every checkpoint call
(``checkpoint``, ``checkpoint_sequential``, either form). A call of the model's
modules is kept whole and recomputed by the split
(:mod:`fxsplit.tracing.keptcheckpoint`). A call whose function closes over a
tensor of the forward (``checkpoint(lambda t: block(t) * h, x)``) cannot be: it
runs its function as a plain call, with grad mode as it is around the call, and
is recorded. The graph then computes what the unsplit model computes, values
and gradients alike, and holds the activations a plain call holds; the memory
model counts those. The caller says so (:func:`checkpointing_message`), in
training, where the recomputation would have saved memory.

Two things a plain call does differently from eager checkpointing. A reentrant
checkpoint whose inputs do not require grad gives its parameters no gradient in
eager PyTorch (torch warns "None of the inputs have requires_grad=True"); the
split gives them their gradient. And recomputation hides an in-place write to a
tensor that backward needs; a model that relies on that fails in the split's
backward with torch's "modified by an inplace operation" error, as the same
model without checkpointing does.

>>> import torch
>>> from torch.utils.checkpoint import checkpoint
>>> layer = torch.nn.Linear(2, 2)
>>> model = torch.nn.Sequential(layer)
>>> with plain_checkpoints(model) as met:
...     out = checkpoint(layer, torch.ones(1, 2), use_reentrant=True)
>>> met.plain, out.requires_grad
(['0'], True)
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_leaves

from fxsplit.tracing.functionop import inside_kept_call
from fxsplit.tracing.fxcheckpoint import Region
from fxsplit.tracing.keptcheckpoint import CHECKPOINT_OPTIONS, CheckpointedCall, checkpointed_call, kept_checkpoint

__all__ = ["Checkpointed", "checkpointing_message", "plain_checkpoints"]


@dataclass
class Checkpointed:
    """What the checkpoint calls met while tracing checkpointed, in call order: modules of the model by path.

    Attributes:
        plain: traced as plain calls (their activations kept).
        kept: kept whole, recomputed by the split (:mod:`fxsplit.tracing.keptcheckpoint`).
    """

    plain: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)  # torch.fx: calls to fold (fold_regions) once traced
    paths: dict[int, str] = field(default_factory=dict)  # the model's modules by id (walked at the first call)


@contextmanager
def plain_checkpoints(model: torch.nn.Module, keep: str = "") -> Iterator[Checkpointed]:
    """Inside the block, ``torch.utils.checkpoint`` calls run their function plainly, or (``keep``: ``"export"``
    or ``"fx"``, the tracer) are kept whole where they can be (:func:`~fxsplit.tracing.keptcheckpoint.
    kept_checkpoint`; under fx, traced and then folded, :mod:`fxsplit.tracing.fxcheckpoint`); yields what they
    checkpointed, filled as the block runs.

    The calls are caught where ``checkpoint`` itself (wrapped by ``torch._disable_dynamo``) looks up what to run,
    and a direct ``CheckpointFunction.apply`` on the class: nothing another module could import while the block
    runs is replaced (``torch.distributed``'s composable checkpoint imports torch's non-reentrant generator by
    name, lazily, and would have kept a stand-in for good)."""
    found = Checkpointed()
    paths = found.paths
    depth = [0]  # fx: how many kept calls are being traced (one inside another is part of it)

    def walked() -> dict[int, str]:
        if not paths:  # walked at the first checkpoint call only
            paths.update((id(module), path) for path, module in model.named_modules())
        return paths

    def plain(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not inside_kept_call() and not depth[0]:  # (a kept call's own checkpoint, run on the tracer's values)
            found.plain.append(_name_of(function, walked()))
        return function(*args, **kwargs)

    public = torch_checkpoint.checkpoint
    inner = getattr(public, "__wrapped__", None)
    reentrant = getattr(torch_checkpoint, "CheckpointFunction", None)
    if inner is None or reentrant is None or "__dynamo_disable" not in getattr(public, "__code__", _NO_CODE).co_names:
        yield found  # another torch: its checkpoint calls are traced as they are
        return

    def call(function: Callable[..., Any], *args: Any, use_reentrant: bool | None = None, **options: Any) -> Any:
        kwargs = {k: v for k, v in options.items() if k not in CHECKPOINT_OPTIONS}
        if use_reentrant is not False and kwargs:
            return inner(function, *args, use_reentrant=use_reentrant, **options)  # torch refuses it: let it say so
        if keep == "export":
            kept = kept_checkpoint(function, args, options, use_reentrant, walked())
            if kept is not None:
                found.kept.append(kept[0])
                return kept[1]
        elif keep == "fx" and not depth[0]:
            chosen = checkpointed_call(function, args, options, use_reentrant, walked(), torch.fx.Proxy)
            if chosen is not None:
                return traced_whole(chosen[0], chosen[1], function, args, kwargs)
        return plain(function, args, kwargs)

    def traced_whole(
        kept: CheckpointedCall, arguments: Any, function: Callable[..., Any], args: Any, kwargs: dict[str, Any]
    ) -> Any:
        """Trace the call plainly, noting the nodes it makes (a :class:`Region` to fold)."""
        graph = next(a for a in tree_leaves(arguments) if isinstance(a, torch.fx.Proxy)).tracer.graph
        before = next(reversed(graph.nodes), None)
        depth[0] += 1
        try:
            result = function(*args, **kwargs)
        finally:
            depth[0] -= 1
        nodes = list(graph.nodes)
        start = nodes.index(before) + 1 if before is not None else 0
        found.regions.append(Region(kept, arguments, result, nodes[start:]))
        return result

    def apply(function: Callable[..., Any], _preserve: bool, *args: Any) -> Any:
        return plain(function, args, {})

    before, own = inner.__dict__.get("__dynamo_disable"), reentrant.__dict__.get("apply")
    inner.__dynamo_disable, reentrant.apply = call, staticmethod(apply)
    try:
        yield found
    finally:
        if own is None:
            del reentrant.apply
        else:
            reentrant.apply = own
        if before is None:
            inner.__dict__.pop("__dynamo_disable", None)
        else:
            inner.__dynamo_disable = before


_NO_CODE = (lambda: None).__code__


def _name_of(function: Callable[..., Any], paths: Mapping[int, str]) -> str:
    """The model path of the module ``function`` runs, else the function's qualified name.

    The module is the function itself, the ``self`` of a bound method, the first argument of a partial (Hugging
    Face checkpoints ``partial(forward, layer)``) or a module the function closes over; a segment of
    ``checkpoint_sequential`` closes over a list of modules, and is named by the module that holds them.
    """
    bound: list[Any] = []
    while isinstance(function, functools.partial):
        bound += function.args[:1]
        function = function.func
    candidates = [getattr(function, "__self__", function), *bound]
    for cell in getattr(function, "__closure__", None) or ():
        try:
            candidates.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet
            continue
    for candidate in candidates:
        path = paths.get(id(candidate))
        if path is not None:
            return path or "the model"
    for candidate in candidates:  # a list of the model's modules (checkpoint_sequential's): the one that holds them
        if isinstance(candidate, (list, tuple)):
            found = next((paths[id(item)] for item in candidate if id(item) in paths), None)
            if found:
                return found.rpartition(".")[0] or "the model"
    return str(getattr(function, "__qualname__", None) or type(function).__name__)


def checkpointing_message(met: Sequence[str]) -> str:
    """The warning for a training plan of a model that checkpoints ``met`` (non-empty)."""
    unique = list(dict.fromkeys(met))
    shown = ", ".join(map(repr, unique[:4])) + (f" and {len(unique) - 4} more" if len(unique) > 4 else "")
    calls = f"{len(met)} call{'s' if len(met) != 1 else ''}"
    return (
        f"the model checkpoints activations (torch.utils.checkpoint, {calls}: {shown}) with functions that close "
        "over a tensor of the forward, or (torch.export) that run the whole model, which fxsplit cannot keep as "
        "one call; the split runs these as plain calls, "
        "so its gradients are the model's but it keeps their activations instead of recomputing them, and the "
        "plan counts them kept. To recompute activations, pass such a tensor to checkpoint as an argument, and "
        "checkpoint a submodule (or trace with trace='fx'): each such call is kept whole and recomputed; or "
        "pipeline the model with "
        "pipeline=PipelineConfig(checkpoint='always') (each stage checkpointed per micro-batch); to silence this, "
        "turn the model's checkpointing off before splitting (Hugging Face: model.gradient_checkpointing_disable())"
    )
