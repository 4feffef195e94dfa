"""Where a model's code can draw Python or NumPy random numbers, and each draw pinned to one end of its range.

:mod:`fxsplit.tracing.randomdraws` wraps every source of draws the model's code can reach while it is traced:

* the module-level functions of ``random`` and ``numpy.random`` (:data:`WATCHED`), called as
  ``random.uniform(0, 1)`` or ``np.random.random()``;
* the same functions bound to a name of the model's own code before tracing (``from random import uniform``):
  the name holds the function itself, so patching the module's attribute does not reach it. The globals of each
  Python module that defines a class of the model's modules (or one of their bases) are looked through, and those
  of the modules that code imports from (a helper module's ``drop()`` drawing through its own name:
  :func:`~fxsplit.tracing.modelcode.model_namespaces`);
* generator objects the model holds (``self.rng = np.random.default_rng(0)``, ``random.Random(0)``,
  ``np.random.RandomState(0)``), as attributes of its modules, of the objects they hold (``self.config.rng``) or
  globals of that code: each is stood in for by a :class:`StandIn` whose drawing methods are wrapped and whose
  other attributes are the generator's own; and the generators ``np.random.default_rng()``, ``random.Random()``,
  ``np.random.RandomState()`` and ``np.random.Generator(bit_generator)`` make for the model's code while it is
  traced (in ``forward``; the classes stand in for themselves to ``isinstance``), but not for a module imported
  meanwhile (its generators stay its own).

Each wrapper is given the function's ``pinned(value, end, *args, **kwargs)``, the drawn value moved to the low
(``end`` 0) or high end (1) of the range the call's arguments give. :func:`watching` installs them and puts every
name back after (a stand-in only where the model still holds it: code that replaced it keeps its own).

Not seen: a generator object held deeper (in a list the module holds, or two objects down), and a name bound two
imports away (a helper of a helper module).
"""

from __future__ import annotations

import random
import sys
import threading
import types
from collections import OrderedDict
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable, Iterator

import numpy as np
import torch

from fxsplit.tracing.modelcode import model_namespaces
from fxsplit.tracing.modereads import internal_code

__all__ = ["WATCHED", "StandIn", "by_model_code", "generator_states", "restore_states", "watching"]

_INSIDE = 1e-6  # a float draw is pinned this share of its range inside either end: to values it can take
# (random() is 0.0 once in 2**53 draws: ``if p > layerdrop`` with layerdrop=0 keeps every layer, and should stay so)
_SIGMAS = 3.0  # a normal draw is pinned this many standard deviations from its mean

Wrap = Callable[[Callable[..., Any], str, Callable[..., Any]], Callable[..., Any]]
"""``wrap(original, label, pinned)``: the function that stands in for ``original`` (``label``: how messages name
it, ``"random.uniform"``)."""


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


def _integers(value: Any, end: int, low: int, high: int | None = None, *args: Any, **kwargs: Any) -> Any:
    """``Generator.integers(low, high=None, size=None, dtype=int64, endpoint=False)``."""
    low, high = (0, low) if high is None else (low, high)
    closed = kwargs.get("endpoint", args[2] if len(args) > 2 else False)
    return _at(value, low, high if closed else high - 1, end)


def _normal(value: Any, end: int, *args: Any, **kwargs: Any) -> Any:
    """``gauss(mu, sigma)``, ``normalvariate(mu, sigma)``, ``numpy.random.normal(loc, scale, size)``."""
    mean = args[0] if args else kwargs.get("loc", kwargs.get("mu", 0.0))
    deviation = args[1] if len(args) > 1 else kwargs.get("scale", kwargs.get("sigma", 1.0))
    return _at(value, mean - _SIGMAS * deviation, mean + _SIGMAS * deviation, end)


def _unit(value: Any, end: int, *args: Any, **kwargs: Any) -> Any:
    return _at(value, 0.0, 1.0, end)


def _uniform(value: Any, end: int, low: float = 0.0, high: float = 1.0, *args: Any, **kwargs: Any) -> Any:
    return _at(value, min(low, high), max(low, high), end)


