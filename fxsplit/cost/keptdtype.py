"""The tensors a model keeps at a dtype of its own when it is loaded at another.

A split at ``dtype="bfloat16"`` should hold what transformers'
``from_pretrained(dtype=torch.bfloat16)`` holds. A model names the tensors it
keeps in float32 whatever the load dtype asks (``_keep_in_fp32_modules_strict``:
the router ``gate.weight`` and ``e_score_correction_bias`` of GLM-4-MoE,
DeepSeek-V3 and others: 45 transformers model families name some; ``_keep_in_fp32_modules`` too when loading as
float16), and loads them at float32: the routing scores are computed in
float32, and a bf16 router picks other experts for some tokens. Cast to bf16
with the rest, the split's logits differed from the bf16 model's.

:func:`kept_dtypes` asks the model (its ``_get_dtype_plan(dtype)``: pattern ->
dtype) and matches each pattern against the names of its parameters and
persistent buffers as transformers matches them against a checkpoint's names
(``*`` is any text; the first pattern found, searching from the left of the
name). Casting for a load (:mod:`fxsplit.checkpoint.cast`), standing in for
planning (:mod:`fxsplit.checkpoint.standin`), loading
(:mod:`fxsplit.checkpoint.load`) and counting bytes at the plan's dtype take
those tensors at the dtype named. A model without such a rule keeps nothing.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from fxsplit.cost.walk import module_table, named_tensors

__all__ = ["held_dtype", "kept_dtypes", "kept_tensors"]


def kept_dtypes(model: torch.nn.Module, dtype: torch.dtype | str | None) -> dict[str, torch.dtype]:
    """Qualified name -> dtype of each floating parameter and persistent buffer of ``model`` that the model
    loads at that dtype rather than ``dtype`` (every name of a tied tensor); empty when it names none."""
    if dtype is None:
        return {}
    planned = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    rule = getattr(model, "_get_dtype_plan", None)
    if not callable(rule):
        return {}
    try:
        patterns = dict(rule(planned))
    except Exception:  # noqa: BLE001 - a model's own method that fails: it names nothing we can use
        return {}
    patterns = {str(p): d for p, d in patterns.items() if isinstance(d, torch.dtype) and d.is_floating_point}
    if not patterns:
        return {}
    names = list(patterns)
    search = re.compile("|".join(f"(?P<g{i}>{p.replace('*', '.*')})" for i, p in enumerate(names))).search
    found: dict[str, torch.dtype] = {}
    for prefix, module in module_table(model).items():
        tables: list[tuple[str, Any]] = [*module._parameters.items()]
        tables += [(n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for name, tensor in tables:
            if tensor is None or not tensor.is_floating_point():
                continue
            qualified = f"{prefix}.{name}" if prefix else name
            match = search(qualified)
            if match is not None and match.lastgroup is not None:
                found[qualified] = patterns[names[int(match.lastgroup[1:])]]
    return _with_tied_names(model, found)


def _with_tied_names(model: torch.nn.Module, found: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """``found`` with every other name of each tensor it names (a tied tensor is kept under all its names)."""
    if not found:
        return found
    by_tensor = {id(tensor): found[name] for name, tensor, _ in named_tensors(model) if name in found}
    return {name: by_tensor[id(tensor)] for name, tensor, _ in named_tensors(model) if id(tensor) in by_tensor}


def kept_tensors(model: torch.nn.Module, dtype: torch.dtype | str | None) -> dict[int, torch.dtype]:
    """``id(tensor)`` -> dtype of each tensor :func:`kept_dtypes` names."""
    kept = kept_dtypes(model, dtype)
    if not kept:
        return {}
    return {id(tensor): kept[name] for name, tensor, _ in named_tensors(model) if name in kept}


def held_dtype(tensor: torch.Tensor, dtype: torch.dtype | None, kept: dict[int, torch.dtype]) -> torch.dtype:
    """The dtype a split at ``dtype`` holds ``tensor`` at: its kept dtype, ``dtype`` for a floating one, or
    its own."""
    if dtype is None or not tensor.is_floating_point():
        return tensor.dtype
    return kept.get(id(tensor), dtype)
