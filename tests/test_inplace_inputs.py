"""In-place updates of forward inputs reach the caller's tensor, as in eager PyTorch.

The split copies each input to the device that first reads it; an in-place
update then changes that copy, so the generated code writes it back. Inputs
are made on the plain "cpu" device and read on "cpu:0"/"cpu:1", so every copy
is a different tensor from the caller's.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from helpers import assert_same_grads, default_loss

import fxsplit
from fxsplit.check import verify_split
from fxsplit.errors import FxsplitError

TRACES = ("fx", "export")
BUDGETS = {"cpu:0": "3KiB", "cpu:1": "3KiB"}
PINS = {"a": "cpu:0", "b": "cpu:1"}


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())


class CacheAdd(TwoBlocks):
    """A running cache passed in and accumulated (read again after the update)."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        cache.add_(h.detach())
        return self.b(h) + cache


class CopyUnderNoGrad(TwoBlocks):
    """``with torch.no_grad(): buf.copy_(...)``: on export, the write sits inside a higher-order op."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            cache.copy_(h)
        return self.b(h) * cache


class Chained(TwoBlocks):
    """``cache.add_(1).mul_(...)``: the second write goes through the first one's result."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        cache.add_(1).mul_(h.detach().sigmoid())
        return self.b(h)


class ThroughViews(TwoBlocks):
    """Writes through ``view`` and a row of the input."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        cache.view(-1).mul_(0.5)
        cache[0].add_(h[0].detach())
        return self.b(h) - cache.sum()


class OutKeyword(TwoBlocks):
    """``torch.add(..., out=cache)``, then a write through the result it returns."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch.add(h.detach(), cache, out=cache).mul_(0.5)
        return self.b(h)


class ScaleInput(TwoBlocks):
    """The model scales its own input ``x`` in place, then reads it on both devices."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        h = self.a(x)
        return self.b(h + cache) + x


class SetItem(TwoBlocks):
    """``cache[:, 0] = ...`` (torch.fx cannot trace item assignment on an input; export can)."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        cache[:, 0] = h[:, 0].detach()
        return self.b(h) + cache


class InPlaceByArgument(TwoBlocks):
    """Ops made in-place by an argument return the input they wrote; a later write through that result
    writes the input too (``F.relu(cache, True)`` positional, then ``nn.ReLU(inplace=True)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        self.act(x).mul_(0.5)
        h = self.a(x)
        y = torch.nn.functional.relu(cache, True)
        y.add_(h.detach())
        return self.b(h) + y


MODELS = [
    (m, t)
    for m in (CacheAdd, CopyUnderNoGrad, Chained, ThroughViews, OutKeyword, ScaleInput, InPlaceByArgument)
    for t in TRACES
] + [(SetItem, "export")]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(4, 8), torch.randn(4, 8)


@pytest.mark.parametrize(("make", "trace"), MODELS)
def test_caller_tensors_match_eager_over_calls(make: type[nn.Module], trace: str) -> None:
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    gm = fxsplit.fxsplit(
        model, BUDGETS, example_inputs=tuple(t.clone() for t in _inputs()), trace=trace, mode="weights", pins=PINS
    )
    verify_split(gm)
    plan = gm.meta["fxsplit_plan"]
    assert plan.param_devices["a.0.weight"] == "cpu:0" and plan.param_devices["b.0.weight"] == "cpu:1"
    assert "write_back" in gm.code
    split_args, eager_args = _inputs(), _inputs()
    for call in range(3):
        out = gm(*split_args)
        expected = reference(*eager_args)
        torch.testing.assert_close(out, expected, msg=lambda m, c=call: f"call {c}: {m}")
        for name, got, want in zip(("x", "cache"), split_args, eager_args, strict=True):
            torch.testing.assert_close(got, want, msg=lambda m, n=name, c=call: f"caller's {n} after call {c}: {m}")
        default_loss(out).backward()
        default_loss(expected).backward()
    assert_same_grads(model, reference)


@pytest.mark.parametrize("trace", TRACES)
def test_write_back_follows_the_last_update(trace: str) -> None:
    gm = fxsplit.fxsplit(Chained(), BUDGETS, example_inputs=_inputs(), trace=trace, mode="weights", pins=PINS)
    lines = [line.strip() for line in gm.code.splitlines()]
    last_update = max(i for i, line in enumerate(lines) if "mul_" in line)
    write = next(i for i, line in enumerate(lines) if "write_back(cache," in line)
    assert write == last_update + 1


def test_input_already_on_its_device_is_updated_once() -> None:
    """When the input already lives where it is read, ``.to`` returns it and the write-back leaves it alone."""
    torch.manual_seed(0)
    model = CacheAdd()
    reference = copy.deepcopy(model)
    gm = fxsplit.fxsplit(model, {"cpu": "6KiB"}, example_inputs=_inputs(), trace="fx", mode="weights")
    (x, cache), (x_eager, cache_eager) = _inputs(), _inputs()
    for _ in range(2):
        torch.testing.assert_close(gm(x, cache), reference(x_eager, cache_eager))
        torch.testing.assert_close(cache, cache_eager)


def test_plan_that_writes_an_input_away_from_its_copy_is_refused() -> None:
    """An edited plan moving the writer off the input's device is refused before any weight moves."""
    model = CacheAdd()
    plan = fxsplit.plan(model, BUDGETS, example_inputs=_inputs(), trace="fx", mode="weights", pins=PINS)
    assert plan.placement["cache"] == plan.placement["add_"] == "cpu:1"
    edited = dataclasses.replace(plan, placement={**plan.placement, "add_": "cpu:0"})
    devices = {n: p.device for n, p in model.named_parameters()}
    with pytest.raises(FxsplitError, match=r"input 'cache' is updated in place by 'add_' on cpu:0.*pin"):
        fxsplit.apply(model, edited, example_inputs=_inputs())
    assert {n: p.device for n, p in model.named_parameters()} == devices


@pytest.mark.parametrize("trace", TRACES)
def test_one_tensor_passed_as_an_input_written_in_place_and_as_another_is_refused(trace: str) -> None:
    """``gm(t, t)``: the write to ``cache`` would not reach the copies of ``x``; eager sees it. Refused."""
    x = torch.randn(4, 8)
    model = CacheAdd()
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(x, torch.zeros(4, 8)), trace=trace, pins=PINS)
    shared = torch.randn(4, 8)
    before = shared.clone()
    with pytest.raises(FxsplitError, match=r"inputs 'x', 'cache' share memory, and the split writes 'cache'"):
        split(shared, shared)
    assert torch.equal(shared, before)  # refused before anything ran
    torch.testing.assert_close(split(x, torch.zeros(4, 8)), copy.deepcopy(model)(x, torch.zeros(4, 8)))
