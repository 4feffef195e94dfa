"""Numbers the model's code draws from Python's or NumPy's generator while it is traced: fixed in the graph.

LayerDrop (wav2vec2, HuBERT, WavLM, Data2VecAudio, MusicGen, VITS and other models in transformers) draws
``np.random.random()`` or ``random.uniform(0, 1)`` in ``forward`` and skips a layer, in training, when the draw
is under ``layerdrop``. Both tracers run ``forward`` once, and the graph keeps that run's outcome: a split traced
in ``train()`` mode skipped the same layers on every call, and they never got a gradient (3 of 6 layers of a
model with ``layerdrop=0.5``, on fx and export, with no warning). A draw used as a number (a random scale) became
a constant the same way.

:func:`recording_draws` notes the draws the model's own code makes while it is traced, with the line and the module
(torch's and fxsplit's code is left out): through the module-level functions of ``random`` and ``numpy.random``
(:data:`WATCHED`), called through the module or bound to a name of the model's code (``from random import
uniform``), and through generator objects the model holds (``self.rng = np.random.default_rng(0)``,
``random.Random(0)``): :mod:`fxsplit.tracing.drawsources`. :meth:`Draws.refuse_if_fixed` decides whether the graph
depends on them: the model traced again with every draw pinned to the low end of its range, and again at the high
end, gives other code or other constants (whatever the first trace drew, a comparison with a threshold inside the
range comes out the other way at one of the ends, and a drawn number changes). Then tracing is refused with a
:class:`~fxsplit.errors.TraceError` that names the draws and the fixes. A model that draws in ``eval()`` mode
without using the draw (wav2vec2's adapter does) is planned as before, after the two more traces; a model that
draws nothing is traced once.

Not seen: a generator object held deeper than an object a module holds (``self.config.rng`` is seen), and a
drawing function bound to a name two imports away from the model's code (:mod:`~fxsplit.tracing.drawsources`).
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from fxsplit.errors import TraceError
from fxsplit.tracing.drawsources import WATCHED, by_model_code, generator_states, restore_states, watching
from fxsplit.tracing.graphkey import GraphKey
from fxsplit.tracing.modereads import reading_module, short_filename

__all__ = ["WATCHED", "Draws", "recording_draws"]


@dataclass
class Draws:
    """The draws noted by :func:`recording_draws`: where (``"Encoder.forward at model.py:12"``, in order of first
    draw), by which function, and which modules' code drew (by identity, until named)."""

    model: torch.nn.Module
    where: dict[str, None] = field(default_factory=dict)  # (ordered sets)
    functions: dict[str, None] = field(default_factory=dict)
    modules: dict[int, torch.nn.Module] = field(default_factory=dict)
    pinned: int | None = None  # while set, each draw is pinned to that end of its range (0: low, 1: high)
    held: list[Any] = field(default_factory=list)  # the generator objects the model holds (their states go back too)

    def refuse_if_fixed(self, graph_module: torch.fx.GraphModule, retraced: Callable[[], torch.fx.GraphModule]) -> None:
        """Raise a :class:`TraceError` if ``graph_module`` depends on the draws: ``retraced()`` traces again with
        every draw pinned to the low end of its range, then (if that gave the same graph) to the high end, and one
        of them gives another graph (:class:`~fxsplit.tracing.graphkey.GraphKey`: a drawn array made a tensor
        counts), or fails. The generators' states are put back after: those traces draw nothing of the caller's.

        Whatever the first trace drew, a comparison of a draw with a threshold inside its range comes out one way
        at one end and the other way at the other, so one of the two differs from it (and a drawn number does)."""
        if not self.where:
            return
        states = generator_states(self.held)
        key = GraphKey(graph_module, self.model)
        differs = False
        try:
            for end in (0, 1):
                self.pinned = end
                try:
                    differs = GraphKey(retraced(), self.model) != key
                except Exception:  # noqa: BLE001 - code run on other draws may raise anything: it depends on them
                    differs = True
                if differs:
                    break
        finally:
            self.pinned = None
            restore_states(self.held, states)
        if differs:
            raise TraceError(self._message())

    def _message(self) -> str:
        paths = {id(module): path for path, module in reversed(list(self.model.named_modules(remove_duplicate=False)))}
        named = [paths[key] for key in self.modules if key in paths and paths[key]]
        where = list(self.where)
        places = "; ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        leaves = (
            f"; or, with trace='fx', make the modules that draw leaf modules (leaf_modules={named[:3]!r}): the split "
            "calls them, and they draw on every call"
            if named
            else ""
        )
        return (
            f"the model's code draws random numbers while it runs ({', '.join(self.functions)}: {places}), and what "
            "it computes depends on the draws (LayerDrop or stochastic depth skipping layers, or a random scale). "
            "A graph keeps the draws of the one run that traced it, so a split would skip the same layers, or use "
            "the same numbers, on every call. Plan the model in eval() mode (model.eval(): LayerDrop and the like "
            f"draw only in training), or switch the feature off (e.g. layerdrop=0 in a Hugging Face config){leaves}"
        )


@contextmanager
def recording_draws(model: torch.nn.Module) -> Iterator[Draws]:
    """Within the block, note the draws that the code of ``model`` run on this thread makes with the functions
    of :data:`WATCHED` (and, while :attr:`Draws.pinned` is set, pin each to that end of its range)."""
    thread = threading.get_ident()
    draws = Draws(model)

    def watched(original: Callable[..., Any], label: str, pinned: Callable[..., Any]) -> Callable[..., Any]:
        def draw(*args: Any, **kwargs: Any) -> Any:
            value = original(*args, **kwargs)
            caller = sys._getframe(1)
            if not by_model_code(thread, caller):
                return value
            filename = caller.f_code.co_filename
            qualname = getattr(caller.f_code, "co_qualname", caller.f_code.co_name)
            draws.where.setdefault(f"{qualname} at {short_filename(filename)}:{caller.f_lineno}")
            draws.functions.setdefault(f"{label}()")
            owner = reading_module(caller)
            if owner is not None:
                draws.modules.setdefault(id(owner), owner)
            return value if draws.pinned is None else pinned(value, draws.pinned, *args, **kwargs)

        return draw

    with watching(model, watched) as held:
        draws.held = held
        yield draws
