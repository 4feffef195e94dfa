"""The Python code a model runs: its modules' classes, their bases, and the Python modules that define them.

Tracing runs that code, which can reach past the model's tensors: generators and drawing functions bound in its
globals (:mod:`fxsplit.tracing.drawsources`), caches in its globals and classes that a trace fills with its own
values (:mod:`fxsplit.tracing.leftovers`). torch's and fxsplit's own code is left out (``torch.nn``'s modules
are model code: :func:`~fxsplit.tracing.modereads.internal_code`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from fxsplit.tracing.modereads import internal_code

__all__ = ["code_classes", "code_modules"]


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


def _internal(code: Any) -> bool:
    filename = getattr(code, "__file__", None)
    return not filename or internal_code(filename)
