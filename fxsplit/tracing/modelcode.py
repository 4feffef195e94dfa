"""The Python code a model runs: its modules' classes, their bases, and the Python modules that define them.

Tracing runs that code, which can reach past the model's tensors: generators and drawing functions bound in its
globals (:mod:`fxsplit.tracing.drawsources`), caches in its globals and classes that a trace fills with its own
values (:mod:`fxsplit.tracing.leftovers`). torch's and fxsplit's own code is left out (``torch.nn``'s modules
are model code: :func:`~fxsplit.tracing.modereads.internal_code`).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

from fxsplit.tracing.modereads import internal_code

__all__ = ["code_classes", "code_modules", "model_namespaces"]


def code_classes(modules: list[torch.nn.Module]) -> list[type]:
    """The classes of ``modules`` and their bases, each once, but those of torch's and fxsplit's machinery."""
    found: dict[type, None] = {}
    for kind in {type(module): None for module in modules}:
        for base in kind.__mro__:
            if base not in found and base is not object and not _internal(sys.modules.get(base.__module__)):
                found[base] = None
    return list(found)


def code_modules(modules: list[torch.nn.Module]) -> list[Any]:
    """The Python modules that define the classes of ``modules`` and their bases (not torch's machinery, nor
    fxsplit's), each once."""
    found: dict[str, Any] = {}
    for kind in {type(module): None for module in modules}:
        for base in kind.__mro__:
            code = sys.modules.get(base.__module__)
            if code is not None and base.__module__ not in found and not _internal(code):
                found[base.__module__] = code
    return list(found.values())


def model_namespaces(modules: list[torch.nn.Module]) -> list[Any]:
    """:func:`code_modules`, then the Python modules that code binds names from, one level down: a module imported
    whole (``import mylib.utils as U``), or the one that defines a function or class imported by name
    (``from mylib.utils import drop``). A name that code binds (``from random import uniform``) holds the function
    itself wherever the model's code calls it from, its own module or a helper's. Not torch's machinery or
    fxsplit's, the standard library's, or NumPy's (their own names are watched where they are defined)."""
    codes = code_modules(modules)
    found: dict[str, Any] = {code.__name__: code for code in codes}
    for code in codes:
        for value in list(vars(code).values()):
            helper: types.ModuleType | None
            if isinstance(value, types.ModuleType):
                helper = value
            elif isinstance(value, (types.FunctionType, type)):
                helper = sys.modules.get(getattr(value, "__module__", None) or "")
            else:
                continue
            name = getattr(helper, "__name__", None)
            if name is None or name in found or name.partition(".")[0] in _NOT_HELPERS or _internal(helper):
                continue
            found[name] = helper
    return list(found.values())


_NOT_HELPERS = frozenset(sys.stdlib_module_names) | {"numpy", "builtins"}


def _internal(code: Any) -> bool:
    filename = getattr(code, "__file__", None)
    return not filename or internal_code(filename)
