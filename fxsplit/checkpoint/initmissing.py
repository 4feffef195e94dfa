"""Tensors a checkpoint does not hold, made on their planned devices and initialized as the model initializes them.

With ``strict=False`` (a base model's checkpoint loaded into a model with a new head), a parameter or
persistent buffer the checkpoint lacks and the model holds on ``meta`` has no value to load. Each one is made on
the device its plan chose, filled with NaN, put in place of the meta tensor wherever it is held, and its module
initialized:

* in a Hugging Face model, by ``_init_weights(module)`` of the innermost ``PreTrainedModel`` that holds the module
  (what ``from_pretrained`` runs for missing keys: the model's own distributions, ``initializer_range``);
* otherwise by the module's ``reset_parameters()`` (``nn.Linear``, ``nn.Embedding``, norms, convolutions;
  ``nn.MultiheadAttention``'s ``_reset_parameters()``).

The other tensors the initializer may touch, loaded already, are copied aside and put back after (see
:func:`_run`). A module without an initializer, a floating tensor its initializer left NaN, or a tensor the plan
stores on disk is an error naming it, raised before anything of the model changes (or with everything put back).
"""

from __future__ import annotations

import sys
import warnings
from typing import Callable, Sequence

import torch

from fxsplit.callsite import user_stacklevel
from fxsplit.checkpoint.empty import replace_held, tensor_like
from fxsplit.checkpoint.match import Slot
from fxsplit.errors import CheckpointError, FxsplitWarning

__all__ = ["check_initializable", "initialize_missing", "warn_loose"]

Initializer = tuple[str, Callable[[], object]]  # (how messages name it, the call)


def initialize_missing(
    model: torch.nn.Module,
    slots: Sequence[Slot],
    homes: Sequence[str],
    dtypes: Sequence[torch.dtype],
    holders: list[torch.nn.Module],
) -> tuple[dict[str, str], Callable[[], None]]:
    """Make each slot's tensor on its home (``"host"``: the CPU) as its dtype, initialize it; return canonical
    name -> the initializer that set it, and the undo (the meta tensors back).

    Raises:
        CheckpointError: a tensor no initializer sets, or one the plan stores on disk; the model is as it was.
    """
    check_initializable(model, slots, homes)
    owners = [_owner(slot.names[0]) for slot in slots]
    initializers = {path: _initializer(model, path) for path in dict.fromkeys(owners)}
    replacements: dict[int, torch.Tensor] = {}
    originals: dict[int, torch.Tensor] = {}
    for slot, home, dtype in zip(slots, homes, dtypes, strict=True):
        device = torch.device("cpu" if home == "host" else home)
        fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
        data = torch.full(tuple(slot.tensor.shape), fill, dtype=dtype, device=device)
        new = tensor_like(slot.tensor, data.pin_memory() if home == "host" and torch.cuda.is_available() else data)
        vars(new).pop("_is_hf_initialized", None)  # transformers' initializers skip a tensor so marked
        replacements[id(slot.tensor)], originals[id(new)] = new, slot.tensor
    replace_held(holders, replacements)

    def undo() -> None:
        replace_held(holders, originals)

    try:
        fresh = {id(tensor) for tensor in replacements.values()}
        done = {path: _run(model, _module(model, path), initializers[path], fresh) for path in initializers}
        unset = [
            f"'{slot.names[0]}': {done[path]} left it unset"
            for slot, path in zip(slots, owners, strict=True)
            if _unset(replacements[id(slot.tensor)])
        ]
        if unset:
            raise _refusal(unset)
    except BaseException:
        undo()
        raise
    return {slot.names[0]: done[path] for slot, path in zip(slots, owners, strict=True)}, undo


def check_initializable(model: torch.nn.Module | None, slots: Sequence[Slot], homes: Sequence[str]) -> None:
    """Raise unless every slot's module has an initializer and none is stored on disk (before anything loads).
    ``model`` None: the slots are a split's (:func:`fxsplit.load_checkpoint`), which has no model to ask."""
    if model is None:
        if slots:
            raise _refusal(
                [f"'{slot.names[0]}' is on meta in the split: only its model can initialize it" for slot in slots],
                "load the checkpoint with fxsplit.fxsplit(model, ..., checkpoint=..., strict=False) or "
                "fxsplit.apply(model, plan, checkpoint=..., strict=False), which initialize them as the model does",
            )
        return
    owners = [_owner(slot.names[0]) for slot in slots]
    problems = [
        f"'{slot.names[0]}': its module '{path or type(model).__name__}' ({type(_module(model, path)).__name__}) "
        "has no reset_parameters() and no Hugging Face model holds it"
        for slot, path in zip(slots, owners, strict=True)
        if _initializer(model, path) is None
    ]
    problems += [
        f"'{slot.names[0]}': the plan stores it on disk, where only a checkpoint's tensors go"
        for slot, home in zip(slots, homes, strict=True)
        if home == "disk"
    ]
    if problems:
        raise _refusal(problems)


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


