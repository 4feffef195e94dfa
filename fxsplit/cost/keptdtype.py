"""The tensors a model holds at a dtype of its own when it is loaded at another.

A split at ``dtype="bfloat16"`` should hold what transformers'
``from_pretrained(dtype=torch.bfloat16)`` holds, which is not "every floating
tensor at bf16":

* a model names tensors it keeps in float32 whatever the load dtype asks
  (``_keep_in_fp32_modules_strict``: the router ``gate.weight`` and
  ``e_score_correction_bias`` of GLM-4-MoE, DeepSeek-V3 and others: 45
  transformers model families keep some tensors so; ``_keep_in_fp32_modules``
  too when loading as float16). The routing scores are computed in float32,
  and a bf16 router picks other experts for some tokens: cast with the rest,
  a GLM-4-MoE split's logits differed from the bf16 model's by 0.002.
  :func:`kept_dtypes` asks the model (its ``_get_dtype_plan(dtype)``: pattern
  -> dtype) and matches each pattern against the names of its parameters and
  persistent buffers as transformers matches them against a checkpoint's names
  (``*`` is any text; the first pattern found, searching from the left);
* transformers builds the model with the load dtype as torch's default, so a
  tensor the model's code makes at a dtype of its own keeps it (HunYuan-MoE's
  router ``wg`` and Zamba's ``A_log`` at float32), and a computed buffer made
  at the default dtype is bf16 (Falcon-H1's ``mup_vector``, OpenAI-GPT's causal
  mask) while one made at float32 (a rotary table) stays float32. A model built
  at float32 shows neither: :func:`built_dtypes` builds its class from its
  config once more, on ``meta`` (no memory; 0.1 s for a Llama-70B) with the dtype
  as the default, and reads each tensor's dtype there.

Casting for a load (:mod:`fxsplit.checkpoint.cast`), standing in for planning
(:mod:`fxsplit.checkpoint.standin`), loading (:mod:`fxsplit.checkpoint.load`)
and counting bytes at the plan's dtype take those tensors at the dtype named.
A model without such a rule or config keeps nothing, and its computed buffers
are kept or cast as :mod:`fxsplit.checkpoint.computed` finds.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any, Callable

import torch

from fxsplit.cost.walk import module_table, named_tensors

__all__ = ["built_dtypes", "kept_dtypes", "kept_tensors"]


def kept_dtypes(model: torch.nn.Module, dtype: torch.dtype | str | None) -> dict[str, torch.dtype]:
    """Qualified name -> dtype of each floating tensor of ``model`` that a split at ``dtype`` holds at another
    dtype than by default (every name of a tied tensor): a parameter or persistent buffer the model's rule keeps
    (``_get_dtype_plan``) or a transformers model builds at another dtype; a non-persistent buffer at the dtype
    the model built at ``dtype`` makes it (:func:`built_dtypes`; by default it keeps its own)."""
    if dtype is None:
        return {}
    planned = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    search, patterns = _rule(model, planned)
    built = built_dtypes(model, planned)
    if search is None and not built:
        return {}
    found: dict[str, torch.dtype] = {}
    for prefix, module in module_table(model).items():
        computed = module._non_persistent_buffers_set
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_floating_point():
                    continue
                qualified = f"{prefix}.{name}" if prefix else name
                own = built.get(qualified)
                if table is module._buffers and name in computed:
                    if own is not None:
                        found[qualified] = own
                    continue
                match = search(qualified) if search is not None else None
                if match is not None and match.lastgroup is not None:
                    found[qualified] = patterns[int(match.lastgroup[1:])]
                elif own is not None and own != planned:
                    found[qualified] = own
    return _with_tied_names(model, found)


def _rule(model: torch.nn.Module, dtype: torch.dtype) -> tuple[Callable[[str], Any] | None, list[torch.dtype]]:
    """The model's keep rule at ``dtype`` as one search over names (None: none) and each pattern's dtype."""
    rule = getattr(model, "_get_dtype_plan", None)
    if not callable(rule):
        return None, []
    try:
        found = dict(rule(dtype))
    except Exception:  # noqa: BLE001 - a model's own method that fails: it names nothing we can use
        return None, []
    patterns = {str(p): d for p, d in found.items() if isinstance(d, torch.dtype) and d.is_floating_point}
    if not patterns:
        return None, []
    alternation = "|".join(f"(?P<g{i}>{p.replace('*', '.*')})" for i, p in enumerate(patterns))
    return re.compile(alternation).search, list(patterns.values())


_BUILT: dict[tuple[type, str, torch.dtype], dict[str, torch.dtype]] = {}


def built_dtypes(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Qualified name -> dtype of each floating parameter and buffer of a transformers model as
    ``from_pretrained(dtype=dtype)`` builds it: its class, from its config, on ``meta`` (free) with ``dtype`` the
    default. Empty for another model, or one that does not build so (remembered per class, config and dtype).

    This is how transformers decides a dtype: a tensor made at the default dtype is ``dtype``; one the model's
    code makes at a dtype of its own keeps it (HunYuan-MoE's router ``wg`` and Zamba's ``A_log`` at float32;
    Falcon-H1's ``mup_vector`` buffer at ``dtype``, but a rotary table's ``inv_freq`` at float32), which the
    loader keeps, unlike a model built at float32 and cast."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "_get_dtype_plan", None)) or not dtype.is_floating_point:
        return {}
    try:
        key = (type(model), config.to_json_string(), dtype)
    except Exception:  # noqa: BLE001 - a config that does not serialize: built each time
        key = None
    if key is not None and key in _BUILT:
        return _BUILT[key]
    found = _build(model, config, dtype)
    if key is not None:
        if len(_BUILT) >= 8:  # a few models per process: forget the others
            _BUILT.clear()
        _BUILT[key] = found
    return found


def _build(model: torch.nn.Module, config: Any, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtypes of ``model``'s class built from ``config`` as ``from_pretrained(dtype=dtype)`` builds it: with
    ``dtype`` on the config and its sub-configs (Apertus' xIELU makes its parameters at ``config.dtype``), and
    as torch's default."""
    default = torch.get_default_dtype()
    try:
        config = copy.deepcopy(config)
        for holder in [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", None) or ())]:
            if holder is not None:
                holder.dtype = dtype
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            torch.set_default_dtype(dtype)
            built = type(model)(config)
    except Exception:  # noqa: BLE001 - a model that does not build from its config alone: nothing known
        return {}
    finally:
        torch.set_default_dtype(default)
    ours = {name: tensor for name, tensor, _ in named_tensors(model)}
    found = {}
    for name, tensor, _ in named_tensors(built):
        mine = ours.get(name)
        if mine is None or mine.shape != tensor.shape or not tensor.is_floating_point():
            continue
        found[name] = tensor.dtype
    return found


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
