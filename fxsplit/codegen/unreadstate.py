"""The model's parameters and buffers that no op reads, held by the split under the model's names.

A graph module holds only what its graph reads: an unused submodule, a buffer
the forward never touches, or BatchNorm's ``num_batches_tracked`` in an
``eval()`` export were missing from the split's ``state_dict()``, which then
did not load strictly into the model (nor the model's into it). The plan
places these tensors like any other (:func:`~fxsplit.planning.unread.pack_unread`)
and :func:`~fxsplit.codegen.weights.move_weights` moves them there;
:func:`hold_unread` registers them on the split, sharing the model's tensor
objects as the read ones are shared.
"""

from __future__ import annotations

import torch

from fxsplit.codegen.fastattr import Container
from fxsplit.cost.walk import named_tensors

__all__ = ["hold_unread"]


def hold_unread(split: torch.nn.Module, model: torch.nn.Module) -> list[str]:
    """Register on ``split`` each of ``model``'s tensors it does not hold (by identity), under every name the
    model gives it; returns those names.

    Missing modules on the way are made as plain containers. A tensor the
    split already holds under another name (a tied one) is left to
    :func:`~fxsplit.codegen.tiednames.keep_tied_names`. Only containers the
    split made are added to, never a module of the user's.
    """
    held = {id(t) for _, t in split.named_parameters(remove_duplicate=False)}
    held |= {id(t) for _, t in split.named_buffers(remove_duplicate=False)}
    added: list[str] = []
    for name, tensor, is_buffer in named_tensors(model):
        if id(tensor) in held:
            continue
        owner, _, leaf = name.rpartition(".")
        holder = _container(split, owner) if owner else split
        if holder is None or leaf in holder._parameters or leaf in holder._buffers:
            continue
        if is_buffer:
            holder.register_buffer(leaf, tensor)
        else:
            holder.register_parameter(leaf, tensor)  # type: ignore[arg-type]
        added.append(name)
    return added


def _container(split: torch.nn.Module, path: str) -> torch.nn.Module | None:
    """The module at ``path`` in ``split``, made (plain ``nn.Module``) where missing; None when the path runs
    into a module that is not the split's own container."""
    holder = split
    for part in path.split("."):
        child = holder._modules.get(part)
        if child is None:
            child = torch.nn.Module()
            holder.add_module(part, child)
        elif type(child) not in (torch.nn.Module, Container):  # the user's module: not ours to add to
            return None
        holder = child
    return holder