def _module(model: torch.nn.Module, path: str) -> torch.nn.Module:
    return model.get_submodule(path) if path else model


def _initializer(model: torch.nn.Module, path: str) -> Initializer | None:
    """How the module at ``path`` is initialized: the innermost Hugging Face model's ``_init_weights``, else its
    ``reset_parameters``, else None."""
    module = _module(model, path)
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    if pretrained is not None:
        owner, at = (model if isinstance(model, pretrained) else None), model
        for part in path.split(".") if path else ():
            at = at._modules[part]  # type: ignore[assignment]
            if isinstance(at, pretrained):
                owner = at
        init_weights = getattr(owner, "_init_weights", None)
        if owner is not None and callable(init_weights):
            return f"{type(owner).__name__}._init_weights", lambda: init_weights(module)
    for name in ("reset_parameters", "_reset_parameters"):  # the second: nn.MultiheadAttention's
        reset = getattr(module, name, None)
        if callable(reset):
            return f"{type(module).__name__}.{name}", reset
    return None


def _run(model: torch.nn.Module, module: torch.nn.Module, initializer: Initializer | None, fresh: set[int]) -> str:
    """Run the initializer on ``module``, keeping the values of the tensors it may touch other than ``fresh`` (ids
    of the ones just made): loaded already, or the model's own. Those of its whole subtree (torch's
    ``MultiheadAttention._reset_parameters`` resets its ``out_proj.bias`` too), except for transformers'
    ``_init_weights`` of the model itself, which sets the model's own tensors (``final_logits_bias``)."""
    assert initializer is not None
    label, call = initializer
    subtree = module is not model or not label.endswith("._init_weights")
    held = [*module.named_parameters(recurse=subtree), *module.named_buffers(recurse=subtree)]
    kept = [(t, t.detach().clone()) for _, t in held if id(t) not in fresh and t.device.type != "meta"]
    with torch.no_grad():
        call()
        for tensor, value in kept:
            tensor.copy_(value)
    return label


def _unset(tensor: torch.Tensor) -> bool:
    return (tensor.dtype.is_floating_point or tensor.dtype.is_complex) and bool(torch.isnan(tensor).any())


def warn_loose(path: str, skipped: Sequence[str], missing: Sequence[Slot], made: dict[str, str]) -> None:
    """Warn what a ``strict=False`` load skipped, initialized (``made``: name -> initializer) and left as it was;
    nothing of what the model's checkpoints may lack (:attr:`~fxsplit.checkpoint.match.Slot.optional`)."""
    missing = [slot for slot in missing if not slot.optional]
    told = {slot.names[0] for slot in missing}
    made = {name: how for name, how in made.items() if name in told}
    if not skipped and not missing:
        return
    parts = []
    if skipped:
        parts.append(f"{len(skipped)} of its tensors are not the model's and were not loaded: {_some(skipped)}")
    initialized = [f"'{name}' ({how})" for name, how in made.items()]
    if initialized:
        parts.append(f"{len(initialized)} tensors it lacks were initialized as the model does: {_some(initialized)}")
    kept = [slot.names[0] for slot in missing if slot.names[0] not in made]
    if kept:
        parts.append(f"{len(kept)} tensors it lacks keep the values the model had: {_some(kept)}")
    warnings.warn(
        FxsplitWarning(f"checkpoint '{path}' loaded with strict=False: " + "; ".join(parts)),
        stacklevel=user_stacklevel(),
    )


def _some(names: Sequence[str], shown: int = 8) -> str:
    listed = ", ".join(name if name.startswith("'") else repr(name) for name in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _refusal(problems: list[str], fix: str = "") -> CheckpointError:
    return CheckpointError(
        "strict=False cannot initialize the tensors the checkpoint lacks; nothing was loaded:\n  "
        + "\n  ".join(problems)
        + "\n"
        + (
            fix
            or "add them to the checkpoint, give their module a reset_parameters(), or build the model with real "
            "weights (not on meta): tensors the checkpoint lacks then keep their values"
        ),
        tuple(problems),
    )
