"""Python attributes that ``forward`` assigns: put back after tracing, and said, since a split cannot repeat them.

A graph holds tensor ops. ``self.calls += 1`` or ``self.scale = self.scale * 0.5`` in ``forward`` runs once, while
tracing: torch.fx left the model changed by it (``fxsplit.plan`` must not change the model), and every split
computes with the value the attribute had while it was traced, where the model's next call would see the new one.

:func:`python_state_kept` notes each assignment to an attribute of one of the model's modules while the trace
runs (``torch.nn.Module.__setattr__``, for the block, on this thread), puts every such attribute back as it was
when the block ends, and warns of those a plain value (a number, a string, a tuple of them) was assigned to under
a public name and changed, and of those that held a tensor, None or nothing and were given a tensor the trace
computed (a running value; a cache made at the first call, which the model reads from its second call on), unless
``forward`` set them to None first (each call starts them anew): the split will not repeat the assignment. A
tensor attribute ``forward`` reads and replaces (``self.h = self.h * 0.5 + y``) is refused, as a global is below.
Parameters, buffers and submodules are not its business (:mod:`fxsplit.tracing.registered`).

A plain value ``forward`` assigns to a global of the model's code (``global STEPS; STEPS += 1``, a warm-up flag)
is the same: the graph keeps the branch it took once. Such globals (of the Python modules that define the model's
classes, torch's aside) are put back as well, and said under a public name. A global tensor that ``forward``
reads and binds anew to one it computes (``global RUNNING; RUNNING = RUNNING * 0.5 + y``) is state carried from
call to call, which the split would start anew at each call: put back, and refused
(:class:`~fxsplit.errors.TraceError`; the reads are noted as torch calls the ops, :mod:`fxsplit.tracing.tensorreads`).
Other tensors bound to a global (one not read, one where there was none) are put back and said.
"""

from __future__ import annotations

import os
import threading
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from fxsplit.callsite import user_stacklevel
from fxsplit.errors import FxsplitWarning, TraceError
from fxsplit.tracing.inputfree import made_from_inputs
from fxsplit.tracing.modelcode import code_modules
from fxsplit.tracing.tensorreads import reads_noted

__all__ = ["python_state_kept"]

_MISSING = object()
_PLAIN = (bool, int, float, complex, str, type(None))
_TRACED = (FakeTensor, torch.fx.Proxy)
_TORCH = os.path.dirname(torch.__file__) + os.sep


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
    reset: set[tuple[int, str]] = set()  # those the trace set to None first: each call starts them anew
    thread = threading.get_ident()
    original = torch.nn.Module.__setattr__

    def setattr_(module: torch.nn.Module, name: str, value: Any) -> None:
        key = (id(module), name)
        if threading.get_ident() == thread and id(module) in modules:
            if key not in before:
                registered = name in module._parameters or name in module._buffers or name in module._modules
                if not registered and name != "training":
                    before[key] = module.__dict__.get(name, _MISSING)
                    if value is None:
                        reset.add(key)
            if key in before:
                last[key] = value
        original(module, name, value)

    codes = [code for code in code_modules(list(modules.values())) if not code.__file__.startswith(_TORCH)]
    globals_before = [(code, dict(vars(code))) for code in codes]
    global_tensors = [value for _, names in globals_before for value in names.values() if type(value) is torch.Tensor]
    attribute_tensors = [value for m in modules.values() for value in vars(m).values() if type(value) is torch.Tensor]
    torch.nn.Module.__setattr__ = setattr_  # type: ignore[method-assign,assignment]
    read: set[int] = set()
    state: list[str] = []
    try:
        with reads_noted(global_tensors + attribute_tensors) as read:
            yield
    finally:
        torch.nn.Module.__setattr__ = original  # type: ignore[method-assign]
        changed = []
        for (key, name), old in before.items():
            module = modules[key]
            new = last[(key, name)]
            if new is not old and not (_plain(old) and _plain(new) and old == new):
                if not name.startswith("_") and _plain(old) and (new is _MISSING or _plain(new)):
                    changed.append(_shown(model, module, name, old, new))
                elif isinstance(new, _TRACED) and _tensor_or_none(old) and (key, name) not in reset:
                    # a tensor (or None, or nothing) replaced by one the trace computed: state the split does not
                    # carry (a running value; a cache made at the first call), or a record it does not make; not
                    # when forward set it to None first (HF RecurrentGemma's recurrent_states without a cache)
                    if isinstance(old, torch.Tensor) and id(old) in read:  # read, then replaced: a running value
                        state.append(f"the attribute {_shown(model, module, name, _Said(old), _Said(new))}")
                    elif isinstance(old, torch.Tensor) or made_from_inputs(new):  # (made from the model's own
                        changed.append(_shown(model, module, name, _Said(old), _Said(new)))  # tensors: the same)
            if old is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = old
        changed += _globals_put_back(globals_before, read, state)
        if changed:
            warnings.warn(FxsplitWarning(_message(changed)), stacklevel=user_stacklevel())
    if state:  # (only when the trace itself ran through: the block's own error goes first)
        raise TraceError(_state_message(state))


