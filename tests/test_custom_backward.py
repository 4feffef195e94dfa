"""Models that call a custom ``torch.autograd.Function``: torch.fx keeps each call whole (backward included) and
the split trains with the model's gradients; a torch.export graph lacks the backward, so its training plan is
refused (``trace="auto"`` switches to fx) and any other plan warns.

Left to themselves, both tracers record the ops of a Function's forward and drop its backward. Before
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
from fxsplit.tracing import trace
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


class InPlaceDouble(Function):
    """Doubles its input in place (``ctx.mark_dirty``); backward ``2 * grad``."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)  # type: ignore[attr-defined]
        return x.mul_(2)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return 2 * grad


class TwoResults(Function):
    """``(2x, 3x)``, with a backward of its own: ``g1 - g2`` (not what the forward's ops would give)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return 2 * x, 3 * x

    @staticmethod
    def backward(ctx: object, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return first - second


class ReturnsItsInput(Function):
    """``(x, 2x)``: the first result is the argument itself, inside a tuple."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, 2 * x

    @staticmethod
    def backward(ctx: object, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return first + 2 * second


class HalfWeightGradLinear(Function):
    """``x @ w.T + b`` whose weight gradient is halved: saves its inputs, reads parameters directly."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)  # type: ignore[attr-defined]
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad @ weight, 0.5 * grad.t() @ x, grad.sum(0)


class Tripled(Function):
    """A Function whose forward applies another (``Reverse``): only the outer one is kept; backward ``3 * grad``."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return Reverse.apply(x) * 1.0

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return 3 * grad


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


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.factor


class WritesInPlace(nn.Module):
    """``h`` doubled in place by a Function on one device, read by ``other`` on another before or after the write."""

    def __init__(self, read_first: bool, other: nn.Module) -> None:
        super().__init__()
        self.read_first = read_first
        self.first, self.custom, self.other, self.last = nn.Linear(8, 8), Applies(InPlaceDouble), other, nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.read_first:
            a = self.other(h)
            b = self.custom(h)
        else:
            b = self.custom(h)
            a = self.other(h)
        return self.last(a + b)


class TwoResultsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.left, self.right = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = TwoResults.apply(self.first(x))
        return self.left(a) * self.right(b)


class OwnLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(8, 8) / 3), nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return HalfWeightGradLinear.apply(x, self.weight, self.bias)


class OwnLinearModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.own, self.last = nn.Linear(8, 8), OwnLinear(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.own(torch.tanh(self.first(x))))


BUDGETS = {"cpu:0": "1MiB", "cpu:1": "1MiB"}
PINS = {"first": "cpu:0", "last": "cpu:1"}
FUNCTIONS = [Reverse, StraightThrough, Tripled]
LARGE = {"cpu:0": 1 << 24, "cpu:1": 1 << 24}


@pytest.mark.parametrize("custom", ["cpu:0", "cpu:1"])
@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda f: f.__name__)
def test_fx_keeps_each_call_whole_and_the_split_trains_with_the_models_gradients(
    function: type[Function], custom: str
) -> None:
    torch.manual_seed(0)
    model = Model(function)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        gm = split_and_compare(
            model, LARGE, (torch.randn(4, 8),), trace="fx", mode="training", pins={**PINS, "custom": custom}, steps=2
        )
    assert f"{function.__name__}_apply(" in gm.code  # one call of the Function, run as written
    assert model.first.weight.grad is not None and model.first.weight.grad.abs().sum() > 0  # round's would be 0


def test_a_function_that_calls_another_is_kept_alone() -> None:
    traced = trace(Model(Tripled), example_inputs=(torch.randn(4, 8),), mode="fx")
    assert traced.custom_kept == ("Tripled",) and traced.custom_backward == ()
    assert [n.name for n in traced.graph_module.graph.nodes if n.op == "call_function"] == ["tripled_apply"]


