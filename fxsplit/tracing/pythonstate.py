"""Python attributes that ``forward`` assigns: put back after tracing, and said, since a split cannot repeat them.

A graph holds tensor ops. ``self.calls += 1`` or ``self.scale = self.scale * 0.5`` in ``forward`` runs once, while
tracing: torch.fx left the model changed by it (``fxsplit.plan`` must not change the model), and every split
computes with the value the attribute had while it was traced, where the model's next call would see the new one.

:func:`python_state_kept` notes each assignment to an attribute of one of the model's modules while the trace
runs (``torch.nn.Module.__setattr__``, for the block, on this thread), puts every such attribute back as it was
when the block ends, and warns of those a plain value (a number, a string, a tuple of them) was assigned to under
a public name and changed: the split will not repeat the assignment. Parameters, buffers and submodules are not
its business (:mod:`fxsplit.tracing.capture` refuses a forward that assigns a buffer under torch.fx).
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from fxsplit.callsite import user_stacklevel
from fxsplit.errors import FxsplitWarning

__all__ = ["python_state_kept"]

_MISSING = object()
_PLAIN = (bool, int, float, complex, str, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(item) for item in value)
    return isinstance(value, _PLAIN)


@contextmanager
def python_state_kept(model: torch.nn.Module) -> Iterator[None]:
    """Within the block (a trace of ``model``), note what ``forward`` assigns to the attributes of
    ``model``'s modules; when it ends, put them back and warn of the plain values that changed."""
    modules = {id(m): m for m in model.modules()}
    before: dict[tuple[int, str], Any] = {}  # (module id, name) -> its value before the first assignment
    last: dict[tuple[int, str], Any] = {}  # -> the value last assigned (torch.export puts some back itself)
    thread = threading.get_ident()
    original = torch.nn.Module.__setattr__

    def setattr_(module: torch.nn.Module, name: str, value: Any) -> None:
        key = (id(module), name)
        if threading.get_ident() == thread and id(module) in modules:
            if key not in before:
                registered = name in module._parameters or name in module._buffers or name in module._modules
                if not registered and name != "training":
                    before[key] = module.__dict__.get(name, _MISSING)
            if key in before:
                last[key] = value
        original(module, name, value)

    torch.nn.Module.__setattr__ = setattr_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.__setattr__ = original  # type: ignore[method-assign]
        changed = []
        for (key, name), old in before.items():
            module = modules[key]
            new = last[(key, name)]
            if new is not old and not (_plain(old) and _plain(new) and old == new):
                if not name.startswith("_") and _plain(old) and (new is _MISSING or _plain(new)):
                    changed.append((module, name, old, new))
            if old is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = old
        if changed:
            warnings.warn(FxsplitWarning(_message(model, changed)), stacklevel=user_stacklevel())


def _message(model: torch.nn.Module, changed: list[tuple[torch.nn.Module, str, Any, Any]]) -> str:
    paths = {id(m): p for p, m in reversed(list(model.named_modules()))}
    shown = [
        f"{'self' if not paths[id(m)] else paths[id(m)]}.{name} ({old!r} -> {new!r})"
        for m, name, old, new in changed[:4]
    ]
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    return (
        f"forward() assigns {', '.join(shown)}{more} while it is traced: a graph holds tensor ops only, so the "
        "split computes with the values these had when traced and does not change them, where each call of the "
        "model does (they are put back as they were); keep such state in a buffer updated in place "
        "(self.register_buffer('calls', torch.zeros((), dtype=torch.long)); self.calls.add_(1)), or compute it "
        "outside forward"
    )