def _globals_put_back(globals_before: list[tuple[Any, dict[str, Any]]], read: set[int], state: list[str]) -> list[str]:
    """Put back each global that the block bound anew to another plain value or to a tensor; the public plain
    ones and the tensors, shown. A tensor it read and bound anew to a tensor: its name added to ``state``."""
    shown = []
    for code, before in globals_before:
        namespace = vars(code)
        for name, new in list(namespace.items()):
            old = before.get(name, _MISSING)
            tensor = isinstance(new, (torch.Tensor, torch.fx.Proxy)) and _tensor_or_none(old)
            if new is old or not (tensor or (_plain(new) and (old is _MISSING or _plain(old)) and old != new)):
                continue
            if old is _MISSING:
                del namespace[name]
            else:
                namespace[name] = old
            if tensor and id(old) in read:
                state.append(f"the global {code.__name__}.{name}")
            elif tensor:
                shown.append(f"global {code.__name__}.{name} ({_Said(old)!r} -> {_Said(new)!r})")
            elif not name.startswith("_"):
                was = "unset" if old is _MISSING else repr(old)
                shown.append(f"global {code.__name__}.{name} ({was} -> {new!r})")
    return shown


def _tensor_or_none(value: Any) -> bool:
    return value is None or value is _MISSING or isinstance(value, torch.Tensor)


def _state_message(names: list[str]) -> str:
    return (
        f"forward() reads tensors and binds them anew to tensors it computes: {', '.join(names)}. That "
        "is state carried from one call to the next, and a graph holds tensor ops only, so each call of a split "
        "would start from the value traced, where each call of the model reads what the last one left (they are "
        "put back as they were). Keep the state in a buffer that forward updates in place "
        "(self.register_buffer('running', torch.zeros(...)); self.running.copy_(new))"
    )


class _Said:
    """A tensor, or what was there before one, as the warning shows it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        if isinstance(self.value, _TRACED):
            return "a tensor it computes"
        if isinstance(self.value, torch.Tensor):
            return f"a tensor of shape {tuple(self.value.shape)}"
        return "unset" if self.value is _MISSING else repr(self.value)


def _shown(model: torch.nn.Module, module: torch.nn.Module, name: str, old: Any, new: Any) -> str:
    path = next((p for p, m in model.named_modules() if m is module), "")
    return f"{path or 'self'}.{name} ({old!r} -> {new!r})"


def _message(changed: list[str]) -> str:
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    return (
        f"forward() assigns {', '.join(changed[:4])}{more} while it is traced: a graph holds tensor ops only, so the "
        "split computes with the values these had when traced and does not change them, where each call of the "
        "model does (they are put back as they were); keep such state in a buffer updated in place "
        "(self.register_buffer('calls', torch.zeros((), dtype=torch.long)); self.calls.add_(1)), or compute it "
        "outside forward"
    )
