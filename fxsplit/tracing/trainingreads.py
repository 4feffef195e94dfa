"""Which modules' ``training`` flag a torch.fx trace read: the train/eval behaviour its graph fixed.

torch.fx runs the Python of ``forward``: ``F.dropout(x, p, self.training)`` records the flag it read as a
constant, and ``if self.training:`` takes one branch. The graph keeps what the mode was when it was traced, so
``split.eval()`` of a split traced in training mode would change nothing in those modules (dropout still on,
batch statistics still used), silently. Leaf modules are called by the split and read their flag when they run.

:func:`recording_training_reads` notes every read of a module's ``training`` while the trace runs (a property on
``torch.nn.Module`` for the block: a data descriptor on the class comes before the instance's own attribute), by
module path, with the value read. Where they matter (:func:`mode_dependent`: the graph traced with each of
those flags the other way differs), the split refuses to be switched to another mode than one of those
(:class:`~fxsplit.codegen.splitmodule.ModeReadSplit`); reads that change nothing (a stochastic depth of
probability 0: ``if p == 0 or not self.training: return x``) leave it free.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

import torch

__all__ = ["TRAINING_READS", "mode_dependent", "recording_training_reads"]

TRAINING_READS = "fxsplit_training_reads"
"""``GraphModule.meta`` key: module path (``""``: the model) -> the ``training`` flag the trace read there."""

_MISSING = object()


@contextmanager
def recording_training_reads(
    model: torch.nn.Module, flipped: Mapping[str, bool] | None = None
) -> Iterator[dict[str, bool]]:
    """Within the block, the ``training`` flags of ``model``'s modules that this thread reads, by module path (the
    dict is filled as the block ends); ``flipped``: the paths of modules that read the other value than they hold
    (the model itself is not changed)."""
    flipped_ids = {id(model.get_submodule(path)) for path in flipped or ()}
    seen: dict[int, tuple[torch.nn.Module, bool]] = {}  # id -> (module, the flag read): paths only if any
    read: dict[str, bool] = {}
    thread = threading.get_ident()

    def get(module: torch.nn.Module) -> bool:
        try:
            value: bool = module.__dict__["training"]
        except KeyError:
            raise AttributeError("training") from None
        if threading.get_ident() == thread:
            seen.setdefault(id(module), (module, value))
            if id(module) in flipped_ids:
                return not value
        return value

    def set_(module: torch.nn.Module, value: bool) -> None:
        module.__dict__["training"] = value

    before = torch.nn.Module.__dict__.get("training", _MISSING)
    torch.nn.Module.training = property(get, set_)  # type: ignore[assignment]
    try:
        yield read
    finally:
        if seen:  # each module under its first path (``seen`` holds the modules: their ids stay theirs)
            named: set[int] = set()
            for path, module in model.named_modules(remove_duplicate=False):
                if id(module) in seen and id(module) not in named:
                    named.add(id(module))
                    read[path] = seen[id(module)][1]
        if before is _MISSING:
            del torch.nn.Module.training
        else:
            torch.nn.Module.training = before  # type: ignore[assignment]


def mode_dependent(
    read: dict[str, bool], graph: torch.fx.Graph, flipped: Callable[[], torch.fx.Graph]
) -> dict[str, bool]:
    """``read`` if the graph depends on it: ``flipped()`` traces again with those flags the other way (under
    :func:`recording_training_reads` with them), and its code differs or the trace fails; else empty."""
    if not read:
        return read
    try:
        other = flipped()
    except Exception:  # noqa: BLE001 - the other mode's code may raise anything: it depends on the mode, then
        return read
    return read if other.python_code("self").src != graph.python_code("self").src else {}
