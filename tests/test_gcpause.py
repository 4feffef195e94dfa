"""Planning steps run with the cyclic garbage collector paused (fxsplit.gcpause)."""

from __future__ import annotations

import gc
from typing import Any, Callable, Iterator

import pytest
import torch

import fxsplit
import fxsplit.api as api
import fxsplit.plangraph as plangraph
from fxsplit.gcpause import gc_paused


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    """Whatever a test does to the collector, the tests after it find it as it was."""
    was_enabled = gc.isenabled()
    yield
    (gc.enable if was_enabled else gc.disable)()


def test_the_collector_is_off_in_the_block_and_back_on_after() -> None:
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_is_back_on_after_an_error() -> None:
    gc.enable()
    with pytest.raises(KeyError), gc_paused():
        raise KeyError("boom")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_nested_pauses_restore_only_at_the_outermost() -> None:
    gc.enable()
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()  # the inner block found it off, so left it off
    assert gc.isenabled()


def test_as_a_decorator_each_call_is_paused() -> None:
    seen = []

    @gc_paused()
    def step(value: int) -> int:
        seen.append(gc.isenabled())
        return value * 2

    gc.enable()
    assert [step(1), step(2)] == [2, 4]
    assert seen == [False, False] and gc.isenabled()


@pytest.mark.parametrize("was_enabled", [True, False])
def test_plan_pauses_from_the_end_of_tracing_to_its_return(monkeypatch: pytest.MonkeyPatch, was_enabled: bool) -> None:
    """Between its steps too: each step's own pause ending would let the next pass walk all the steps made."""
    seen: dict[str, bool] = {}

    def watched(name: str, step: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen[name] = gc.isenabled()
            return step(*args, **kwargs)

        return call

    for module, name in ((api, "trace"), (plangraph, "memory_model"), (plangraph, "record_origin")):
        monkeypatch.setattr(module, name, watched(name, getattr(module, name)))  # called outside any step's pause
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    (gc.enable if was_enabled else gc.disable)()
    fxsplit.plan(model, {"cpu:0": "1KiB", "cpu:1": "1KiB"}, example_inputs=(torch.randn(2, 4),), trace="fx")
    assert seen == {"trace": was_enabled, "memory_model": False, "record_origin": False}
    assert gc.isenabled() == was_enabled


def test_partition_called_alone_runs_paused() -> None:
    """A caller of ``partition()`` outside ``plan()`` (the scaling benchmark, a user's own loop) gets the same
    pause: with the collector on, full passes over every live object made its time jump with the graph's size
    (deep graphs of 20k ops: 120-267 ms across runs; log-log slope 1.16-1.23)."""
    from fxsplit.partition.problem import PartitionProblem, Value
    from fxsplit.partition.solve import partition

    seen: list[bool] = []

    def one_device(search: Any, best: Any) -> tuple[int, ...]:
        seen.append(gc.isenabled())
        return (0,) * search.problem.num_ops

    problem = PartitionProblem(op_names=("a", "b"), values=(Value("a", 4, 0, (1,)),))
    gc.enable()
    assert partition(problem, [100, 100], strategies=[one_device]).op_devices == (0, 0)
    assert seen == [False] and gc.isenabled()
