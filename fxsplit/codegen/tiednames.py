"""Every name of a tied tensor in a split's ``state_dict``, as in the model's.

A ``torch.export`` graph holds a tied tensor (GPT-2's ``wte.weight`` and
``lm_head.weight``) once, under one of its names, so the split's
``state_dict()`` lacked the others and did not load strictly into the
original model. These hooks write the tensor under each of its names, and on
loading read a state dict that has all of them (the model's own) into the one
the split holds. Fx splits keep the module tree, so there is nothing to add.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fxsplit.planning.plan import Plan

__all__ = ["keep_tied_names"]

# (the name the split holds, the other names of the same tensor)
_Aliases = tuple[tuple[str, tuple[str, ...]], ...]


def keep_tied_names(split: torch.nn.Module, plan: Plan) -> None:
    """Make ``split.state_dict()`` name each tied tensor as the model does, and read such a state dict back."""
    held = {name for name, _ in split.named_parameters(remove_duplicate=False)}
    held |= {name for name, _ in split.named_buffers(remove_duplicate=False)}
    aliases = tuple(
        (kept[0], tuple(name for name in group if name not in held))
        for group in plan.tied
        if (kept := [name for name in group if name in held]) and len(kept) < len(group)
    )
    if aliases:  # partial of module-level functions: the split still deep-copies and pickles
        split.register_state_dict_post_hook(functools.partial(_add_aliases, aliases))
        split.register_load_state_dict_pre_hook(functools.partial(_drop_aliases, aliases))


def _add_aliases(aliases: _Aliases, module: torch.nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    for kept, others in aliases:
        if prefix + kept in state:
            for name in others:
                state[prefix + name] = state[prefix + kept]


def _drop_aliases(aliases: _Aliases, module: torch.nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    for kept, others in aliases:
        for name in others:
            value = state.pop(prefix + name, None)
            if value is not None and prefix + kept not in state:
                state[prefix + kept] = value  # a state dict that names the tensor only by another name