@pytest.mark.parametrize(
    ("read_first", "mode"), [(False, "training"), (False, "inference"), (True, "inference")], ids=str
)
def test_a_function_that_writes_its_input_in_place_is_a_write_the_split_follows(read_first: bool, mode: str) -> None:
    """``ctx.mark_dirty``: the reader on the other device sees ``h`` as eager PyTorch does, before or after the
    write. (Read first, the reader is a Linear, whose weight takes it to cpu:1 although it runs before the writer
    on cpu:0: out of stage order, so the pins are read as a device map. Eager autograd forbids that write in
    training: the Linear saved ``h``.)"""
    torch.manual_seed(0)
    model = WritesInPlace(read_first, nn.Linear(8, 8) if read_first else Scale(3))
    x = torch.randn(1, 8)
    with torch.set_grad_enabled(mode == "training"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "pins read as a device map", FxsplitWarning)
        traced = trace(model, example_inputs=(x,), mode="fx")
        (call,) = [n for n in traced.graph_module.graph.nodes if n.name == "in_place_double_apply"]
        assert call.meta["fxsplit_function_result"] == ("write", call.args[0])
        pins = {"first": "cpu:0", "custom": "cpu:0", "other": "cpu:1", "last": "cpu:1"}
        gm = split_and_compare(model, LARGE, (x,), trace="fx", mode=mode, pins=pins)
    placement = gm.meta["fxsplit_plan"].placement
    assert placement["in_place_double_apply"] == "cpu:0" and placement["other" if read_first else "mul"] == "cpu:1"
    assert gm.code.count("first.to('cpu:1')") == (2 if read_first else 1)  # copied again after the write


def test_a_view_a_function_returns_is_followed_to_its_argument() -> None:
    """``Reverse`` returns ``x.view_as(x)``: a later in-place write to ``x`` shows through it, so the view stays
    with ``x`` (a copy elsewhere would miss the write)."""

    class WrittenAfter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.custom, self.last = nn.Linear(8, 8), Applies(Reverse), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.first(x)
            r = self.custom(h)
            h.add_(1)
            return self.last(r)

    torch.manual_seed(0)
    model = WrittenAfter()
    with torch.no_grad():  # autograd forbids writing the base of a view a custom Function made
        traced = trace(model, example_inputs=(torch.randn(4, 8),), mode="fx")
        (call,) = [n for n in traced.graph_module.graph.nodes if n.name == "reverse_apply"]
        assert call.meta["fxsplit_function_result"] == ("view", call.args[0])
        split_and_compare(model, LARGE, (torch.randn(4, 8),), trace="fx", mode="inference", pins=PINS)
        with pytest.raises(fxsplit.SpecError, match=r"write one tensor in place .*'reverse_apply' \(in 'custom'\)"):
            pins = {**PINS, "custom": "cpu:1"}
            fxsplit.plan(model, LARGE, example_inputs=(torch.randn(4, 8),), trace="fx", pins=pins)


def test_several_results_and_a_backward_of_their_own() -> None:
    torch.manual_seed(0)
    pins = {"first": "cpu:0", "left": "cpu:0", "right": "cpu:1"}
    split_and_compare(TwoResultsModel(), LARGE, (torch.randn(4, 8),), trace="fx", mode="training", pins=pins)


def test_a_function_that_reads_parameters_directly_places_them_and_trains() -> None:
    torch.manual_seed(0)
    model = OwnLinearModel()
    pins = {"first": "cpu:0", "own": "cpu:1", "last": "cpu:1"}
    gm = split_and_compare(model, LARGE, (torch.randn(4, 8),), trace="fx", mode="training", pins=pins)
    plan = gm.meta["fxsplit_plan"]
    assert plan.param_devices["own.weight"] == plan.param_devices["own.bias"] == "cpu:1"


def test_a_tuple_holding_an_argument_is_refused_with_what_to_do() -> None:
    class Model2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = ReturnsItsInput.apply(self.first(x))
            return a + b

    with pytest.raises(TraceError, match=r"'ReturnsItsInput' return, among several results, .*x\.clone\(\)"):
        fxsplit.fxsplit(Model2(), LARGE, example_inputs=(torch.randn(4, 8),), trace="fx", mode="training")
    assert Function.__dict__["apply"].__func__.__qualname__ == "Function.apply"


