"""A trace leaves none of its own values in the model's Python state: caches it filled are emptied.

Before, after ``fxsplit.fxsplit(model, ..., example_inputs=...)`` (torch.export, the default), a model whose code
cached a tensor (``functools.lru_cache``, ``functools.cache``, ``functools.cached_property``, a dict at module
level) held the trace's fake tensor there, and its own next outputs were fake tensors: ``torch.equal`` on them
raised ``DataDependentOutputException``. Under torch.fx the caches held proxies.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

import fxsplit
from fxsplit.tracing.leftovers import traced_value

BUDGETS = {"cpu:0": 400, "cpu:1": 400}
X = torch.randn(2, 4)
_TABLES: dict[Any, torch.Tensor] = {}
_LAST: Any = None


@functools.lru_cache
def cached_table(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 0.5


@functools.cache
def cached_ones(n: int) -> torch.Tensor:
    return torch.ones(n) * 2


def dict_table(n: Any) -> torch.Tensor:
    if n not in _TABLES:
        _TABLES[n] = torch.arange(4, dtype=torch.float32) * 0.25
    return _TABLES[n]


class Cached(nn.Module):
    """Adds a table its code caches (``how``), as positions tables and rotary frequencies are cached."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 4), how

    @functools.cached_property
    def table(self) -> torch.Tensor:
        return torch.arange(4, dtype=torch.float32) * 0.75

    @functools.lru_cache  # noqa: B019 - a method cache, as model code has them
    def method_table(self, n: int) -> torch.Tensor:
        return torch.full((n,), 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global _LAST
        h = self.a(x)
        if self.how == "lru_cache":
            h = h + cached_table(x.shape[-1]) + cached_ones(x.shape[-1])
        elif self.how == "dict":
            h = h + dict_table(x.shape[-1])
        elif self.how == "cached_property":
            h = h + self.table
        elif self.how == "method":
            h = h + self.method_table(x.shape[-1])
        elif self.how == "global":
            _LAST = h * 1  # a global rebound to an intermediate
        return self.b(h)


def _clear() -> None:
    global _LAST
    cached_table.cache_clear()
    cached_ones.cache_clear()
    Cached.method_table.cache_clear()
    _TABLES.clear()
    _LAST = None


def _leftovers(model: Cached) -> list[str]:
    found = [f"dict {key!r}" for key, value in _TABLES.items() if traced_value(key) or traced_value(value)]
    found += [f"attribute {n}" for n, v in vars(model).items() if traced_value(v)]
    found += ["global _LAST"] if traced_value(_LAST) else []
    found += [f"{f.__name__} cache" for f in (cached_table, cached_ones) if f.cache_info().currsize]
    return found


HOWS = ["lru_cache", "dict", "cached_property", "method", "global"]


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("how", HOWS)
def test_the_model_computes_as_before_after_it_was_split(trace: str, how: str) -> None:
    torch.manual_seed(0)
    _clear()
    model = Cached(how).eval()
    with torch.no_grad():
        expected = model(X)
    _clear()
    vars(model).pop("table", None)
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace)
    assert _leftovers(model) == []
    with torch.no_grad():
        after = model(X)
        assert type(after) is torch.Tensor and not isinstance(after, FakeTensor)
        torch.testing.assert_close(after, expected, rtol=0, atol=0)
        torch.testing.assert_close(split(X), expected, rtol=0, atol=0)


def test_a_cache_filled_before_the_trace_and_not_missed_is_kept() -> None:
    """A cache the trace only hit (or did not call) keeps its entries."""
    _clear()
    cached_table(4)
    cached_ones(4)
    fxsplit.fxsplit(Cached("dict").eval(), BUDGETS, example_inputs=(X,), trace="export")
    assert cached_table.cache_info().currsize == 1 and cached_ones.cache_info().currsize == 1


def test_leftovers_are_taken_out_when_the_trace_fails() -> None:
    class Fails(Cached):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x) + self.table
            if h.sum() > 0:  # data-dependent control flow: neither tracer can follow it
                h = h * 2
            return self.b(h)

    _clear()
    model = Fails("cached_property").eval()
    with pytest.raises(fxsplit.FxsplitError):
        fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="export")
    assert "table" not in vars(model) or not traced_value(vars(model)["table"])


def test_traced_value_kinds() -> None:
    assert not traced_value(torch.ones(2)) and not traced_value((1, torch.ones(1))) and not traced_value(None)
    graph = torch.fx.Graph()
    proxy = torch.fx.Proxy(graph.placeholder("x"))
    assert traced_value(proxy) and traced_value((1, proxy)) and traced_value([proxy])


def _caching(function: Any) -> Any:
    """A decorator that keeps its cache in its closure (transformers' ``compile_compatible_method_lru_cache``)."""
    cached = functools.lru_cache(function)

    @functools.wraps(function)
    def wrapper(*args: Any) -> Any:
        return cached(*args)

    return wrapper


@_caching
def closure_table(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 0.3


def test_a_cache_in_a_decorators_closure_is_emptied() -> None:
    class Closure(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) + closure_table(x.shape[-1])

    torch.manual_seed(0)
    model = Closure().eval()
    with torch.no_grad():
        expected = model(X)
    cache = closure_table.__closure__[0].cell_contents  # type: ignore[index]
    cache.cache_clear()
    fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="export")
    assert cache.cache_info().currsize == 0
    with torch.no_grad():
        torch.testing.assert_close(model(X), expected, rtol=0, atol=0)
