"""Models that call a custom ``torch.autograd.Function``: a training plan is refused, any other plan warns, and a
leaf module keeps the Function's backward.

Both tracers record the ops of a Function's forward and drop its backward. Before
:mod:`fxsplit.tracing.customgrad`, a split of a gradient reversal layer or a straight-through estimator trained
with the gradients of those ops (the reversal's sign lost, the estimator's gradient zero), silently.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.autograd.function import Function

import fxsplit
from fxsplit import FxsplitWarning, TraceError
from fxsplit.tracing.customgrad import recording_functions
from tests.helpers import split_and_compare


class Reverse(Function):
    """Gradient reversal: identity forward, ``-grad`` backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class StraightThrough(Function):
    """``round`` forward, the gradient passed through unchanged."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Applies(nn.Module):
    def __init__(self, function: type[Function]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x)


class Model(nn.Module):
    def __init__(self, function: type[Function]) -> None:
        super().__init__()
        self.first, self.custom, self.last = nn.Linear(8, 8), Applies(function), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.custom(self.first(x)))


BUDGETS = {"cpu:0": "1MiB", "cpu:1": "1MiB"}
PINS = {"first": "cpu:0", "last": "cpu:1"}
FUNCTIONS = [Reverse, StraightThrough]


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda f: f.__name__)
def test_a_training_plan_is_refused_naming_the_function(trace: str, function: type[Function]) -> None:
    model = Model(function)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(TraceError, match=rf"custom autograd Functions \('{function.__name__}'\).*leaf_modules"):
        fxsplit.fxsplit(model, BUDGETS, example_inputs=(torch.randn(4, 8),), mode="training", trace=trace, pins=PINS)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]) and tensor.device.type == "cpu", name
    assert Function.__dict__["apply"].__func__.__qualname__ == "Function.apply"  # torch's own, put back


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("mode", ["inference", "weights"])
def test_other_plans_warn_and_compute_the_models_outputs(trace: str, mode: str) -> None:
    torch.manual_seed(0)
    model = Model(StraightThrough)
    x = torch.randn(4, 8)
    with pytest.warns(FxsplitWarning, match="'StraightThrough'.*do not train this split"):
        gm = fxsplit.fxsplit(model, BUDGETS, example_inputs=(x,), mode=mode, trace=trace, pins=PINS)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda f: f.__name__)
def test_a_leaf_module_keeps_the_functions_backward(function: type[Function]) -> None:
    """The fix the message gives: the module that applies the Function is a leaf, run as written."""
    torch.manual_seed(0)
    model = Model(function)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    budgets = {"cpu:0": 8 * total, "cpu:1": 8 * total}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        split_and_compare(
            model, budgets, (torch.randn(4, 8),), trace="fx", mode="training", pins=PINS, leaf_modules=[Applies]
        )
    if function is StraightThrough:  # round() alone has a zero gradient: the estimator's own reached `first`
        assert model.first.weight.grad is not None and model.first.weight.grad.abs().sum() > 0


def test_torchs_own_functions_are_not_recorded() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    with recording_functions() as met:
        torch_checkpoint.CheckpointFunction.apply(torch.sin, True, x).sum().backward()
        Reverse.apply(x)
    assert met == ["Reverse"]
    assert x.grad is not None
