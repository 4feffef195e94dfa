"""Type checks for what users pass to the public entry points, done once, before any work.

Each check raises :class:`~fxsplit.errors.SpecError` with the option's name,
what it must be and what it got (``'contiguous' must be True or False (got
'no')``), instead of letting a wrong type surface later as an
``AttributeError`` deep inside tracing, or, worse, be read as something else
(``contiguous='no'`` is truthy).

>>> check_option_types({"contiguous": "no"})
Traceback (most recent call last):
...
fxsplit.errors.SpecError: 'contiguous' must be True or False (got 'no')
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Mapping

import torch

from fxsplit.callsite import user_stacklevel
from fxsplit.devices import normalize_device
from fxsplit.errors import FxsplitError, FxsplitWarning, SpecError

__all__ = [
    "check_concrete_args",
    "check_option_types",
    "device_option",
    "refuse_growing_state",
    "refuse_meta",
    "require_module",
    "unwrapped",
]


def require_module(model: Any) -> None:
    """Refuse anything that is not a ``torch.nn.Module``."""
    if not isinstance(model, torch.nn.Module):
        raise SpecError(
            f"model must be a torch.nn.Module (got {type(model).__name__}); pass the module itself, "
            "e.g. fxsplit.plan(model, ...), not its state_dict, a class or a factory"
        )


_WRAPPERS = {  # wrapper class (module, name) -> (attribute of the wrapped module, what the split is not)
    ("torch._dynamo.eval_frame", "OptimizedModule"): (
        "_orig_mod",
        "compiled (torch.compile): the split runs uncompiled",
    ),
    ("torch.nn.parallel.data_parallel", "DataParallel"): (
        "module",
        "wrapped in DataParallel: the split is one copy of the model over the budgets' devices, not replicated",
    ),
    ("torch.nn.parallel.distributed", "DistributedDataParallel"): (
        "module",
        "wrapped in DistributedDataParallel: the split does not all-reduce its gradients across processes; wrap "
        "the split in it (DistributedDataParallel(split)) to train it data-parallel",
    ),
}


def unwrapped(model: Any) -> Any:
    """The module a ``torch.compile``, ``DataParallel`` or ``DistributedDataParallel`` wrapper holds (through any
    number of them), with a warning for each; anything else as it is.

    Such a wrapper names every tensor ``_orig_mod.<name>`` or ``module.<name>``, and torch.fx cannot trace the
    compiled one: a plan made of it would apply to neither the model nor its checkpoints. The split of the module
    it wraps shares the same tensors and runs the same code."""
    while True:
        kind = type(model)
        wrapper = _WRAPPERS.get((kind.__module__, kind.__name__))
        inner = getattr(model, wrapper[0], None) if wrapper else None
        if wrapper is None or not isinstance(inner, torch.nn.Module):
            return model
        warnings.warn(
            f"the model is {wrapper[1]}; fxsplit traces and splits the module it holds ({type(inner).__name__}, "
            f"its '{wrapper[0]}'), under that module's names (no '{wrapper[0]}.' prefix); pass "
            f"model.{wrapper[0]} to plan without this warning",
            FxsplitWarning,
            stacklevel=user_stacklevel(),
        )
        model = inner


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{type(value).__name__} {text[:70]}..."


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"'{name}' must be True or False (got {_shown(value)})")


def _mapping(example: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value is not None and not isinstance(value, Mapping):
            raise SpecError(f"'{name}' must be a mapping, like {example}, or None (got {_shown(value)})")
        for key in value or {}:
            int_ok = name in ("pins", "device_map") and isinstance(key, int) and not isinstance(key, bool)
            if not isinstance(key, str) and not int_ok:
                raise SpecError(f"'{name}' keys must be strings, like {example} (got key {_shown(key)})")

    return check


def _leaf_modules(name: str, value: Any) -> None:
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        hint = f"; write [{value!r}]" if isinstance(value, str) else ""
        raise SpecError(f"'{name}' must be a list of module classes or module names (got {_shown(value)}){hint}")
    for index, item in enumerate(value):
        is_module_class = isinstance(item, type) and issubclass(item, torch.nn.Module)
        if not is_module_class and not (isinstance(item, str) and item):
            raise SpecError(
                f"'{name}'[{index}] must be an nn.Module subclass (like torch.nn.MultiheadAttention) or "
                f"a module path or class name as a string (got {_shown(item)})"
            )


def _dynamic_shapes(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, Mapping, tuple, list)):
        raise SpecError(
            f"'{name}' must be 'batch', 'all', a torch.export dynamic_shapes spec (a dict, tuple or "
            f"list) or None (got {_shown(value)})"
        )


_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "example_kwargs": _mapping("{'attention_mask': mask}"),
    "leaf_modules": _leaf_modules,
    "concrete_args": _mapping("{'use_cache': False}"),
    "pins": _mapping("{'lm_head': 'cuda:1'}"),
    "device_map": _mapping("{'model.embed': 0, 'model.layers': 1}"),
    "contiguous": _bool,
    "check": _bool,
    "profile": _bool,
    "replicate": _bool,
    "accumulate_grads": _bool,
    "dynamic_shapes": _dynamic_shapes,
}
"""Options whose type is checked here; the others are checked where they are parsed: sizes, devices, specs,
and the choices (``trace``, ``objective``, ``mode``, ``dtype``) against their lists of names."""


def check_option_types(options: Mapping[str, Any]) -> None:
    """Check the type of every option in ``options`` that has a rule in ``_CHECKS``.

    Raises:
        SpecError: ``'<option>' must be ... (got ...)``.
    """
    for name, value in options.items():
        check = _CHECKS.get(name)
        if check is not None:
            check(name, value)


def device_option(where: str, value: Any) -> str:
    """:func:`~fxsplit.devices.normalize_device`, its error prefixed with the option it came from."""
    try:
        return normalize_device(value)
    except SpecError as error:
        raise SpecError(f"{where}: {error}") from None


def check_concrete_args(model: torch.nn.Module, concrete_args: Mapping[str, Any] | None) -> None:
    """Every name in ``concrete_args`` must be an argument of ``model.forward`` (unless it takes ``**kwargs``).

    Raises:
        SpecError: names the unknown keys and forward's arguments.
    """
    if not concrete_args:
        return
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return  # a forward without a readable signature: fx will say what it can
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = [name for name in concrete_args if name not in parameters]
    if unknown:
        named = ", ".join(repr(name) for name in unknown)
        arguments = ", ".join(parameters) or "none"
        raise SpecError(
            f"concrete_args names {named}, which {'is' if len(unknown) == 1 else 'are'} not an argument "
            f"of {type(model).__name__}.forward (its arguments: {arguments}); fix the name or drop it"
        )


def refuse_meta(model: torch.nn.Module) -> None:
    """Raise if a parameter or buffer of ``model`` is on ``meta`` (the split could not run without a checkpoint)."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type == "meta":
            raise FxsplitError(
                f"'{name}' is on the meta device, so the split model could not run; pass checkpoint='path' to "
                "load the weights onto their planned devices (checkpoint=False: split now, fxsplit.load_checkpoint "
                "later), or use fxsplit.plan() to plan a meta model"
            )


