"""Module hooks that a traced graph drops, and how a split keeps them.

A module's hooks run when the module is *called*. A trace calls the submodules it goes into, so their forward
hooks and pre-hooks are traced into the graph like the rest of their code; but:

- torch.fx traces the root's ``forward`` itself, not a call of the root: the root's forward hooks and pre-hooks
  are not in its graph (torch.export's graph has them);
- backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook`` and the older
  ``register_backward_hook``) work by wrapping each call's inputs and outputs in autograd nodes when it runs.
  A graph that holds the module's ops instead of a call of it has no such nodes, so they would never run, and
  the split's gradients would not be the model's: torch.fx keeps the call of a leaf module (the split calls it,
  and its hooks run), torch.export keeps none.

So the split takes the root's hooks that its graph lacks (:func:`carry_root_hooks`: all of them under torch.fx,
the backward ones under torch.export), and a submodule with backward hooks is kept whole, a leaf module that the
split calls (:func:`keep_backward_hooks`): under torch.fx, with a warning unless the caller named it a leaf; a
model whose trace would be torch.export's is traced with torch.fx instead, or refused when ``trace='export'``.

A forward hook of a submodule the trace goes into is traced like its forward: the split computes what it returns,
but its side effects (storing an output in a dict) happened once, while tracing. Name such a module a leaf.

Global hooks (``torch.nn.modules.module.register_module_forward_hook`` and its relatives) run for every module
call; in a split, only for the modules it calls: :func:`warn_global_hooks` says so when any are registered.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from fxsplit.callsite import user_stacklevel
from fxsplit.errors import FxsplitWarning, TraceError

__all__ = ["backward_hooked", "carry_root_hooks", "keep_backward_hooks", "root_hooks_left_out", "warn_global_hooks"]

_FORWARD = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_BACKWARD = ("_backward_pre_hooks", "_backward_hooks")
_REGISTRIES = frozenset(vars(torch.nn.Module())) & {*_FORWARD, *_BACKWARD}  # those this torch's modules have
_IsLeaf = Callable[[torch.nn.Module, str], bool]  # torch.fx's rule: whether it keeps (module, path) whole


def _has_backward_hooks(module: torch.nn.Module) -> bool:
    return bool(module._backward_hooks or module._backward_pre_hooks)


def backward_hooked(model: torch.nn.Module) -> list[str]:
    """The paths of ``model``'s submodules (not the model itself) that have backward hooks, in module order."""
    return [path for path, module in model.named_modules() if path and _has_backward_hooks(module)]


def keep_backward_hooks(
    model: torch.nn.Module,
    mode: str,
    leaves: list[type | str],
    is_leaf: _IsLeaf,
) -> tuple[str, list[type | str]]:
    """The trace mode and leaf modules that keep the backward hooks of ``model``'s submodules: each such module
    not inside a leaf already is made one, and the trace is torch.fx's.

    Args:
        mode: the trace mode asked for (``"auto"``, ``"fx"``, ``"export"``).
        leaves: the leaf modules asked for.
        is_leaf: whether torch.fx keeps ``(module, path)`` whole with ``leaves`` (the tracer's own rule).

    Raises:
        TraceError: ``mode`` is ``"export"`` and some module has backward hooks.
    """
    hooked = backward_hooked(model)
    if not hooked:
        return mode, leaves
    if mode == "export":
        raise TraceError(
            f"{_named(hooked)} backward hooks, which torch.export drops (the split would not run them, and its "
            "gradients would not be the model's); trace with torch.fx (trace='fx'), which keeps such a module "
            "whole and calls it, or remove the hooks (their handles' .remove()) before splitting"
        )
    modules = dict(model.named_modules())
    wrapped: list[str] = []
    for path in hooked:  # in module order: a module inside one kept whole already is kept with it
        if not _under_leaf(path, modules, is_leaf) and not any(path.startswith(f"{w}.") for w in wrapped):
            wrapped.append(path)
    if wrapped or mode != "fx":
        kind = "a leaf module" if len(wrapped) == 1 else "leaf modules"
        kept = f"keeping {_listed(wrapped)} whole (as {kind})" if wrapped else "where they are leaf modules"
        how = "traced with torch.fx (torch.export drops them), " if mode != "fx" else ""
        named = f", leaf_modules=[{', '.join(map(repr, wrapped))}]" if wrapped else ""
        warnings.warn(
            FxsplitWarning(
                f"{_named(hooked)} backward hooks, which run only when the module itself is called: {how}{kept}, "
                f"so that the split calls them and their hooks run; pass trace='fx'{named} to say so without "
                "this warning"
            ),
            stacklevel=user_stacklevel(),
        )
    return "fx", [*leaves, *wrapped]


