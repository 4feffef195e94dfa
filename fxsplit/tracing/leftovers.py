"""What a trace leaves in the model's Python state: its own values (fake tensors, fx proxies), taken back out.

Tracing runs the model's Python code on values that are not the user's tensors: torch.export on fake tensors,
torch.fx on proxies. Whatever that code keeps outside the graph keeps them too: a tensor cached by
``functools.lru_cache`` or ``functools.cache``, a ``functools.cached_property``, an entry of a dict at module level
(``_CACHE[n] = torch.arange(n)``). After ``fxsplit.fxsplit`` with torch.export (the default with example
inputs), the user's own model computed with the cached fake tensor: its outputs were fake tensors, and the next op
on them failed (``torch.equal``: ``DataDependentOutputException``). Under torch.fx the caches kept proxies (keyed
by one, or holding one): dead entries holding the traced graph.

:func:`clearing_leftovers` takes them out when the trace ends, whether it worked or not:

* a cache of ``functools.lru_cache`` or ``functools.cache`` in the model's code (a global, a method of one of
  its classes, or in the closure of either) that missed while traced is emptied (it is a cache: it fills again on
  the next calls);
* a value of the trace's own kinds (fake tensor, proxy, symbolic number; or a tuple or list holding one) bound
  anew in one of the model's modules' ``__dict__`` (``cached_property`` writes there) or in the code's globals
  is put back as it was (removed, if it was not there);
* such entries are removed from the dicts the code's globals hold.

Not seen: such values kept deeper (on an object a global holds). Attributes assigned through
``Module.__setattr__`` are :mod:`fxsplit.tracing.pythonstate`'s.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from fxsplit.tracing.modelcode import code_classes, code_modules

__all__ = ["clearing_leftovers", "traced_value"]

_MISSING = object()
_TRACED = (torch.fx.Proxy, FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool)


def traced_value(value: Any) -> bool:
    """Whether ``value`` is one of a trace's own values, or a tuple or list holding one."""
    if isinstance(value, _TRACED):
        return True
    return type(value) in (tuple, list) and any(isinstance(item, _TRACED) for item in value)


def _caches(namespaces: list[Mapping[str, Any]]) -> dict[int, tuple[Any, int]]:
    """``id -> (cache, misses so far)`` for each ``functools`` cache among the values of ``namespaces``, or in
    the closure of one (a decorator that calls a cached function: transformers' ``compile_compatible_method_lru_cache``
    keeps its cache there)."""
    found: dict[int, tuple[Any, int]] = {}
    for namespace in namespaces:
        for value in namespace.values():
            function = getattr(value, "__func__", value)  # a staticmethod or classmethod over a cached function
            cells = getattr(function, "__closure__", None) or ()
            for candidate in (function, *(_content(cell) for cell in cells)):
                info = getattr(candidate, "cache_info", None)
                if callable(info) and callable(getattr(candidate, "cache_clear", None)) and id(candidate) not in found:
                    try:
                        found[id(candidate)] = (candidate, info().misses)
                    except Exception:  # noqa: BLE001 - a cache_info of some other kind
                        continue
    return found


def _content(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


@contextmanager
def clearing_leftovers(model: torch.nn.Module) -> Iterator[None]:
    """Within the block (traces of ``model``), note the model's Python state; when it ends, take out what the
    traces left there (see the module's doc)."""
    modules = list(model.modules())
    globals_ = [vars(code) for code in code_modules(modules)]
    caches = _caches([*globals_, *(vars(kind) for kind in code_classes(modules))])
    before = [(vars(module), dict(vars(module))) for module in modules]
    before += [(namespace, dict(namespace)) for namespace in globals_]
    try:
        yield
    finally:
        for function, misses in caches.values():
            if function.cache_info().misses > misses:
                function.cache_clear()
        for namespace, old in before:
            for name, value in list(namespace.items()):
                if value is not old.get(name, _MISSING) and traced_value(value):
                    if name in old:
                        namespace[name] = old[name]
                    else:
                        del namespace[name]
        for namespace in globals_:
            for value in list(namespace.values()):
                if isinstance(value, dict) and value:
                    for key in [key for key, item in value.items() if traced_value(key) or traced_value(item)]:
                        del value[key]