def test_the_plan_covers_the_memory_the_allocator_sees_around_a_kept_function() -> None:
    """The memory model runs the Function, so it sees what its forward saves for its backward. (The plan is 12.5%
    above the allocator on cpu:1, as it is with ``OwnLinear`` a leaf module: an opaque call's backward.)"""
    from fxsplit.memory.allocmeter import allocated_peaks

    torch.manual_seed(0)
    x = torch.randn(64, 8)
    pins = {"first": "cpu:0", "own": "cpu:1", "last": "cpu:1"}
    options = {"example_inputs": (x,), "mode": "training", "optimizer": "sgd", "trace": "fx", "pins": pins}
    gm = fxsplit.fxsplit(OwnLinearModel().train(), LARGE, **options)
    planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
    allocated = allocated_peaks(gm, x, backward=True)
    assert set(allocated) == {"cpu:0", "cpu:1"}, allocated
    leaf = fxsplit.plan(OwnLinearModel().train(), LARGE, **options, leaf_modules=[OwnLinear]).memory
    assert planned == {d: row["activations_peak"] for d, row in leaf.items()}
    for device, nbytes in allocated.items():
        assert nbytes - 64 <= planned[device] <= nbytes * 1.15 + 64, (device, planned, allocated)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_pipeline_trains_a_kept_function_with_the_models_gradients(checkpoint: str) -> None:
    from tests.helpers import assert_same_grads

    torch.manual_seed(0)
    model = Model(StraightThrough)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    config = fxsplit.PipelineConfig(chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        options = {"mode": "training", "trace": "fx", "pins": PINS, "pipeline": config}
        pipe = fxsplit.fxsplit(model, LARGE, example_inputs=(x,), **options)
    torch.testing.assert_close(pipe(x), reference(x))
    pipe(x).sum().backward()
    reference(x).sum().backward()
    assert_same_grads(model, reference)


def test_without_example_inputs_the_call_is_kept_too() -> None:
    torch.manual_seed(0)
    model = Model(Reverse)
    gm = fxsplit.fxsplit(model, LARGE, trace="fx", mode="weights", pins=PINS)
    x = torch.randn(4, 8, requires_grad=True)
    reference = copy.deepcopy(model)
    gm(x).sum().backward()
    expected = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    reference(x).sum().backward()
    torch.testing.assert_close(expected, x.grad)
    assert "reverse_apply" in gm.code


@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda f: f.__name__)
def test_export_graphs_lack_the_backward_so_a_training_plan_is_refused(function: type[Function]) -> None:
    model = Model(function)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(TraceError, match=rf"custom autograd Functions \('{function.__name__}'.*trace='fx'"):
        fxsplit.fxsplit(model, BUDGETS, example_inputs=(torch.randn(4, 8),), mode="training", trace="export", pins=PINS)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]) and tensor.device.type == "cpu", name
    assert Function.__dict__["apply"].__func__.__qualname__ == "Function.apply"  # torch's own, put back


@pytest.mark.parametrize("mode", ["inference", "weights"])
def test_other_export_plans_warn_and_compute_the_models_outputs(mode: str) -> None:
    torch.manual_seed(0)
    model = Model(StraightThrough)
    x = torch.randn(4, 8)
    with pytest.warns(FxsplitWarning, match="'StraightThrough'.*do not train this split"):
        gm = fxsplit.fxsplit(model, BUDGETS, example_inputs=(x,), mode=mode, trace="export", pins=PINS)
    assert gm.meta["fxsplit_plan"].trace == "export"
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


def test_auto_plans_training_with_fx_and_says_so() -> None:
    """``trace="auto"`` with example inputs would take torch.export; for training it takes fx, with a warning."""
    from tests.helpers import assert_same_grads

    torch.manual_seed(0)
    model = Model(Reverse)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with pytest.warns(FxsplitWarning, match=r"\('Reverse'\) whose backward torch\.export drops; fxsplit traced it"):
        gm = fxsplit.fxsplit(model, BUDGETS, example_inputs=(x,), mode="training", pins=PINS)
    assert gm.meta["fxsplit_plan"].trace == "fx"
    gm(x).sum().backward()
    reference(x).sum().backward()
    assert_same_grads(model, reference)


def test_auto_refuses_training_when_fx_cannot_trace_the_model_either() -> None:
    class Branches(Model):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.custom(self.first(x))
            return self.last(h) if x.shape[0] > 2 else self.last(-h)  # control flow on a size: export, not fx

    with pytest.raises(TraceError, match=r"refuses to plan it for training(.|\n)*torch\.fx failed too"):
        fxsplit.fxsplit(Branches(Reverse), BUDGETS, example_inputs=(torch.randn(4, 8),), mode="training")
    assert Function.__dict__["apply"].__func__.__qualname__ == "Function.apply"


def test_a_leaf_module_still_runs_the_function_as_written() -> None:
    torch.manual_seed(0)
    model = Model(StraightThrough)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        gm = split_and_compare(
            model, LARGE, (torch.randn(4, 8),), trace="fx", mode="training", pins=PINS, leaf_modules=[Applies]
        )
    assert "self.custom(" in gm.code


def test_torchs_own_functions_are_not_recorded() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    with recording_functions() as met:
        torch_checkpoint.CheckpointFunction.apply(torch.sin, True, x).sum().backward()
        Reverse.apply(x)
    assert met.dropped == ["Reverse"] and met.kept == []
    assert x.grad is not None
