"""A split whose weights are still on ``meta`` refuses to run, saying how to load them.

``fxsplit(meta_model, ..., checkpoint=False)`` returns a split with meta
weights, to be filled by :func:`fxsplit.load_checkpoint`. Called before that,
torch would fail deep inside an op ("not on the expected device meta"); the
split says instead which weights are missing and what to call. The check runs
on calls only until it finds no meta tensor, then removes itself. (A split
cannot run on meta inputs either: its copies to devices need data.)
"""

from __future__ import annotations

from typing import Any

import torch

from fxsplit.errors import CheckpointError

__all__ = ["RefuseUnloaded", "guard_meta_weights"]


def guard_meta_weights(split: Any) -> Any:
    """Make ``split`` refuse calls while a parameter or buffer of it is on ``meta``; return it."""
    if isinstance(split, torch.nn.Module) and _meta_names(split):
        split.register_forward_pre_hook(RefuseUnloaded())
    return split


def _meta_names(module: torch.nn.Module) -> list[str]:
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [name for name, tensor in tensors if tensor is not None and tensor.is_meta]


class RefuseUnloaded:
    """The forward pre-hook: raise while weights are on meta, else remove itself (a class, so a split pickles)."""

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        names = _meta_names(module)
        if not names:  # loaded: nothing to check on later calls
            for key in [key for key, hook in module._forward_pre_hooks.items() if hook is self]:
                del module._forward_pre_hooks[key]
            return
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise CheckpointError(
            f"this split's weights are not loaded: {len(names)} tensor(s) are on meta ({shown}); it was made "
            "with checkpoint=False, so load them first with fxsplit.load_checkpoint(split, path) (or split "
            "with checkpoint=path)"
        )
