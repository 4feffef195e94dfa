"""What ``forward`` registers while it is traced (a buffer or a submodule made on the first call) is taken out
after, and refused, with what to do, when torch.export made it of fake tensors.

Before, under torch.export (the default with example inputs) the model was left with a fake buffer, or a
submodule of fake parameters, and planning failed with ``RuntimeError: Cannot access data pointer of Tensor``
from inside torch; under torch.fx, ``fxsplit.plan`` left the new buffer on the model, and a trace that failed left
the new submodule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import TraceError

BUDGETS = {"cpu:0": 400, "cpu:1": 400}
X = torch.randn(2, 4)


class FirstCall(nn.Module):
    """Makes, on its first call, a buffer (``how="buffer"``), a parameter or a submodule."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 4), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.how == "buffer":
            if not hasattr(self, "pos"):
                self.register_buffer("pos", torch.arange(4.0) * 0.5, persistent=False)
            return self.b(h + self.pos)
        if self.how == "parameter":
            if not hasattr(self, "scale"):
                self.scale = nn.Parameter(torch.full((4,), 2.0))
            return self.b(h * self.scale)
        if not hasattr(self, "extra"):
            self.extra = nn.Linear(4, 4)
        return self.b(self.extra(h))


def _structure(model: nn.Module) -> tuple[list[str], list[str]]:
    return sorted(model.state_dict(keep_vars=True)), [path for path, _ in model.named_modules()]


@pytest.mark.parametrize("how", ["buffer", "parameter", "submodule"])
def test_export_refuses_what_forward_registers_and_leaves_the_model_as_it_was(how: str) -> None:
    model = FirstCall(how).eval()
    before = _structure(model)
    name = {"buffer": "pos", "parameter": "scale", "submodule": "extra"}[how]
    with pytest.raises(TraceError, match=rf"forward registers '{name}' while it is traced.*Make it in __init__"):
        fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="export")
    assert _structure(model) == before
    assert not hasattr(model, name)


@pytest.mark.parametrize("how", ["buffer", "parameter", "submodule"])
def test_called_once_first_the_model_is_split_equal(how: str) -> None:
    """The fix the message gives: call the model once, so that what it makes exists before it is split."""
    torch.manual_seed(0)
    model = FirstCall(how).eval()
    with torch.no_grad():
        expected = model(X)
    split = fxsplit.fxsplit(model, {"cpu:0": 600, "cpu:1": 600}, example_inputs=(X,), trace="export")
    with torch.no_grad():
        torch.testing.assert_close(split(X), expected, rtol=0, atol=0)


def test_fx_plans_a_buffer_made_on_the_first_call_without_registering_it_on_the_model() -> None:
    """torch.fx makes the buffer of real values: the split holds its own, and ``plan`` leaves the model as it was
    (its own first call makes it, as before)."""
    torch.manual_seed(0)
    model = FirstCall("buffer").eval()
    before = _structure(model)
    fxsplit.plan(model, BUDGETS, example_inputs=(X,), trace="fx")
    assert _structure(model) == before and not hasattr(model, "pos")
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="fx")
    assert not hasattr(model, "pos")
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)
    assert hasattr(model, "pos")  # the model's own first call


def test_a_failed_fx_trace_leaves_no_submodule_behind() -> None:
    model = FirstCall("submodule").eval()
    before = _structure(model)
    with pytest.raises(TraceError, match="not installed as a submodule"):
        fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="fx")
    assert _structure(model) == before


def test_a_submodules_registration_is_named_by_its_path() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = FirstCall("buffer")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    with pytest.raises(TraceError, match=r"forward registers 'inner.pos' while"):
        fxsplit.fxsplit(Outer().eval(), BUDGETS, example_inputs=(X,), trace="export")
