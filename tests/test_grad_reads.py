"""A split whose model code branched on ``torch.is_grad_enabled()`` refuses the grad mode it was not traced under.

Both tracers run ``forward`` once and keep the branch of the mode they ran under. Before, a split traced with
gradients on and called under ``torch.no_grad()`` (or the other way) silently computed the other branch, on both
routes. Reads that change nothing, and the reads of torch's and fxsplit's own machinery, leave the split free.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import FxsplitError
from fxsplit.tracing.gradreads import GRAD_READS

BUDGETS = {"cpu:0": 2000, "cpu:1": 2000}
X = torch.randn(4, 16)
CALLS: list[str] = []


class Scaled(nn.Module):
    """Doubles its output only while gradients are on (a branch fx and export both fix)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS.append("Scaled")
        h = self.a(x)
        if torch.is_grad_enabled():
            h = h * 2
        return torch.relu(h)


class Indifferent(nn.Module):
    """Reads the grad mode, and computes the same in both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS.append("Indifferent")
        checkpointing = torch.is_grad_enabled() and False
        return torch.relu(self.a(x)) if not checkpointing else self.a(x)


class NoGradRegion(nn.Module):
    """A ``torch.no_grad()`` block: torch's own code reads the mode, the model's does not."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS.append("NoGradRegion")
        with torch.no_grad():
            scale = self.a.weight.abs().mean()
        return torch.relu(self.a(x)) * scale


def model(kind: type[nn.Module] = Scaled) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(kind(), kind(), nn.Linear(16, 4))


def _split(m: nn.Module, trace: str, **options: object) -> torch.nn.Module:
    split = fxsplit.fxsplit(m, BUDGETS, example_inputs=(X,), trace=trace, mode="weights", **options)
    plan = getattr(split, "plan", None) or split.meta["fxsplit_plan"]
    assert len(set(plan.param_devices.values())) == 2
    return split


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("traced_with_grad", [True, False])
def test_a_split_refuses_the_grad_mode_it_was_not_traced_under(trace: str, traced_with_grad: bool) -> None:
    m = model()
    with torch.set_grad_enabled(traced_with_grad):
        split = _split(m, trace)
        torch.testing.assert_close(split(X), m(X), rtol=0, atol=0)
    other = "off" if traced_with_grad else "on"
    with torch.set_grad_enabled(not traced_with_grad):
        with pytest.raises(FxsplitError, match=rf"called with gradients {other} it would not compute") as raised:
            split(X)
    message = str(raised.value)
    assert "torch.is_grad_enabled() (Scaled.forward at test_grad_reads.py:" in message
    assert "split the model under the grad mode you call it in" in message
    if trace == "fx":
        assert "leaf_modules=['0', '1']" in message


def test_the_split_computes_the_model_s_gradients_in_the_mode_it_was_traced_under() -> None:
    m, twin = model(), model()
    split = _split(twin, "fx")
    split(X).square().sum().backward()
    m(X).square().sum().backward()
    for (name, p), q in zip(m.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_leaf_modules_read_the_mode_as_they_run() -> None:
    m = model()
    split = _split(m, "fx", leaf_modules=["0", "1"])
    assert GRAD_READS not in split.meta
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(split(X), m(X), rtol=0, atol=0)


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("kind", [Indifferent, NoGradRegion])
def test_reads_that_change_nothing_leave_the_split_free(trace: str, kind: type[nn.Module]) -> None:
    m = model(kind)
    split = _split(m, trace)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(split(X), m(X), rtol=0, atol=0)


def test_a_model_that_reads_nothing_is_traced_once() -> None:
    CALLS.clear()
    _split(model(NoGradRegion), "fx")
    traced_once = len(CALLS)
    CALLS.clear()
    _split(model(Scaled), "fx")
    assert traced_once == 2  # each block's forward, once
    assert len(CALLS) == 2 * traced_once  # read: traced again under the other mode, to compare


def test_a_pipeline_refuses_the_other_mode_too() -> None:
    m = model()
    pipeline = _split(m, "fx", pipeline=fxsplit.PipelineConfig(chunks=2))
    torch.testing.assert_close(pipeline(X), m(X), rtol=0, atol=0)
    with torch.no_grad(), pytest.raises(FxsplitError, match="this pipeline was traced with gradients on"):
        pipeline(X)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_copy_of_the_split_refuses_it_too(trace: str) -> None:
    split = copy.deepcopy(_split(model(), trace))
    with torch.no_grad(), pytest.raises(FxsplitError, match="traced with gradients on"):
        split(X)
