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
again with every draw pinned to the low end of its range, and again at the high end, gives other code or other
constants (whatever the first trace drew, a comparison with a threshold inside the range comes out the other way
at one of the ends, and a drawn number changes). Then tracing is refused with a
:class:`~fxsplit.errors.TraceError` that names the draws and the fixes. A model that draws in ``eval()`` mode
without using the draw (wav2vec2's adapter does) is planned as before, after the two more traces; a model that
draws nothing is traced once.

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

_INSIDE = 1e-6  # a float draw is pinned this share of its range inside either end: to values it can take
# (random() is 0.0 once in 2**53 draws: ``if p > layerdrop`` with layerdrop=0 keeps every layer, and should stay so)
_SIGMAS = 3.0  # a normal draw is pinned this many standard deviations from its mean


def _at(value: Any, low: Any, high: Any, end: int) -> Any:
    """``value`` (a number or an array) pinned near ``low`` (``end`` 0) or ``high`` (1): integers at the end itself,
    floats just inside it."""
    integer = isinstance(value, (int, np.integer)) or (isinstance(value, np.ndarray) and value.dtype.kind in "iu")
    if integer:
        target = high if end else low
    else:
        target = high - (high - low) * _INSIDE if end else low + (high - low) * _INSIDE
    if isinstance(value, np.ndarray):
        return np.full_like(value, target)
    return type(value)(target)


def _randrange(value: int, end: int, start: int, stop: int | None = None, step: int = 1) -> int:
    values = range(start) if stop is None else range(start, stop, step)
    return values[-1] if end else values[0]


def _np_randint(value: Any, end: int, low: int, high: int | None = None, *args: Any, **kwargs: Any) -> Any:
    low, high = (0, low) if high is None else (low, high)
    return _at(value, low, high - 1, end)


def _normal(value: Any, end: int, *args: Any, **kwargs: Any) -> Any:
    """``gauss(mu, sigma)``, ``normalvariate(mu, sigma)``, ``numpy.random.normal(loc, scale, size)``."""
    mean = args[0] if args else kwargs.get("loc", kwargs.get("mu", 0.0))
    deviation = args[1] if len(args) > 1 else kwargs.get("scale", kwargs.get("sigma", 1.0))
    return _at(value, mean - _SIGMAS * deviation, mean + _SIGMAS * deviation, end)


# name -> the draw pinned to one end of its range, from (drawn value, end: 0 or 1, *the call's arguments)
_PYTHON: dict[str, Callable[..., Any]] = {
    "random": lambda value, end: _at(value, 0.0, 1.0, end),
    "uniform": lambda value, end, a, b: _at(value, min(a, b), max(a, b), end),
    "randint": lambda value, end, a, b: b if end else a,
    "randrange": _randrange,
    "choice": lambda value, end, seq: seq[-1] if end else seq[0],
    "gauss": _normal,
    "normalvariate": _normal,
}
_NUMPY: dict[str, Callable[..., Any]] = {
    "random": lambda value, end, *args, **kwargs: _at(value, 0.0, 1.0, end),
    "random_sample": lambda value, end, *args, **kwargs: _at(value, 0.0, 1.0, end),
    "rand": lambda value, end, *args: _at(value, 0.0, 1.0, end),
    "uniform": lambda value, end, low=0.0, high=1.0, *args, **kwargs: _at(value, low, high, end),
    "randint": _np_randint,
    "normal": _normal,
    "randn": lambda value, end, *dimensions: _normal(value, end),
    "standard_normal": lambda value, end, *args, **kwargs: _normal(value, end),
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
    pinned: int | None = None  # while set, each draw is pinned to that end of its range (0: low, 1: high)

    def refuse_if_fixed(self, graph_module: torch.fx.GraphModule, retraced: Callable[[], torch.fx.GraphModule]) -> None:
        """Raise a :class:`TraceError` if ``graph_module`` depends on the draws: ``retraced()`` traces again with
        every draw pinned to the low end of its range, then (if that gave the same graph) to the high end, and one
        of them gives another graph (:class:`~fxsplit.tracing.graphkey.GraphKey`: a drawn array made a tensor
        counts), or fails. The generators' states are put back after: those traces draw nothing of the caller's.

        Whatever the first trace drew, a comparison of a draw with a threshold inside its range comes out one way
        at one end and the other way at the other, so one of the two differs from it (and a drawn number does)."""
        if not self.where:
            return
        states = random.getstate(), np.random.get_state()
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
    of :data:`WATCHED` (and, while :attr:`Draws.pinned` is set, pin each to that end of its range)."""
    thread = threading.get_ident()
    draws = Draws(model)

    def watched(module: Any, prefix: str, name: str, pinned: Callable[..., Any]) -> Callable[..., Any]:
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
            return value if draws.pinned is None else pinned(value, draws.pinned, *args, **kwargs)

        return draw

    patched = [(random, "random", name, pinned) for name, pinned in _PYTHON.items()]
    patched += [(np.random, "np.random", name, pinned) for name, pinned in _NUMPY.items()]
    originals = [(module, name, getattr(module, name)) for module, _, name, _ in patched]
    for module, prefix, name, pinned in patched:
        setattr(module, name, watched(module, prefix, name, pinned))
    try:
        yield draws
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