_GLOBAL = {  # torch's registries of global module hooks -> the function that registers into each
    "_global_forward_pre_hooks": "register_module_forward_pre_hook",
    "_global_forward_hooks": "register_module_forward_hook",
    "_global_backward_pre_hooks": "register_module_full_backward_pre_hook",
    "_global_backward_hooks": "register_module_full_backward_hook",
}


def warn_global_hooks() -> None:
    """Warn if global module hooks are registered: the split runs them only for the modules it calls."""
    from torch.nn.modules import module as modules

    registered = [name for key, name in _GLOBAL.items() if getattr(modules, key, None)]
    if registered:
        warnings.warn(
            FxsplitWarning(
                f"global module hooks are registered ({', '.join(registered)}): they run on every module call, "
                "but the split calls only its leaf modules (torch.nn's layers under torch.fx, none under "
                "torch.export), so they do not run for the modules whose ops its graph holds, and what a forward "
                "hook returned there was traced once; remove them before splitting (their handles' .remove()) "
                "if they change outputs or gradients"
            ),
            stacklevel=user_stacklevel(),
        )


def _under_leaf(path: str, modules: dict[str, torch.nn.Module], is_leaf: _IsLeaf) -> bool:
    """Whether ``path`` or a module above it is one torch.fx keeps whole."""
    parts = path.split(".")
    return any(is_leaf(modules[p], p) for p in (".".join(parts[: k + 1]) for k in range(len(parts))) if p in modules)


def _listed(paths: list[str]) -> str:
    shown = ", ".join(f"'{p}'" for p in paths[:5])
    return shown + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def _named(paths: list[str]) -> str:
    return f"module {_listed(paths)} has" if len(paths) == 1 else f"modules {_listed(paths)} have"


def _left_out(trace: str) -> tuple[str, ...]:
    """The hook registries of a model's own hooks that its graph lacks: under torch.fx all of them, under
    torch.export the backward ones (its graph holds the rest)."""
    names = (*(_FORWARD if trace == "fx" else ()), *_BACKWARD)
    return tuple(name for name in names if name in _REGISTRIES)  # (torch versions differ in which it has)


def root_hooks_left_out(model: torch.nn.Module, trace: str) -> bool:
    """Whether ``model`` has hooks of its own that a graph traced with ``trace`` lacks."""
    return any(getattr(model, name) for name in _left_out(trace))


def carry_root_hooks(split: torch.nn.Module, model: torch.nn.Module, trace: str) -> dict[str, Any]:
    """Give ``split`` the hooks of ``model`` itself that its graph lacks (:func:`root_hooks_left_out`), so that
    calling the split runs them as calling the model does (the hook gets the split as its module). Returns the
    split's attributes it set (name -> value), for a copy of the split to have."""
    carried: dict[str, Any] = {}
    for name in _left_out(trace):
        if getattr(model, name):
            getattr(split, name).update(getattr(model, name))
            carried[name] = getattr(split, name)
    if model._backward_hooks:
        split._is_full_backward_hook = model._is_full_backward_hook
        carried["_is_full_backward_hook"] = model._is_full_backward_hook
    return carried
