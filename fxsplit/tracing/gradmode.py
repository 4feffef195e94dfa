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

``torch.autocast`` regions (``with torch.autocast("cuda", dtype=torch.bfloat16):``, or
``enabled=False`` around code that must stay in float32 under the caller's autocast) are lost the
same way; they are recorded as torch.amp's own pair of calls (what torch.export's pre-dispatch
graphs hold)::

    _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, True)
    ...                                             # the block
    _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast)

(torch.export keeps a region as one ``wrap_with_autocast`` call of a submodule.) Both kinds are *mode
regions* (:func:`is_mode_node`, :func:`open_regions`); :func:`modes_kept` puts the caller's modes
back around a run of such a graph, whatever it leaves set when an op inside a region raises.

``torch.inference_mode()`` has no such form and torch.export drops it without
a word (its tensors would get gradients), so both routes refuse it
(:func:`refusing_inference_mode`) with a :class:`~fxsplit.errors.TraceError`.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx
from torch.amp import autocast_mode
from torch.autograd import grad_mode

from fxsplit.errors import TraceError

__all__ = [
    "AUTOCAST_FUNCTIONS",
    "GRAD_MODE_FUNCTIONS",
    "autocast_devices",
    "is_grad_mode_node",
    "is_mode_node",
    "modes_kept",
    "open_regions",
    "recording_grad_mode",
    "refusing_inference_mode",
    "region_spans",
]

GRAD_MODE_FUNCTIONS: tuple[Callable[..., Any], ...] = (torch.is_grad_enabled, torch._C._set_grad_enabled)
"""The calls a recorded grad-mode region is made of; neither returns a tensor."""
_IS_GRAD_ENABLED = GRAD_MODE_FUNCTIONS[0]  # torch's own, also while modereads.py watches the model's calls of it
_ENTER_AUTOCAST, _EXIT_AUTOCAST = autocast_mode._enter_autocast, autocast_mode._exit_autocast
AUTOCAST_FUNCTIONS: tuple[Callable[..., Any], ...] = (_ENTER_AUTOCAST, _EXIT_AUTOCAST)
"""The calls a recorded autocast region is made of; neither returns a tensor."""
_AUTOCAST_NODES = "_fxsplit_autocast_nodes"

_PREV = "_fxsplit_prev_modes"
_INIT_PREV = "_fxsplit_init_prev"


def is_grad_mode_node(node: torch.fx.Node) -> bool:
    """True for a node that reads or sets the grad mode (a side effect: keep it, in order)."""
    return node.op == "call_function" and any(node.target is f for f in GRAD_MODE_FUNCTIONS)


def is_mode_node(node: torch.fx.Node) -> bool:
    """True for a node of a recorded mode region: grad mode or autocast (a side effect, no tensor)."""
    return is_grad_mode_node(node) or (node.op == "call_function" and node.target in AUTOCAST_FUNCTIONS)


def autocast_devices(graph: torch.fx.Graph) -> tuple[str, ...]:
    """The device types of the autocast regions recorded in ``graph``, in order of first entry."""
    found = [str(n.args[0]) for n in graph.nodes if n.op == "call_function" and n.target is _ENTER_AUTOCAST]
    return tuple(dict.fromkeys(found))


