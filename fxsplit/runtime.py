"""Helpers that generated code calls at run time (kept tiny; no hooks)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

__all__ = ["call_with_weights", "move", "write_back"]


def move(value: Any, device: str) -> Any:
    """Copy the tensors in ``value`` (nested tuples, lists, dicts) to ``device``; pass anything else through.

    The generated code uses ``tensor.to(device)`` where it knows a value is a
    tensor, and this where it cannot know (graphs traced without example inputs).
    """
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(move(v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(move(v, device) for v in value)
    if isinstance(value, dict):
        return type(value)((k, move(v, device)) for k, v in value.items())
    return value


def write_back(original: Any, moved: Any) -> None:
    """Write the values of ``moved`` into the caller's ``original`` (an input the model updates in place).

    The split updates its copy of the input on the device that reads it;
    eager PyTorch would have updated the caller's tensor, so the generated
    code calls this after the input's last in-place update. Nested tuples,
    lists and dicts are written leaf by leaf; a tensor that *is* its copy (the
    input was already on that device) is left alone.
    """
    if isinstance(original, torch.Tensor) and isinstance(moved, torch.Tensor):
        if moved is not original:
            original.copy_(moved)
    elif isinstance(original, (tuple, list)) and isinstance(moved, (tuple, list)):
        for item, moved_item in zip(original, moved, strict=True):
            write_back(item, moved_item)
    elif isinstance(original, dict) and isinstance(moved, dict):
        for key, item in original.items():
            write_back(item, moved[key])


def call_with_weights(
    module: torch.nn.Module, weights: Mapping[str, torch.Tensor], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """Call ``module(*args, **kwargs)`` with some of its parameters and buffers replaced by ``weights``.

    The generated code calls this where a module runs on one device while
    some of its weights live on another (a tied weight): ``weights`` holds
    their copies, by name inside ``module``. Same as
    :func:`torch.func.functional_call`, which it calls on plain copies of the
    containers: an fx graph hands its arguments over as immutable containers
    (``torch.fx.Interpreter`` does), and ``functional_call`` may change them.
    """
    return torch.func.functional_call(module, dict(weights), tuple(args), dict(kwargs))
