"""A dispatch mode under which code that ``torch.compile`` wraps runs eagerly, and stays compilable after.

fxsplit runs the user's code under its own dispatch modes: the activation profile's fake run
(:mod:`fxsplit.memory.allocations`), the mixed-dtype look inside leaf modules
(:mod:`fxsplit.tracing.mixeddtypes`), the logical-device check (:mod:`fxsplit.check`) and the measured
activations (:mod:`fxsplit.memory.measure`). A function compiled with ``torch.compile`` (the user's own, or
``flex_attention``, which compiles its kernel on every eager call) reached with such a mode active is not
compiled: dynamo skips the frame, and marks it skipped for the rest of the process. The user's compiled
function then runs uncompiled after fxsplit planned their model, and ``flex_attention``, compiled with
``fullgraph=True``, fails on every later call ("Attempted to call function marked as skipped").

:class:`EagerDispatchMode` sets the compiler's ``"force_eager"`` stance while it is active: the compiled code
runs as plain Python, so the mode sees every op it runs, and dynamo never looks at the frame. Higher-order
operators (``flex_attention``'s kernel, ``cond``) reach the mode whole, its ``__torch_dispatch__`` runs them
as they are, and their bodies go unseen (:func:`is_higher_order` tells them from ATen ops).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["EagerDispatchMode", "is_higher_order"]


def is_higher_order(func: Any) -> bool:
    """``func`` is a higher-order operator (``flex_attention``, ``cond``), not an ATen op."""
    return isinstance(func, torch._ops.HigherOrderOperator)


class EagerDispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` that runs compiled code eagerly while it is active (see the module's text)."""

    supports_higher_order_operators = True

    def __enter__(self) -> Any:
        stances = self.__dict__.setdefault("_fxsplit_stances", [])
        set_stance = getattr(torch.compiler, "set_stance", None)  # (torch 2.6 on; before, as any dispatch mode)
        stances.append(set_stance("force_eager") if set_stance is not None else contextlib.nullcontext())
        try:
            return super().__enter__()
        except BaseException:
            stances.pop().__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self.__dict__["_fxsplit_stances"].pop().__exit__(None, None, None)