def open_regions(nodes: list[torch.fx.Node], *, after: bool = False) -> list[int]:
    """For each node, how many recorded mode regions are open when it runs (0: the caller's modes), or,
    with ``after``, once it has run (a cut there falls inside them).

    A grad-mode region opens at ``torch.is_grad_enabled()`` (the saved mode) and
    closes at the ``_set_grad_enabled`` that restores it; a mode set and never
    restored (a bare ``torch.set_grad_enabled(False)``) stays open to the end.
    An autocast region opens at ``_enter_autocast`` and closes at its ``_exit_autocast``.
    """
    depth, found = 0, []
    for node in nodes:
        calls = node.op == "call_function"
        if calls and node.target is torch._C._set_grad_enabled:
            if node.args and isinstance(node.args[0], torch.fx.Node):
                depth -= 1
        elif calls and node.target is _EXIT_AUTOCAST:
            depth -= 1
        if not after:
            found.append(depth)
        if calls and (node.target is _IS_GRAD_ENABLED or node.target is _ENTER_AUTOCAST):
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
            saved = self.call(_IS_GRAD_ENABLED)
        manager.__dict__.setdefault(_PREV, []).append(saved)
        self.call(torch._C._set_grad_enabled, mode)

    def exit(self, manager: Any) -> None:
        saved = manager.__dict__.get(_PREV)
        if saved:
            self.call(torch._C._set_grad_enabled, saved.pop())

    def init(self, manager: Any, mode: bool) -> None:
        manager.__dict__[_INIT_PREV] = self.call(_IS_GRAD_ENABLED)
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

    def enter_autocast(self, manager: Any) -> None:
        state = (manager.device, manager.fast_dtype, manager._enabled, manager._cache_enabled)
        manager.__dict__.setdefault(_AUTOCAST_NODES, []).append(self.call(_ENTER_AUTOCAST, *state))

    def exit_autocast(self, manager: Any) -> None:
        entered = manager.__dict__.get(_AUTOCAST_NODES)
        if entered:
            self.call(_EXIT_AUTOCAST, entered.pop())

    def patches(self) -> list[tuple[type, str, Callable[..., Any]]]:
        no_grad, enable_grad, set_grad = grad_mode.no_grad, grad_mode.enable_grad, grad_mode.set_grad_enabled
        autocast = autocast_mode.autocast
        records: list[tuple[type, str, Callable[..., None]]] = [
            (autocast, "__enter__", self.enter_autocast),
            (autocast, "__exit__", lambda m, *exc: self.exit_autocast(m)),
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


def _transform_depth() -> int:
    """How many functorch transforms (``vmap``, ``grad``...) are active: an exported graph enters and leaves the
    ``vmap`` regions of the model's code as nodes of its own (``_vmap_increment_nesting``)."""
    return len(torch._C._functorch.get_interpreter_stack() or ())


def _leave_transforms(depth: int) -> None:
    """Leave the functorch transforms entered beyond ``depth`` (with them active, a later ``backward()`` refuses to
    run: "backward() called inside a functorch transform")."""
    functorch = torch._C._functorch
    leave = {
        functorch.TransformType.Vmap: functorch._vmap_decrement_nesting,
        functorch.TransformType.Grad: functorch._grad_decrement_nesting,
        functorch.TransformType.Jvp: functorch._jvp_decrement_nesting,
        functorch.TransformType.Functionalize: functorch._func_decrement_nesting,
    }
    while _transform_depth() > depth:
        leave[functorch.peek_interpreter_stack().key()]()


def _autocast_depth() -> int:
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


@contextlib.contextmanager
def modes_kept(devices: Iterable[str] = ("cpu", "cuda")) -> Iterator[None]:
    """Put the grad mode, the autocast state of ``devices`` and the functorch transforms back as they were when the
    block ends, whatever the code run inside set and did not restore (an op inside a recorded region raised)."""
    grad = torch.is_grad_enabled()
    devices = [d for d in devices if autocast_mode.is_autocast_available(d)]
    autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]
    cache, depth, transforms = torch.is_autocast_cache_enabled(), _autocast_depth(), _transform_depth()
    try:
        yield
    finally:
        _leave_transforms(transforms)  # a vmap region of the graph (transformers' masks) left open by an op raising
        torch._C._set_grad_enabled(grad)
        for device, enabled, dtype in autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(cache)
        for _ in range(_autocast_depth() - depth):  # regions entered and never left
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()


@contextlib.contextmanager
def recording_grad_mode(tracer: torch.fx.Tracer) -> Iterator[None]:
    """While tracing with ``tracer``, record grad-mode and autocast changes as graph nodes; refuse inference
    mode."""
    with modes_kept(), _patched(_Recorder(tracer).patches()), refusing_inference_mode("torch.fx"):
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
