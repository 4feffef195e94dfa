"""Where the traced code read ``torch.is_grad_enabled()``: the grad mode its graph fixed.

Both tracers run the Python of ``forward`` once. Code that branches on the grad
mode (``if torch.is_grad_enabled(): h = h * 2``, ``use_checkpoint = torch.is_grad_enabled()
and self.training``) takes the branch of the mode it was traced under, and the graph keeps
only that branch: a split traced with gradients on and called under ``torch.no_grad()``
would compute what the model computes with gradients on, silently (it did, on both routes).

:func:`recording_grad_reads` notes the reads of ``torch.is_grad_enabled()`` that the model's
own code makes while it is traced (torch's internals and fxsplit's are left out, ``torch.nn``'s
modules are not), with the module and the line. Where a read matters (the model traced
under the other grad mode gives other code: :func:`grad_dependent`), the graph carries a
:class:`GradRead` and the split refuses to run under the other mode
(:func:`check_grad_mode`), naming the reads and the fixes.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple

import torch

from fxsplit.errors import FxsplitError

__all__ = ["GRAD_READS", "GradRead", "check_grad_mode", "grad_dependent", "recording_grad_reads"]

GRAD_READS = "fxsplit_grad_reads"
"""``GraphModule.meta`` key: the :class:`GradRead` of a graph that depends on the grad mode it was traced under."""

_TORCH = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN = os.path.join(_TORCH, "nn") + os.sep
_FXSPLIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DEPTH = 12  # frames looked through for the module whose code read the mode (a helper it called read it)


class GradRead(NamedTuple):
    """The grad mode a graph was traced under, and where the traced code read it.

    Attributes:
        enabled: ``torch.is_grad_enabled()`` while it was traced.
        where: each place that read it, as ``"Block.forward at model.py:12"``, in order of first read.
        modules: the paths of the modules whose code read it (``""``: the model's own forward), in that order.
    """

    enabled: bool
    where: tuple[str, ...]
    modules: tuple[str, ...]


@contextmanager
def recording_grad_reads(model: torch.nn.Module) -> Iterator[list[GradRead]]:
    """Within the block, note where the code of ``model`` run on this thread reads ``torch.is_grad_enabled()``;
    the list holds one :class:`GradRead` (all of them) once the block ends, if there were any."""
    original = torch.is_grad_enabled
    thread = threading.get_ident()
    places: dict[str, None] = {}  # ordered set
    readers: dict[int, torch.nn.Module] = {}  # id -> the module whose code read it (held: ids stay theirs)
    found: list[GradRead] = []

    def is_grad_enabled() -> bool:
        if threading.get_ident() == thread:
            caller = sys._getframe(1)
            filename = caller.f_code.co_filename
            if not _internal(filename):
                name = getattr(caller.f_code, "co_qualname", caller.f_code.co_name)
                places.setdefault(f"{name} at {_short(filename)}:{caller.f_lineno}")
                module = _reading_module(caller)
                if module is not None:
                    readers.setdefault(id(module), module)
        return original()

    torch.is_grad_enabled = is_grad_enabled  # type: ignore[assignment]
    try:
        yield found
    finally:
        torch.is_grad_enabled = original  # type: ignore[assignment]
        if places:
            paths = {id(module): path for path, module in reversed(list(model.named_modules(remove_duplicate=False)))}
            named = tuple(paths[key] for key in readers if key in paths)
            found.append(GradRead(original(), tuple(places), named))


def _internal(filename: str) -> bool:
    """Whether code in ``filename`` is torch's machinery or fxsplit's (torch.nn's modules are model code)."""
    if filename.startswith(_FXSPLIT):
        return True
    return filename.startswith(_TORCH) and not filename.startswith(_TORCH_NN)


def _short(filename: str) -> str:
    return filename.removeprefix(_TORCH) if filename.startswith(_TORCH) else os.path.basename(filename)


def _reading_module(frame: Any) -> torch.nn.Module | None:
    """The module whose method runs in ``frame`` or in one of the frames that called it (its ``self``)."""
    for _ in range(_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(owner, torch.nn.Module):
            return owner
        frame = frame.f_back
    return None


def grad_dependent(read: GradRead, code: str, flipped: Callable[[], str]) -> GradRead | None:
    """``read`` if the graph depends on the grad mode: ``flipped()`` traces again under the other mode and returns
    its code, which differs from ``code`` (or the trace fails); else None."""
    try:
        other = flipped()
    except Exception:  # noqa: BLE001 - the other mode's code may raise anything: it depends on the mode, then
        return read
    return read if other != code else None


def check_grad_mode(read: GradRead | None, what: str = "this split") -> None:
    """Raise if ``read`` says the graph was traced under another grad mode than the caller's."""
    if read is None or torch.is_grad_enabled() == read.enabled:
        return
    traced, now = ("on", "off") if read.enabled else ("off", "on")
    shown = "; ".join(read.where[:3]) + (f" and {len(read.where) - 3} more" if len(read.where) > 3 else "")
    mode = "torch.enable_grad()" if read.enabled else "torch.no_grad()"
    leaves = [path for path in read.modules if path]
    leaf_fix = (
        f", or (with trace='fx') name the modules that read it leaf modules (leaf_modules={leaves[:3]!r}) so that "
        "the split calls them and they read the mode as they run"
        if leaves
        else ""
    )
    raise FxsplitError(
        f"{what} was traced with gradients {traced}, and the model's code read torch.is_grad_enabled() ({shown}): "
        f"the graph kept what it found then, so called with gradients {now} it would not compute what the model "
        f"computes. Call it under {mode}, or split the model under the grad mode you call it in (with "
        f"torch.{'no_grad' if read.enabled else 'enable_grad'}(): fxsplit.fxsplit(...)){leaf_fix}"
    )
