"""Helpers that generated code calls at run time (kept tiny; no hooks)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["move"]


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
