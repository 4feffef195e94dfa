"""The class of every torch.fx split: a ``GraphModule`` that ``torch.save`` keeps whole.

torch pickles a ``GraphModule`` as its code, its submodules and its attributes,
and loads it back as a plain ``GraphModule`` traced again from that code: without
its class and without ``meta``. A split is more than its code: the model's own hooks
that its graph lacks, the refusal of modes it was not traced in (``train()``/``eval()``,
grad mode, autocast: :mod:`fxsplit.codegen.splitmodule`), its plan. Loaded as a plain
``GraphModule``, a split with the model's forward hook returned another output than
the model, silently. :class:`Split` pickles as torch does, and puts those back on
load: its class, its ``meta`` (the plan among it), and the attributes it keeps on
copy (:func:`~fxsplit.codegen.meta.kept_on_copy`). A :class:`Split` also refuses a ``.to(device)`` that would
take a weight off its planned device (a pipeline stage, which runs on one device, does not).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.amp import autocast_mode

from fxsplit.codegen.meta import kept_on_copy, kept_on_copy_attributes
from fxsplit.errors import FxsplitError

__all__ = ["Reloadable", "Split", "refuse_move"]


class Reloadable(torch.fx.GraphModule):
    """A ``GraphModule`` that ``torch.save`` / ``torch.load(weights_only=False)`` give back as it was: its class,
    ``meta``, kept attributes and mode regions (a pipeline stage is one)."""

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        rebuild, arguments = super().__reduce__()
        return _reloaded, (rebuild, arguments, _own_class(type(self)), dict(self.meta))


class Split(Reloadable):
    """A split's ``GraphModule``: :class:`Reloadable`, and ``to()``, ``cuda()`` and ``cpu()`` that would move a
    weight to another device raise (:func:`refuse_move`); changing the dtype (``split.to(torch.bfloat16)``,
    ``.half()``) works as for any module.
    """

    def to(self, *args: Any, **kwargs: Any) -> Any:
        refuse_move(self, torch._C._nn._parse_to(*args, **kwargs)[0])
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> Any:
        refuse_move(self, torch.device("cuda", device) if isinstance(device, int) else device or "cuda")
        return super().cuda(device)

    def cpu(self) -> Any:
        refuse_move(self, "cpu")
        return super().cpu()


def refuse_move(module: torch.nn.Module, device: Any, what: str = "this split") -> None:
    """Raise if moving ``module`` to ``device`` would take a weight off the device its plan put it on: the split
    runs across its devices (its code copies values to each), so one ``.to(device)`` breaks it (None: no move)."""
    if device is None:
        return
    target = torch.device(device)
    if target.type == "cuda" and target.index is None and torch.cuda.is_available():
        target = torch.device("cuda", torch.cuda.current_device())  # (where .to("cuda") puts a tensor)
    held = {str(t.device): t.device for t in (*module.parameters(), *module.buffers())}
    if all(d.type == target.type and (target.index in (None, d.index) or d.type == "cpu") for d in held.values()):
        return
    plan = getattr(module, "meta", {}).get("fxsplit_plan") or getattr(getattr(module, "split", None), "meta", {}).get(
        "fxsplit_plan"
    )
    devices = ", ".join(plan.devices) if plan is not None else ", ".join(sorted(held))
    raise FxsplitError(
        f"{what} runs across {devices} (its code copies values from one to another), so moving "
        f"its weights to {target} would break it. To run the model on other devices, split it for those (budgets "
        "naming them); to change only the dtype, pass just the dtype (.to(torch.bfloat16))"
    )


def _own_class(cls: type) -> type:
    """The split class ``cls`` is made from (each ``GraphModule`` is an instance of a class of its own)."""
    return next(c for c in cls.__mro__ if issubclass(c, Reloadable) and "GraphModuleImpl" not in c.__qualname__)


def _reloaded(
    rebuild: Callable[..., torch.fx.GraphModule], arguments: tuple[Any, ...], cls: type, meta: dict[str, Any]
) -> torch.fx.GraphModule:
    """torch's reloaded ``GraphModule``, made a ``cls`` again with its ``meta`` and the attributes it kept."""
    with _mode_calls_recorded():
        loaded = rebuild(*arguments)
    loaded.__class__ = type(type(loaded).__name__, (cls,), {})  # a class of its own, as GraphModule.__new__ makes
    loaded.recompile()  # (its forward lives on that class)
    loaded.meta.update(meta)
    kept_on_copy(loaded, **kept_on_copy_attributes(meta))
    return loaded


_GENERATED = "<eval_with_key>"  # the file name of the code torch.fx generates
_MODE_CALLS = (  # (owner, name) of the calls a recorded mode region is made of (fxsplit.tracing.gradmode)
    (torch, "is_grad_enabled"),
    (torch._C, "_set_grad_enabled"),
    (autocast_mode, "_enter_autocast"),
    (autocast_mode, "_exit_autocast"),
)


@contextmanager
def _mode_calls_recorded() -> Iterator[None]:
    """While torch traces a loaded split's code again, its calls that set the grad mode or autocast become nodes
    again (a trace runs them instead, as it runs any call of constants: the regions were lost, and the loaded
    split computed its ``no_grad`` and autocast regions as plain code)."""
    tracers: list[torch.fx.Tracer] = []
    trace = torch.fx.Tracer.trace

    def tracing(self: torch.fx.Tracer, *args: Any, **kwargs: Any) -> Any:
        tracers.append(self)
        try:
            return trace(self, *args, **kwargs)
        finally:
            tracers.pop()

    def recorded(function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            if tracers and sys._getframe(1).f_code.co_filename.startswith(_GENERATED):
                return tracers[-1].create_proxy("call_function", function, args, {})
            return function(*args)

        return call

    originals = [(owner, name, getattr(owner, name)) for owner, name in _MODE_CALLS]
    torch.fx.Tracer.trace = tracing  # type: ignore[method-assign]
    for owner, name, function in originals:
        setattr(owner, name, recorded(function))
    try:
        yield
    finally:
        torch.fx.Tracer.trace = trace  # type: ignore[method-assign]
        for owner, name, function in originals:
            setattr(owner, name, function)
