"""Keep ``torch.no_grad()`` and its relatives in traced graphs.

``torch.fx.symbolic_trace`` runs ``forward`` once with proxies: a ``with
torch.no_grad():`` block then only changes the grad mode *while tracing* and
leaves nothing in the graph, so the split would record gradients the model
never computes. While fxsplit traces with torch.fx, :func:`recording_grad_mode`
makes the grad-mode context managers (``no_grad``, ``enable_grad``,
``set_grad_enabled``, as ``with`` blocks or decorators) write what they do into
the graph, in order, the way torch.export's older graphs did::

    is_grad_enabled = torch.is_grad_enabled()      # the caller's mode, at run time
    _set_grad_enabled = torch._C._set_grad_enabled(False)
    ...                                             # the block
    _set_grad_enabled_1 = torch._C._set_grad_enabled(is_grad_enabled)

``torch.inference_mode()`` has no such form and torch.export drops it without
a word (its tensors would get gradients), so both routes refuse it
(:func:`refusing_inference_mode`) with a :class:`~fxsplit.errors.TraceError`.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.autograd import grad_mode

from fxsplit.errors import TraceError

__all__ = [
    "GRAD_MODE_FUNCTIONS",
    "is_grad_mode_node",
    "open_regions",
    "recording_grad_mode",
    "refusing_inference_mode",
    "region_spans",
]

GRAD_MODE_FUNCTIONS: tuple[Callable[..., Any], ...] = (torch.is_grad_enabled, torch._C._set_grad_enabled)
"""The calls a recorded grad-mode region is made of; neither returns a tensor."""

_PREV = "_fxsplit_prev_modes"
_INIT_PREV = "_fxsplit_init_prev"


def is_grad_mode_node(node: torch.fx.Node) -> bool:
    """True for a node that reads or sets the grad mode (a side effect: keep it, in order)."""
    return node.op == "call_function" and any(node.target is f for f in GRAD_MODE_FUNCTIONS)


def open_regions(nodes: list[torch.fx.Node], *, after: bool = False) -> list[int]:
    """For each node, how many recorded grad-mode regions are open when it runs (0: the caller's mode), or,
    with ``after``, once it has run (a cut there falls inside them).

    A region opens at ``torch.is_grad_enabled()`` (the saved mode) and closes
    at the ``_set_grad_enabled`` that restores it; a mode set and never
    restored (a bare ``torch.set_grad_enabled(False)``) stays open to the end.
    """
    depth, found = 0, []
    for node in nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            if node.args and isinstance(node.args[0], torch.fx.Node):
                depth -= 1
        if not after:
            found.append(depth)
        if node.op == "call_function" and node.target is torch.is_grad_enabled:
            depth += 1
        if after:
            found.append(depth)
    return found


def region_spans(ops: list[torch.fx.Node]) -> list[tuple[int, int]]:
    """``(first, last)`` op indices of each run of ``ops`` that no cut may separate: a cut between two ops inside
    a grad-mode region would leave the mode set in one stage and restored in another."""
    spans: list[tuple[int, int]] = []
    for at, depth in enumerate(open_regions(ops, after=True)[:-1]):
        if depth > 0:  # no cut between op ``at`` and the next
            if spans and spans[-1][1] == at:
                spans[-1] = (spans[-1][0], at + 1)
            else:
                spans.append((at, at + 1))
    return spans


class _Recorder:
    """Patched methods of the grad-mode context managers that also record nodes on a tracer.

    Each patched method records what it does, then runs the original quietly:
    ``no_grad`` is built on ``set_grad_enabled``, whose own recording would
    otherwise add a restore to the mode seen while tracing.
    """

    def __init__(self, tracer: torch.fx.Tracer) -> None:
        self.tracer = tracer
        self.inside = 0

    def call(self, function: Callable[..., Any], *args: Any) -> torch.fx.Proxy:
        return self.tracer.create_proxy("call_function", function, args, {})

    def enter(self, manager: Any, mode: bool) -> None:
        saved = manager.__dict__.pop(_INIT_PREV, None)  # set_grad_enabled saved it when made
        if saved is None:
            saved = self.call(torch.is_grad_enabled)
        manager.__dict__.setdefault(_PREV, []).append(saved)
        self.call(torch._C._set_grad_enabled, mode)

    def exit(self, manager: Any) -> None:
        saved = manager.__dict__.get(_PREV)
        if saved:
            self.call(torch._C._set_grad_enabled, saved.pop())

    def init(self, manager: Any, mode: bool) -> None:
        manager.__dict__[_INIT_PREV] = self.call(torch.is_grad_enabled)
        self.call(torch._C._set_grad_enabled, mode)

    def decorate(self, manager: Any) -> None:
        saved = manager.__dict__.pop(_INIT_PREV, None)  # used as a decorator: the mode goes back at once
        if saved is not None:
            self.call(torch._C._set_grad_enabled, saved)

    def wrap(self, original: Callable[..., Any], record: Callable[..., None]) -> Callable[..., Any]:
        """``original`` that first records (unless called from another patched method)."""
        recorder = self

        def method(manager: Any, *args: Any) -> Any:
            if recorder.inside == 0:
                record(manager, *args)
            recorder.inside += 1
            try:
                return original(manager, *args)
            finally:
                recorder.inside -= 1

        return method

    def patches(self) -> list[tuple[type, str, Callable[..., Any]]]:
        no_grad, enable_grad, set_grad = grad_mode.no_grad, grad_mode.enable_grad, grad_mode.set_grad_enabled
        records: list[tuple[type, str, Callable[..., None]]] = [
            (no_grad, "__enter__", lambda m: self.enter(m, False)),
            (no_grad, "__exit__", lambda m, *exc: self.exit(m)),
            (enable_grad, "__enter__", lambda m: self.enter(m, True)),
            (enable_grad, "__exit__", lambda m, *exc: self.exit(m)),
            (set_grad, "__init__", self.init),
            (set_grad, "__call__", lambda m, function: self.decorate(m)),
            (set_grad, "__enter__", lambda m: self.enter(m, m.mode)),
            (set_grad, "__exit__", lambda m, *exc: self.exit(m)),
        ]
        return [(cls, name, self.wrap(cls.__dict__[name], record)) for cls, name, record in records]


@contextlib.contextmanager
def _patched(patches: list[tuple[type, str, Callable[..., Any]]]) -> Iterator[None]:
    saved = [(cls, name, cls.__dict__[name]) for cls, name, _ in patches]
    try:
        for cls, name, method in patches:
            setattr(cls, name, method)
        yield
    finally:
        for cls, name, method in saved:
            setattr(cls, name, method)


@contextlib.contextmanager
def _grad_mode_kept() -> Iterator[None]:
    """Put the grad mode back as it was, whatever the traced code set and did not restore."""
    before = torch.is_grad_enabled()
    try:
        yield
    finally:
        torch._C._set_grad_enabled(before)


@contextlib.contextmanager
def recording_grad_mode(tracer: torch.fx.Tracer) -> Iterator[None]:
    """While tracing with ``tracer``, record grad-mode changes as graph nodes; refuse inference mode."""
    with _grad_mode_kept(), _patched(_Recorder(tracer).patches()), refusing_inference_mode("torch.fx"):
        yield


@contextlib.contextmanager
def refusing_inference_mode(route: str) -> Iterator[None]:
    """Raise a :class:`TraceError` if the traced code enters ``torch.inference_mode()``."""
    cls = grad_mode.inference_mode
    original = cls.__dict__["__enter__"]

    def refuse(self: Any) -> None:
        if not self.mode:  # inference_mode(False) outside inference mode changes nothing (export uses it)
            return original(self)
        where = _caller_line()
        raise TraceError(
            f"forward() enters torch.inference_mode({self.mode})"
            + (f" at {where}" if where else "")
            + f"; {route} cannot keep it in the graph, so the split would compute gradients where the model "
            "computes none. Use torch.no_grad() there (fxsplit keeps it on both trace routes), or call the "
            "split model under torch.inference_mode() instead"
        )

    with _patched([(cls, "__enter__", refuse)]):
        yield


def _caller_line() -> str:
    """The innermost frame of the current stack outside torch and fxsplit, as 'file:line: code'."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and "/fxsplit/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}: {frame.line}"
    return ""