# name -> the draw pinned to one end of its range, from (drawn value, end: 0 or 1, *the call's arguments)
_PYTHON: dict[str, Callable[..., Any]] = {  # the functions of ``random``, and the methods of ``random.Random``
    "random": _unit,
    "uniform": _uniform,
    "randint": lambda value, end, a, b: b if end else a,
    "randrange": _randrange,
    "choice": lambda value, end, seq: seq[-1] if end else seq[0],
    "gauss": _normal,
    "normalvariate": _normal,
}
_NUMPY: dict[str, Callable[..., Any]] = {  # the functions of ``numpy.random``, and the methods of a RandomState
    "random": _unit,
    "random_sample": _unit,
    "rand": _unit,
    "uniform": _uniform,
    "randint": _np_randint,
    "normal": _normal,
    "randn": lambda value, end, *dimensions: _normal(value, end),
    "standard_normal": lambda value, end, *args, **kwargs: _normal(value, end),
}
_GENERATOR: dict[str, Callable[..., Any]] = {  # the methods of ``numpy.random.Generator`` (``default_rng()``)
    "random": _unit,
    "uniform": _uniform,
    "integers": _integers,
    "normal": _normal,
    "standard_normal": lambda value, end, *args, **kwargs: _normal(value, end),
}
_METHODS: tuple[tuple[type, dict[str, Callable[..., Any]]], ...] = (
    (random.Random, _PYTHON),
    (np.random.RandomState, _NUMPY),
    (np.random.Generator, _GENERATOR),
)
WATCHED = (
    tuple(f"random.{name}" for name in _PYTHON)
    + tuple(f"numpy.random.{name}" for name in _NUMPY)
    + tuple(f"{kind.__name__}.{name}" for kind, table in _METHODS for name in table)
)
"""The functions (and generator methods) whose draws are noted, as the model's code calls them."""


class StandIn:
    """Stands in for a generator object the model holds while it is traced: its drawing methods wrapped, any other
    attribute the generator's own."""

    __slots__ = ("generator", "methods")

    def __init__(self, generator: Any, label: str, table: dict[str, Callable[..., Any]], wrap: Wrap) -> None:
        self.generator = generator
        self.methods = {name: wrap(getattr(generator, name), f"{label}.{name}", pin) for name, pin in table.items()}

    def __getattr__(self, name: str) -> Any:  # asked only for what the stand-in itself lacks
        if name in StandIn.__slots__ or name.startswith("__"):  # not set yet (a copy being made), or a protocol
            raise AttributeError(name)
        found = self.methods.get(name)
        return found if found is not None else getattr(self.generator, name)


_KINDS = tuple(kind for kind, _ in _METHODS)
_NOT_HOLDERS = (torch.nn.Module, torch.Tensor, dict, type, types.ModuleType, types.FunctionType, types.MethodType)
_PLAIN = frozenset({bool, int, float, str, bytes, type(None), dict, OrderedDict, set, list, tuple, torch.Size})


def _table(value: Any) -> dict[str, Callable[..., Any]] | None:
    if not isinstance(value, _KINDS) or isinstance(value, random.SystemRandom):  # SystemRandom: the OS's entropy,
        return None  # no state to put back
    return next((table for kind, table in _METHODS if isinstance(value, kind)), None)


@contextmanager
def watching(model: torch.nn.Module, wrap: Wrap) -> Iterator[list[Any]]:
    """Within the block, every source of draws of ``model``'s code (see the module's doc) is wrapped with
    ``wrap``; yields the generator objects the model holds (for :func:`generator_states`). Puts them back after."""
    patched: list[tuple[dict[str, Any], str, Any, Any]] = []  # (namespace, name, original, stand-in)
    functions: dict[int, Any] = {}  # id of an original module-level function -> its wrapper
    for module, prefix, table in ((random, "random", _PYTHON), (np.random, "np.random", _NUMPY)):
        for name, pin in table.items():
            original = getattr(module, name)
            functions[id(original)] = wrapper = wrap(original, f"{prefix}.{name}", pin)
            patched.append((vars(module), name, original, wrapper))
    made, thread = np.random.default_rng, threading.get_ident()

    def default_rng(*args: Any, **kwargs: Any) -> Any:  # a generator made while traced (in forward): stood in for
        generator = made(*args, **kwargs)
        if not by_model_code(thread, sys._getframe(1)):
            return generator
        return StandIn(generator, "np.random.default_rng()", _GENERATOR, wrap)

    functions[id(made)] = default_rng
    patched.append((vars(np.random), "default_rng", made, default_rng))
    for module, prefix, kind, table in _MADE:  # ``random.Random()`` and the like, made while traced
        functions[id(kind)] = maker = _watched_kind(kind, f"{prefix}.{kind.__name__}()", table, wrap, thread)
        patched.append((vars(module), kind.__name__, kind, maker))
    held: list[Any] = []

    def stand_in(namespace: dict[str, Any], name: str, value: Any, label: str) -> None:
        table = _table(value)
        if table is not None:
            held.append(value)
            patched.append((namespace, name, value, StandIn(value, label, table, wrap)))

    modules = list(model.modules())
    for code in model_namespaces(modules):
        for name, value in list(vars(code).items()):
            if id(value) in functions and callable(value):
                patched.append((vars(code), name, value, functions[id(value)]))
            else:
                stand_in(vars(code), name, value, f"{code.__name__}.{name}")
    kinds, plain, looked = _KINDS, _PLAIN, {id(module) for module in modules}
    for owner in modules:  # (models of 100k modules: a set lookup per attribute, a few more for other objects)
        namespace = vars(owner)
        for name, value in namespace.items():
            if type(value) in plain:  # (most attributes: torch's own tables, sizes, flags)
                continue
            if isinstance(value, kinds):
                stand_in(namespace, name, value, f"{type(owner).__name__}.{name}")
            elif id(value) not in looked and not isinstance(value, _NOT_HOLDERS):
                looked.add(id(value))  # an object the module holds (its config): a generator among its attributes
                for key, held_value in _attributes(value):
                    if isinstance(held_value, kinds):
                        stand_in(vars(value), key, held_value, f"{type(owner).__name__}.{name}.{key}")
    for namespace, name, _, replacement in patched:
        namespace[name] = replacement
    try:
        yield held
    finally:
        for namespace, name, original, replacement in reversed(patched):
            if namespace.get(name) is replacement:
                namespace[name] = original


