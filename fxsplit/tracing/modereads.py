"""Where the traced code read the grad mode, the autocast state or torch.distributed's: the modes its graph fixed.

Both tracers run the Python of ``forward`` once. Code that branches on the grad
mode (``if torch.is_grad_enabled(): h = h * 2``) or on autocast (Nemotron's, GPT-Neo's
and Falcon's layer norms cast their inputs ``if torch.is_autocast_enabled()``, to
``torch.get_autocast_dtype(...)``) takes the branch of the modes it was traced under,
and the graph keeps only that branch: a split traced with gradients on and called under
``torch.no_grad()``, or traced without autocast and called under it, computed what the
model computes in the traced modes, silently (it did, on both routes). The same holds for
``torch.distributed.is_initialized()``: FLAVA's contrastive head gathers the embeddings of
every rank when a process group is up, and a split planned outside the job kept the local-only
branch when run inside it.

:func:`recording_mode_reads` notes the reads of those modes that the model's own code
makes while it is traced (torch's machinery and fxsplit's are left out, ``torch.nn``'s
modules are not), with the module and the line: through torch's modules, and through the
names the model's code binds to those functions (``from torch.distributed import
is_initialized``). Where a read matters (the model traced under the other mode gives
another graph: :func:`modes_fixed`), the graph carries a :class:`ModeRead` and the split
refuses to run under other modes than those (:func:`check_modes`), naming the reads and
the fixes.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch.amp import autocast_mode

from fxsplit.errors import FxsplitError

__all__ = [
    "AUTOCAST_DEVICES",
    "MODE_READS",
    "ModeRead",
    "Reads",
    "autocast_state",
    "check_modes",
    "fixed_modes_message",
    "modes_fixed",
    "recording_mode_reads",
]

MODE_READS = "fxsplit_mode_reads"
"""``GraphModule.meta`` key: the :class:`ModeRead` of a graph that depends on the modes it was traced under."""

_TORCH = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN = os.path.join(_TORCH, "nn") + os.sep
_FXSPLIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DEPTH = 12  # frames looked through for the module whose code read a mode (a helper it called read it)

AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
"""The device types whose autocast reads are checked (reads of others are not)."""
_IS_GRAD_ENABLED = torch.is_grad_enabled
_AUTOCAST_ENABLED, _AUTOCAST_DTYPE = torch.is_autocast_enabled, torch.get_autocast_dtype
_DISTRIBUTED = "torch.distributed"  # what a read of torch.distributed.is_initialized() notes
_AUTOCAST_READS: dict[str, str | None] = {  # torch's functions that read autocast -> the device type they ask of
    "is_autocast_enabled": "cuda",  # (without an argument)
    "get_autocast_dtype": None,
    "get_autocast_gpu_dtype": "cuda",
    "is_autocast_cpu_enabled": "cpu",
    "get_autocast_cpu_dtype": "cpu",
}


def distributed_initialized() -> bool:
    """``torch.distributed.is_initialized()`` (False where torch has no torch.distributed)."""
    return bool(torch.distributed.is_available() and torch.distributed.distributed_c10d.is_initialized())


def autocast_state(device: str) -> tuple[bool, torch.dtype]:
    """``(enabled, dtype)`` of autocast for ``device`` now."""
    return bool(_AUTOCAST_ENABLED(device)), _AUTOCAST_DTYPE(device)


class ModeRead(NamedTuple):
    """The modes a graph depends on, as they were when it was traced, and where the traced code read them.

    Attributes:
        grad: ``torch.is_grad_enabled()`` while it was traced, if the graph depends on it (else None).
        autocast: ``(device type, enabled, dtype)`` of each device's autocast that the graph depends on.
        where: each place that read a mode, as ``"Block.forward at model.py:12"``, in order of first read.
        modules: the paths of the modules whose code read one (``""``: the model's own forward), in that order.
        distributed: ``torch.distributed.is_initialized()`` while it was traced, if the graph depends on it.
    """

    grad: bool | None
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    where: tuple[str, ...]
    modules: tuple[str, ...]
    distributed: bool | None = None


class Reads(NamedTuple):
    """What :func:`recording_mode_reads` saw: whether the grad mode was read, the autocast devices read, where,
    by which modules, and whether ``torch.distributed.is_initialized()`` was read."""

    grad: bool
    autocast: tuple[str, ...]
    where: tuple[str, ...]
    modules: tuple[str, ...]
    distributed: bool = False


@contextmanager
def recording_mode_reads(model: torch.nn.Module) -> Iterator[list[Reads]]:
    """Within the block, note where the code of ``model`` run on this thread reads the grad mode, the autocast
    state or whether torch.distributed is initialized (through the ``torch.distributed`` module, as models call
    it); the list holds one :class:`Reads` (all of them) once the block ends, if there were any."""
    thread = threading.get_ident()
    places: dict[str, None] = {}  # ordered sets
    devices: dict[str, None] = {}
    grad: list[bool] = []
    distributed: list[bool] = []
    readers: dict[int, torch.nn.Module] = {}  # id -> the module whose code read it (held: ids stay theirs)
    found: list[Reads] = []

    def note(kind: str | None) -> None:
        caller = sys._getframe(2)
        filename = caller.f_code.co_filename
        if threading.get_ident() != thread or internal_code(filename):
            return
        name = getattr(caller.f_code, "co_qualname", caller.f_code.co_name)
        places.setdefault(f"{name} at {short_filename(filename)}:{caller.f_lineno}")
        if kind is None:
            grad[:] = [True]
        elif kind == _DISTRIBUTED:
            distributed[:] = [True]
        else:
            devices.setdefault(kind)
        module = reading_module(caller)
        if module is not None:
            readers.setdefault(id(module), module)

    def watched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        autocast = name in _AUTOCAST_READS

        def read(*args: Any, **kwargs: Any) -> Any:
            value = original(*args, **kwargs)  # (raises first on arguments torch refuses)
            if name == "is_initialized":
                note(_DISTRIBUTED)
                return value
            device = args[0] if args else next(iter(kwargs.values()), _AUTOCAST_READS.get(name))
            note(str(getattr(device, "type", device)) if autocast else None)
            return value

        return read

    names = ["is_grad_enabled", *_AUTOCAST_READS]
    originals = {(torch, name): getattr(torch, name) for name in names if hasattr(torch, name)}
    if torch.distributed.is_available():
        originals[(torch.distributed, "is_initialized")] = torch.distributed.is_initialized
    wrappers = {id(original): watched(name, original) for (_, name), original in originals.items()}
    bound = _bound(model, {id(f): f for f in originals.values()})  # ``from torch import is_grad_enabled``
    for (owner, name), original in originals.items():
        setattr(owner, name, wrappers[id(original)])
    for namespace, name, original in bound:
        namespace[name] = wrappers[id(original)]
    try:
        yield found
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
        for namespace, name, original in bound:
            if namespace.get(name) is wrappers[id(original)]:
                namespace[name] = original
        if places:
            paths = {id(module): path for path, module in reversed(list(model.named_modules(remove_duplicate=False)))}
            named = tuple(paths[key] for key in readers if key in paths)
            found.append(Reads(bool(grad), tuple(devices), tuple(places), named, bool(distributed)))


def _bound(model: torch.nn.Module | None, functions: dict[int, Any]) -> list[tuple[dict[str, Any], str, Any]]:
    """``(namespace, name, function)`` for each global of the model's code bound to one of ``functions`` (by id):
    ``from torch.distributed import is_initialized`` holds the function itself, which patching the module's
    attribute does not reach."""
    if model is None:
        return []
    from fxsplit.tracing.modelcode import model_namespaces  # (it imports this module)

    found = []
    for code in model_namespaces(list(model.modules())):
        namespace = vars(code)
        for name, value in namespace.items():
            if id(value) in functions and functions[id(value)] is value:
                found.append((namespace, name, value))
    return found


def internal_code(filename: str) -> bool:
    """Whether code in ``filename`` is torch's machinery or fxsplit's (torch.nn's modules are model code)."""
    if filename.startswith(_FXSPLIT):
        return True
    return filename.startswith(_TORCH) and not filename.startswith(_TORCH_NN)


def short_filename(filename: str) -> str:
    return filename.removeprefix(_TORCH) if filename.startswith(_TORCH) else os.path.basename(filename)


def reading_module(frame: Any) -> torch.nn.Module | None:
    """The module whose method runs in ``frame`` or in one of the frames that called it (its ``self``)."""
    for _ in range(_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(owner, torch.nn.Module):
            return owner
        frame = frame.f_back
    return None


def modes_fixed(
    reads: Reads,
    key: object,
    traced_under: Callable[[Callable[[], None]], object],
    model: torch.nn.Module | None = None,
) -> ModeRead | None:
    """The :class:`ModeRead` of the modes that ``reads`` read and the graph depends on: ``traced_under(flip)``
    traces again after ``flip()`` turned them the other way, and returns that graph's key, compared with ``key``
    (the traced graph's :class:`~fxsplit.tracing.graphkey.GraphKey`): it differs (or the trace fails). None when
    it depends on none. ``model``: whose code's own names for the functions get the other answer too."""
    grad = _IS_GRAD_ENABLED() if reads.grad and _differs(key, traced_under, _flip_grad) else None
    autocast = tuple(
        (device, *autocast_state(device))
        for device in reads.autocast
        if device in AUTOCAST_DEVICES
        and autocast_mode.is_autocast_available(device)
        and _differs(key, traced_under, functools.partial(_flip_autocast, device))
    )
    distributed = (
        distributed_initialized() if reads.distributed and _differs_distributed(key, traced_under, model) else None
    )
    if grad is None and not autocast and distributed is None:
        return None
    return ModeRead(grad, autocast, reads.where, reads.modules, distributed)


def _differs_distributed(
    key: object, traced_under: Callable[[Callable[[], None]], object], model: torch.nn.Module | None = None
) -> bool:
    """Whether the graph traced with ``torch.distributed.is_initialized()`` answering the other way to the model's
    code differs (the other branch of a model in a job calls collectives, which fail outside one: it differs then).
    torch's machinery still gets the true answer: its logging asks, and then asks for the rank."""
    real, other = torch.distributed.is_initialized, not distributed_initialized()

    def flipped() -> bool:
        return real() if internal_code(sys._getframe(1).f_code.co_filename) else other

    bound = _bound(model, {id(real): real})
    torch.distributed.is_initialized = flipped
    for namespace, name, _ in bound:
        namespace[name] = flipped
    try:
        return _differs(key, traced_under, lambda: None)
    finally:
        torch.distributed.is_initialized = real
        for namespace, name, _ in bound:
            if namespace.get(name) is flipped:
                namespace[name] = real


def _flip_grad() -> None:
    torch._C._set_grad_enabled(not _IS_GRAD_ENABLED())


def _flip_autocast(device: str) -> None:
    enabled, _ = autocast_state(device)
    torch.set_autocast_enabled(device, not enabled)


def _differs(key: object, traced_under: Callable[[Callable[[], None]], object], flip: Callable[[], None]) -> bool:
    try:
        return traced_under(flip) != key
    except Exception:  # noqa: BLE001 - the other mode's code may raise anything: it depends on the mode, then
        return True


def check_modes(read: ModeRead | None, what: str = "this split") -> None:
    """Raise if ``read`` says the graph was traced under another grad mode, autocast or torch.distributed state
    than the caller's."""
    if read is None:
        return
    changed = _traced_modes(read, only_changed=True)
    if not changed:
        return
    it, mode = ("that mode", "mode") if len(changed) == 1 else ("those modes", "modes")
    raise FxsplitError(
        f"{what} was traced with {' and '.join(changed)}, and the model's code read {it} ({_places(read)}): the "
        f"graph kept what it found then, so called under another {mode} it would not compute what the model "
        f"computes. Call it under the {mode} it was traced with, or split the model under the {mode} you call it in "
        f"(inside the same `with` block as the call: with torch.no_grad(): fxsplit.fxsplit(...)"
        f"{_DISTRIBUTED_FIX if read.distributed is not None and read.distributed != distributed_initialized() else ''})"
        f"{_leaf_fix(read, it)}"
    )


_DISTRIBUTED_FIX = "; for torch.distributed, in the job, after torch.distributed.init_process_group(...)"


def fixed_modes_message(read: ModeRead, what: str) -> str:
    """That ``what`` computes as the model does only under the modes ``read`` fixed, and what to do about it."""
    modes = _traced_modes(read, only_changed=False)
    return (
        f"the model's code read the grad mode, autocast or torch.distributed's state ({_places(read)}), and the "
        "graph fixed what it found then "
        f"({' and '.join(modes)}): {what} computes what the model computes only under those modes; run it under "
        f"them, or trace the model under the modes you run it in{_leaf_fix(read, 'them')}"
    )


def _traced_modes(read: ModeRead, *, only_changed: bool) -> list[str]:
    """The modes ``read`` fixed, in words (``only_changed``: those the caller's modes differ from now)."""
    found = []
    if read.grad is not None and not (only_changed and _IS_GRAD_ENABLED() == read.grad):
        found.append(f"gradients {'on' if read.grad else 'off'} (torch.{'enable_grad' if read.grad else 'no_grad'}())")
    for device, enabled, dtype in read.autocast:
        now_enabled, now_dtype = autocast_state(device)
        if only_changed and now_enabled == enabled and (not enabled or now_dtype == dtype):
            continue
        found.append(
            f"autocast for {device} "
            + (
                f"on at {str(dtype).removeprefix('torch.')} (torch.autocast({device!r}, dtype={dtype}))"
                if enabled
                else "off"
            )
        )
    if read.distributed is not None and not (only_changed and distributed_initialized() == read.distributed):
        found.append(f"torch.distributed {'initialized' if read.distributed else 'not initialized'}")
    return found


def _places(read: ModeRead) -> str:
    return "; ".join(read.where[:3]) + (f" and {len(read.where) - 3} more" if len(read.where) > 3 else "")


def _leaf_fix(read: ModeRead, it: str) -> str:
    leaves = [path for path in read.modules if path]
    if not leaves:
        return ""
    return (
        f", or (with trace='fx') name the modules that read {it} leaf modules (leaf_modules={leaves[:3]!r}) so that "
        "the split calls them and they read the modes as they run"
    )
