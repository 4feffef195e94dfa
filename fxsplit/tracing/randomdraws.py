"""Numbers the model's code draws from Python's or NumPy's generator while it is traced: fixed in the graph.

LayerDrop (wav2vec2, HuBERT, WavLM, Data2VecAudio, MusicGen, VITS and other models in transformers) draws
``np.random.random()`` or ``random.uniform(0, 1)`` in ``forward`` and skips a layer, in training, when the draw
is under ``layerdrop``. Both tracers run ``forward`` once, and the graph keeps that run's outcome: a split traced
in ``train()`` mode skipped the same layers on every call, and they never got a gradient (3 of 6 layers of a
model with ``layerdrop=0.5``, on fx and export, with no warning). A draw used as a number (a random scale) became
a constant the same way.

:func:`recording_draws` notes the draws the model's own code makes while it is traced (the module-level functions
of ``random`` and ``numpy.random`` listed in :data:`WATCHED`; torch's and fxsplit's code is left out), with the
line and the module. :meth:`Draws.refuse_if_fixed` decides whether the graph depends on them: the model traced
again with every draw turned to the other end of its range (a draw below the middle to the top, one above it to
the bottom, so any comparison with a threshold inside the range turns out the other way, and a number changes)
gives other code. Then tracing is refused with a :class:`~fxsplit.errors.TraceError` that names the draws and
the fixes. A model that draws in ``eval()`` mode without using the draw (wav2vec2 does) traces as before, after
the second trace; a model that draws nothing is traced once.

Not seen: a generator object of the model's own (``numpy.random.default_rng()``, ``random.Random()``), and
functions imported by name before tracing (``from random import uniform``).
"""

from __future__ import annotations

import random
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from fxsplit.errors import TraceError
from fxsplit.tracing.graphkey import GraphKey
from fxsplit.tracing.modereads import internal_code, reading_module, short_filename

__all__ = ["WATCHED", "Draws", "recording_draws"]

_INSIDE = 1e-6  # a float draw is turned to this share of its range inside either end: to values it can take
# (random() is 0.0 once in 2**53 draws: ``if p > layerdrop`` with layerdrop=0 keeps every layer, and should stay so)


def _opposite(value: Any, low: Any, high: Any) -> Any:
    """Near ``high`` where ``value`` is below the middle of ``[low, high]``, else near ``low`` (elementwise for
    arrays); integers at the ends themselves."""
    if isinstance(value, (int, np.integer)) or (isinstance(value, np.ndarray) and value.dtype.kind in "iu"):
        top, bottom = high, low
    else:
        top, bottom = high - (high - low) * _INSIDE, low + (high - low) * _INSIDE
    if isinstance(value, np.ndarray):
        return np.where(value < (low + high) / 2, top, bottom).astype(value.dtype)
    return top if value < (low + high) / 2 else bottom


def _randrange(value: int, start: int, stop: int | None = None, step: int = 1) -> int:
    values = range(start) if stop is None else range(start, stop, step)
    return int(_opposite(value, values[0], values[-1]))


def _np_randint(value: Any, low: int, high: int | None = None, *args: Any, **kwargs: Any) -> Any:
    low, high = (0, low) if high is None else (low, high)
    return _opposite(value, low, high - 1)


def _choice(value: Any, seq: Any, *args: Any, **kwargs: Any) -> Any:
    at = next((k for k, item in enumerate(seq) if item is value), None)
    at = next((k for k, item in enumerate(seq) if item == value), 0) if at is None else at
    return seq[-1] if at < (len(seq) - 1) / 2 else seq[0]


