"""Parameters, buffers and submodules that ``forward`` registers while it is traced: taken out after, refused
when the trace made them of its own values.

Some models make part of themselves on their first call (``if not hasattr(self, "pos"): self.register_buffer(
"pos", ...)``, ``self.extra = nn.Linear(...)``). Traced, that first call is the trace's:

* under torch.export it runs on fake tensors, so what it registers holds no values: the model was left with a
  fake buffer or a submodule of fake parameters, and planning failed deep inside torch ("Cannot access data
  pointer of Tensor", a ``RuntimeError``, not an fxsplit error), its own next calls computing with fakes;
* under torch.fx it registers real tensors, and ``fxsplit.plan`` (which must not touch the model) left them on it,
  as did a trace that failed.

:func:`registrations_undone` puts every module's parameters, buffers, submodules and hooks back as they were when
the block ends (a split keeps its own: its graph module holds what its graph reads), and, when the block ended
well, refuses with a :class:`~fxsplit.errors.TraceError` if a registration held fake tensors, naming it and the
fixes: make it in ``__init__``, or call the model once before splitting it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

from fxsplit.errors import TraceError

__all__ = ["registrations_undone"]

_REGISTRIES = (
    "_parameters",
    "_buffers",
    "_modules",
    # hooks: transformers 5 registers forward hooks on a model's modules on its first call, to record their outputs
    # (``output_capturing``), and sets a flag on the model saying so, which :mod:`~fxsplit.tracing.pythonstate`
    # puts back: the hooks left on, the model's next call registered them again, and recorded every output twice
    # (a Segformer's head then read one stage's features for another's)
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_MISSING = object()


def _holds_fakes(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return is_fake(value)
    if isinstance(value, torch.nn.Module):
        return any(is_fake(t) for t in [*value.parameters(), *value.buffers()])
    return False


@contextmanager
def registrations_undone(model: torch.nn.Module) -> Iterator[None]:
    """Within the block (traces of ``model``), note each module's parameters, buffers, submodules and hooks; when
    it ends, put them back, and refuse what the traces registered of fake tensors (see the module's doc)."""
    held = [  # (a scripted module's registries are torch.jit's wrappers, which forward cannot add to)
        (module, kind, dict(registry))
        for module in model.modules()
        for kind in _REGISTRIES
        if isinstance(registry := getattr(module, kind), dict)
    ]
    try:
        yield
    finally:
        faked = _put_back(held)
    if faked:
        paths = {id(module): path for path, module in model.named_modules(remove_duplicate=False)}
        named = [f"{paths[id(module)]}.{name}" if paths.get(id(module)) else name for module, name in faked]
        raise TraceError(
            f"forward registers {', '.join(repr(n) for n in named)} while it is traced (made on the first call): "
            "torch.export runs forward on fake tensors, so what it registered holds no values, and a split could "
            "not hold it. Make it in __init__, or call the model once on real inputs before splitting it, so "
            "that it exists (it was taken out again: the model is as it was)"
        )


def _put_back(held: list[tuple[torch.nn.Module, str, dict[str, Any]]]) -> list[tuple[torch.nn.Module, str]]:
    """Put each registry back as noted; the ``(module, name)`` of what was registered anew of fake tensors."""
    faked = []
    for module, kind, before in held:
        now = getattr(module, kind)
        if len(now) == len(before) and all(now.get(name, _MISSING) is value for name, value in before.items()):
            continue  # unchanged (nearly every registry)
        for name, value in list(now.items()):
            if before.get(name, _MISSING) is not value and _holds_fakes(value):
                faked.append((module, name))
        now.clear()
        now.update(before)
        if kind == "_buffers":
            module._non_persistent_buffers_set.intersection_update(before)
    return faked
