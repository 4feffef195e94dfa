"""Activation checkpointing met while tracing: each ``torch.utils.checkpoint`` call traced as a plain call, and named.

``checkpoint(fn, *args, use_reentrant=True)`` runs ``fn`` under ``no_grad``
inside an autograd Function that recomputes it in backward. Neither tracer
keeps that Function: torch.fx and torch.export both record the ``no_grad``
forward alone, so a split traced through it computed those ops without
gradients. Its parameters got no ``.grad`` and what came before got a gradient
that missed that path, silently when another path carried the loss. The
non-reentrant form (``use_reentrant=False``, Hugging Face's
``gradient_checkpointing_enable`` too) traced to the plain forward, its
recomputation dropped without a word.

While tracing, :func:`plain_checkpoints` has every checkpoint call (``checkpoint``,
``checkpoint_sequential``, either form) run its function as a plain call, with
grad mode as it is around the call, and records what was checkpointed. The
graph then computes what the unsplit model computes, values and gradients
alike, and holds the activations a plain call holds; the memory model counts
those. The caller says so (:func:`checkpointing_message`), in training, where the
recomputation would have saved memory.

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
>>> met, out.requires_grad
(['0'], True)
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["checkpointing_message", "plain_checkpoints"]

_REENTRANT = "CheckpointFunction"  # what checkpoint(use_reentrant=True) calls .apply on
_NON_REENTRANT = "_checkpoint_without_reentrant_generator"  # what use_reentrant=False steps through, twice


@contextmanager
def plain_checkpoints(model: torch.nn.Module) -> Iterator[list[str]]:
    """Inside the block, ``torch.utils.checkpoint`` calls run their function plainly; yields the names of what they
    checkpointed, in call order (filled as the block runs): a module of ``model`` by its path."""
    met: list[str] = []
    paths: dict[int, str] = {}

    def name_of(function: Callable[..., Any]) -> str:
        if not paths:  # walked at the first checkpoint call only
            paths.update((id(module), path) for path, module in model.named_modules())
        return _name_of(function, paths)

    originals = {name: getattr(torch_checkpoint, name, None) for name in (_REENTRANT, _NON_REENTRANT)}
    if any(found is None for found in originals.values()):  # another torch: its checkpoint is traced as it is
        yield met
        return

    class PlainCall:
        """Stands in for ``CheckpointFunction``: ``apply(function, preserve_rng_state, *args)``."""

        @staticmethod
        def apply(function: Callable[..., Any], _preserve: bool, *args: Any) -> Any:
            met.append(name_of(function))
            return function(*args)

    def plain_steps(function: Callable[..., Any], *_args: Any, **_kwargs: Any) -> Iterator[None]:
        """Stands in for the non-reentrant generator: checkpoint() calls the function itself between its steps."""
        met.append(name_of(function))
        yield  # once: checkpoint() calls the function after it, and expects no second yield

    setattr(torch_checkpoint, _REENTRANT, PlainCall)
    setattr(torch_checkpoint, _NON_REENTRANT, plain_steps)
    try:
        yield met
    finally:
        for name, found in originals.items():
            setattr(torch_checkpoint, name, found)


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
        f"the model checkpoints activations (torch.utils.checkpoint, {calls}: {shown}); the split runs these as "
        "plain calls, so its gradients are the model's but it keeps their activations instead of recomputing "
        "them, and the plan counts them kept. To recompute activations, pipeline the model with "
        "pipeline=PipelineConfig(checkpoint='always') (each stage checkpointed per micro-batch); to silence this, "
        "turn the model's checkpointing off before splitting (Hugging Face: model.gradient_checkpointing_disable())"
    )