# name -> the draw turned to the other end of its range, from (drawn value, *the call's arguments)
_PYTHON: dict[str, Callable[..., Any]] = {
    "random": lambda value: _opposite(value, 0.0, 1.0),
    "uniform": lambda value, a, b: _opposite(value, min(a, b), max(a, b)),
    "randint": lambda value, a, b: int(_opposite(value, a, b)),
    "randrange": _randrange,
    "choice": _choice,
    "gauss": lambda value, mu=0.0, sigma=1.0: 2 * mu - value,
    "normalvariate": lambda value, mu=0.0, sigma=1.0: 2 * mu - value,
}
_NUMPY: dict[str, Callable[..., Any]] = {
    "random": lambda value, *args, **kwargs: _opposite(value, 0.0, 1.0),
    "random_sample": lambda value, *args, **kwargs: _opposite(value, 0.0, 1.0),
    "rand": lambda value, *args: _opposite(value, 0.0, 1.0),
    "uniform": lambda value, low=0.0, high=1.0, *args, **kwargs: _opposite(value, low, high),
    "randint": _np_randint,
    "normal": lambda value, loc=0.0, *args, **kwargs: 2 * loc - value,
    "randn": lambda value, *args: -value,
    "standard_normal": lambda value, *args, **kwargs: -value,
}
WATCHED = tuple(f"random.{name}" for name in _PYTHON) + tuple(f"numpy.random.{name}" for name in _NUMPY)
"""The functions whose draws are noted, as the model's code calls them."""


@dataclass
class Draws:
    """The draws noted by :func:`recording_draws`: where (``"Encoder.forward at model.py:12"``, in order of first
    draw), by which function, and which modules' code drew (by identity, until named)."""

    model: torch.nn.Module
    where: dict[str, None] = field(default_factory=dict)  # (ordered sets)
    functions: dict[str, None] = field(default_factory=dict)
    modules: dict[int, torch.nn.Module] = field(default_factory=dict)
    flipped: bool = False  # while true, each draw is turned to the other end of its range
    start: tuple[Any, Any] = field(default_factory=lambda: (random.getstate(), np.random.get_state()))

    def refuse_if_fixed(self, graph_module: torch.fx.GraphModule, retraced: Callable[[], torch.fx.GraphModule]) -> None:
        """Raise a :class:`TraceError` if ``graph_module`` depends on the draws: ``retraced()`` traces again (each
        draw of the first trace, drawn again from the generators' states when it began, turned the other way; the
        states are put back after) and its graph is
        another (:class:`~fxsplit.tracing.graphkey.GraphKey`: a drawn array made a tensor counts), or it fails."""
        if not self.where:
            return
        states = random.getstate(), np.random.get_state()
        random.setstate(self.start[0])  # the same draws as the first trace, each turned the other way
        np.random.set_state(self.start[1])
        self.flipped = True
        try:
            differs = GraphKey(graph_module, self.model) != GraphKey(retraced(), self.model)
        except Exception:  # noqa: BLE001 - the other draws' code may raise anything: it depends on them, then
            differs = True
        finally:
            self.flipped = False
            random.setstate(states[0])
            np.random.set_state(states[1])
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
    of :data:`WATCHED` (and, while :attr:`Draws.flipped`, turn each to the other end of its range)."""
    thread = threading.get_ident()
    draws = Draws(model)

    def watched(module: Any, prefix: str, name: str, opposite: Callable[..., Any]) -> Callable[..., Any]:
        original = getattr(module, name)

        def draw(*args: Any, **kwargs: Any) -> Any:
            value = original(*args, **kwargs)
            caller = sys._getframe(1)
            filename = caller.f_code.co_filename
            if threading.get_ident() != thread or internal_code(filename):
                return value
            qualname = getattr(caller.f_code, "co_qualname", caller.f_code.co_name)
            draws.where.setdefault(f"{qualname} at {short_filename(filename)}:{caller.f_lineno}")
            draws.functions.setdefault(f"{prefix}.{name}()")
            owner = reading_module(caller)
            if owner is not None:
                draws.modules.setdefault(id(owner), owner)
            return opposite(value, *args, **kwargs) if draws.flipped else value

        return draw

    patched = [(random, "random", name, opposite) for name, opposite in _PYTHON.items()]
    patched += [(np.random, "np.random", name, opposite) for name, opposite in _NUMPY.items()]
    originals = [(module, name, getattr(module, name)) for module, _, name, _ in patched]
    for module, prefix, name, opposite in patched:
        setattr(module, name, watched(module, prefix, name, opposite))
    try:
        yield draws
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