def refuse_growing_state(graph_module: torch.fx.GraphModule) -> None:
    """Refuse a graph that writes a buffer back with another shape: state that grows on every call.

    ``torch.export`` turns ``self.cache = torch.cat([self.cache, x])`` into a ``copy_`` of the longer tensor
    into the buffer as traced; the copy broadcasts or fails, so such a split would silently drop what is
    appended (and so would ``torch.export``'s own module).

    Raises:
        FxsplitError: names the buffer, both shapes, the op that made the new value, and what to do instead.
    """
    from fxsplit.tracing.graphinfo import module_path

    for node in graph_module.graph.nodes:
        if not (node.op == "call_function" and getattr(node.target, "__name__", "") == "copy_.default"):
            continue
        target, source = node.args[0], node.args[1]
        if not (isinstance(target, torch.fx.Node) and isinstance(source, torch.fx.Node) and target.op == "get_attr"):
            continue
        old, new = target.meta.get("val"), source.meta.get("val")
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and tuple(old.shape) != tuple(new.shape):
            where = module_path(source)
            made = f" from '{source.name}'" + (f" in '{where}'" if where else "")
            raise FxsplitError(
                f"buffer '{target.target}' is replaced on every call by a tensor of another shape "
                f"({list(old.shape)} -> {list(new.shape)}, the new one{made}): state that grows per call cannot "
                "be split, because the split keeps the traced shape and would drop what is appended. Allocate "
                "it once at its largest size and write into it in place at a position input (index_copy_ or slice "
                "assignment), as transformers' StaticCache does; for Hugging Face models, split "
                "TorchExportableModuleWithStaticCache (see examples/generate.py)"
            )