def _attributes(value: Any) -> list[tuple[str, Any]]:
    """The items of ``vars(value)`` (none when it has no plain ``__dict__``, or asking fails)."""
    try:
        inner = vars(value)
    except Exception:  # noqa: BLE001 - no __dict__ (TypeError), or a proxy that fails when asked
        return []
    return list(inner.items()) if type(inner) is dict else []


def by_model_code(thread: int, caller: FrameType) -> bool:
    """Whether ``caller`` (a frame) runs the model's code on the tracing thread: not torch's or fxsplit's, and not
    a module being imported meanwhile (sympy, imported by torch's shape code during a trace, makes a
    ``random.Random()`` in a class body and draws: stood in for, it would keep the stand-in)."""
    if threading.get_ident() != thread or internal_code(caller.f_code.co_filename):
        return False
    frame: FrameType | None = caller
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return False
        frame = frame.f_back
    return True


class _SameKind(type):
    """The metaclass of :func:`_watched_kind`'s classes: ``isinstance`` and ``issubclass`` ask of the class they
    stand for, so that code traced meanwhile sees the class it knows."""

    watched: type

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls.watched)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls.watched)


def _watched_kind(kind: type, label: str, table: dict[str, Callable[..., Any]], wrap: Wrap, thread: int) -> type:
    """A class standing for the generator class ``kind`` while the model is traced: made by the model's code (on
    the tracing thread), a generator is stood in for (:class:`StandIn`); made by any other code, it is ``kind``'s."""

    def made(cls: type, *args: Any, **kwargs: Any) -> Any:
        generator = kind(*args, **kwargs)
        if not by_model_code(thread, sys._getframe(1)):
            return generator
        return StandIn(generator, label, table, wrap)

    watched = _SameKind(kind.__name__, (kind,), {"__new__": made, "__module__": kind.__module__})
    watched.watched = kind
    return watched


_MADE: tuple[tuple[Any, str, type, dict[str, Callable[..., Any]]], ...] = (
    (random, "random", random.Random, _PYTHON),
    (np.random, "np.random", np.random.RandomState, _NUMPY),
    (np.random, "np.random", np.random.Generator, _GENERATOR),  # ``Generator(PCG64())``: what default_rng() makes
)


def generator_states(held: list[Any]) -> list[Any]:
    """The states of the global generators of ``random`` and ``numpy.random``, then of each of ``held``."""
    states: list[Any] = [random.getstate(), np.random.get_state()]
    for generator in held:
        if isinstance(generator, np.random.Generator):
            states.append(generator.bit_generator.state)
        elif isinstance(generator, np.random.RandomState):
            states.append(generator.get_state())
        else:
            states.append(generator.getstate())
    return states


def restore_states(held: list[Any], states: list[Any]) -> None:
    """Put back what :func:`generator_states` returned."""
    random.setstate(states[0])
    np.random.set_state(states[1])
    for generator, state in zip(held, states[2:], strict=True):
        if isinstance(generator, np.random.Generator):
            generator.bit_generator.state = state
        elif isinstance(generator, np.random.RandomState):
            generator.set_state(state)
        else:
            generator.setstate(state)
