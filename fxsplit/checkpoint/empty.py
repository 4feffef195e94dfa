"""Build a model without memory for its weights: parameters on ``meta``, buffers for real; put real tensors in
the place of meta ones (:func:`tensor_like`, :func:`replace_held`).

``with torch.device("meta")`` puts *everything* on meta, buffers included; a
buffer that the module computes when it is built and never saves (a rotary
embedding's ``inv_freq``, a causal mask) is then lost, and no checkpoint can
bring it back. :func:`empty_weights` puts only parameters on meta: every
parameter is moved there the moment a module registers it, so the few bytes
of buffers are computed as usual and the parameters cost nothing.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["empty_weights", "replace_held", "tensor_like"]

_LOCK = threading.RLock()  # one patch at a time; nesting in one thread is fine


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Within the block, every parameter a module registers goes to ``meta``; buffers stay where they are made.

    The model built inside needs no memory for its parameters, keeps its
    computed buffers, and can be planned and then loaded from a checkpoint
    (``fxsplit.fxsplit(model, budgets, checkpoint=...)``). The block patches
    ``torch.nn.Module.register_parameter`` for its duration (all threads).

    Example:
        >>> import torch, fxsplit
        >>> with fxsplit.empty_weights():
        ...     layer = torch.nn.BatchNorm1d(4)
        >>> layer.weight.device.type, layer.running_mean.device.type
        ('meta', 'cpu')
    """
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        held = module._parameters.get(name)
        if held is not None and held.device.type != "meta":
            module._parameters[name] = tensor_like(held, held.data.to("meta"))  # type: ignore[assignment]

    with _LOCK:
        torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def tensor_like(old: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` as what ``old`` was: a Parameter (same class, ``requires_grad``, attributes) or a buffer."""
    if not isinstance(old, torch.nn.Parameter):
        return data
    try:
        new = type(old)(data, requires_grad=old.requires_grad)
    except TypeError:  # a Parameter subclass with another constructor
        new = torch.nn.Parameter(data, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    return new


def replace_held(holders: list[torch.nn.Module], replacements: dict[int, torch.Tensor]) -> None:
    """Put each replacement wherever a module of ``holders`` holds the tensor it replaces."""
    seen: set[int] = set()
    for holder in holders if replacements else ():
        for module in holder.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for registry in (module._parameters, module._buffers):
                for key, value in list(registry.items()):
                    if value is not None and id(value) in replacements:
                        registry[key] = replacements[id(value)]  # type: ignore[assignment]
            for key, value in list(vars(module).items()):  # plain tensor attributes (graph constants)
                if isinstance(value, torch.Tensor) and id(value) in replacements:
                    setattr(module, key, replacements[id(value)])
