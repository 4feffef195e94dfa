"""Models that call a custom ``torch.autograd.Function``: both tracers keep each call whole (torch.fx as a call of
the Function, torch.export as an op that calls it), so the split runs the Function's backward and trains with the
model's gradients.

Left to themselves, both tracers record the ops of a Function's forward and drop its backward. Before
:mod:`fxsplit.tracing.customgrad`, a split of a gradient reversal layer or a straight-through estimator trained
with the gradients of those ops (the reversal's sign lost, the estimator's gradient zero), silently.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.autograd.function import Function

import fxsplit
from fxsplit import FxsplitWarning, TraceError
from fxsplit.tracing import trace as fxsplit_trace
from fxsplit.tracing.customgrad import FUNCTION_RESULT, kept_function, recording_functions
from tests.helpers import assert_same_grads, split_and_compare


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


class Scaled(Function):
    """Non-tensor arguments (a float, an object, None) and a non-tensor result beside the tensor."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, scale: float, options: Options, mask: torch.Tensor | None) -> Any:
        ctx.scale = scale * options.factor  # type: ignore[attr-defined]
        out = x * ctx.scale if mask is None else x * mask * ctx.scale  # type: ignore[attr-defined]
        return out, options.tag

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor, _: object) -> tuple[Any, ...]:
        return -grad * ctx.scale, None, None, None  # type: ignore[attr-defined]


class Options:
    def __init__(self, factor: float, tag: int) -> None:
        self.factor, self.tag = factor, tag


class UsesScaled(nn.Module):
    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.first, self.last, self.options, self.masked = nn.Linear(8, 8), nn.Linear(8, 4), Options(0.5, 7), masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        out, tag = Scaled.apply(h, 3.0, self.options, (h > 0).float() if self.masked else None)
        return self.last(out) * tag


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


TRACES = ["fx", "export"]


def _calls(gm: torch.fx.GraphModule, function: type[Function], trace: str) -> int:
    """How many lines of the generated code call ``function`` whole."""
    call = (
        f"{function.__name__}_apply(" if trace == "fx" else f"torch.ops.fxsplit_functions.{function.__name__}.default("
    )
    return gm.code.count(call)


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("custom", ["cpu:0", "cpu:1"])
@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda f: f.__name__)
def test_each_call_is_kept_whole_and_the_split_trains_with_the_models_gradients(
    function: type[Function], custom: str, trace: str
) -> None:
    torch.manual_seed(0)
    model = Model(function)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        gm = split_and_compare(
            model, LARGE, (torch.randn(4, 8),), trace=trace, mode="training", pins={**PINS, "custom": custom}, steps=2
        )
    assert _calls(gm, function, trace) == 1  # one call of the Function, run as written
    assert model.first.weight.grad is not None and model.first.weight.grad.abs().sum() > 0  # round's would be 0


@pytest.mark.parametrize("trace", TRACES)
def test_a_function_that_calls_another_is_kept_alone(trace: str) -> None:
    traced = fxsplit_trace(Model(Tripled), example_inputs=(torch.randn(4, 8),), mode=trace)
    assert traced.custom_kept == ("Tripled",)
    kept = [n.target for n in traced.graph_module.graph.nodes if kept_function(n.target) is not None]
    assert [kept_function(target) for target in kept] == [Tripled]


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize(
    ("read_first", "mode"), [(False, "training"), (False, "inference"), (True, "inference")], ids=str
)
def test_a_function_that_writes_its_input_in_place_is_a_write_the_split_follows(
    read_first: bool, mode: str, trace: str
) -> None:
    """``ctx.mark_dirty``: the reader on the other device sees ``h`` as eager PyTorch does, before or after the
    write. (Read first, the reader is a Linear, whose weight takes it to cpu:1 although it runs before the writer
    on cpu:0: out of stage order, so the pins are read as a device map. Eager autograd forbids that write in
    training: the Linear saved ``h``.) torch.fx's graph reads ``h`` after the write from the node that made it, so
    the call is marked as a write; torch.export's reads the Function's result from then on."""
    torch.manual_seed(0)
    model = WritesInPlace(read_first, nn.Linear(8, 8) if read_first else Scale(3))
    x = torch.randn(1, 8)
    with torch.set_grad_enabled(mode == "training"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "pins read as a device map", FxsplitWarning)
        traced = fxsplit_trace(model, example_inputs=(x,), mode=trace)
        marked = {n.name: n.meta[FUNCTION_RESULT] for n in traced.graph_module.graph.nodes if FUNCTION_RESULT in n.meta}
        first = "first" if trace == "fx" else "linear"
        assert {k: (kind, str(node)) for k, (kind, node) in marked.items()} == (
            {"in_place_double_apply": ("write", first)} if trace == "fx" else {"getitem": ("view", first)}
        )
        pins = {"first": "cpu:0", "custom": "cpu:0", "other": "cpu:1", "last": "cpu:1"}
        gm = split_and_compare(model, LARGE, (x,), trace=trace, mode=mode, pins=pins)
    if trace == "fx":
        placement = gm.meta["fxsplit_plan"].placement
        assert placement["in_place_double_apply"] == "cpu:0" and placement["other" if read_first else "mul"] == "cpu:1"
        assert gm.code.count("first.to('cpu:1')") == (2 if read_first else 1)  # copied again after the write


@pytest.mark.parametrize("trace", TRACES)
def test_a_view_a_function_returns_is_followed_to_its_argument(trace: str) -> None:
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
        traced = fxsplit_trace(model, example_inputs=(torch.randn(4, 8),), mode=trace)
        marked = [
            (n.name, n.meta[FUNCTION_RESULT][0]) for n in traced.graph_module.graph.nodes if FUNCTION_RESULT in n.meta
        ]
        assert marked == [("reverse_apply" if trace == "fx" else "getitem", "view")]
        split_and_compare(model, LARGE, (torch.randn(4, 8),), trace=trace, mode="inference", pins=PINS)
        with pytest.raises(fxsplit.SpecError, match=r"write one tensor in place .*\(in 'custom'\)"):
            pins = {**PINS, "custom": "cpu:1"}
            fxsplit.plan(model, LARGE, example_inputs=(torch.randn(4, 8),), trace=trace, pins=pins)


@pytest.mark.parametrize("trace", TRACES)
def test_several_results_and_a_backward_of_their_own(trace: str) -> None:
    torch.manual_seed(0)
    pins = {"first": "cpu:0", "left": "cpu:0", "right": "cpu:1"}
    split_and_compare(TwoResultsModel(), LARGE, (torch.randn(4, 8),), trace=trace, mode="training", pins=pins)


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("masked", [False, True])
def test_non_tensor_arguments_and_results_are_kept_as_they_were(trace: str, masked: bool) -> None:
    torch.manual_seed(0)
    model = UsesScaled(masked)
    gm = split_and_compare(model, LARGE, (torch.randn(4, 8),), trace=trace, mode="training", pins=PINS)
    assert _calls(gm, Scaled, trace) == 1


@pytest.mark.parametrize("trace", TRACES)
def test_a_function_that_reads_parameters_directly_places_them_and_trains(trace: str) -> None:
    torch.manual_seed(0)
    model = OwnLinearModel()
    pins = {"first": "cpu:0", "own": "cpu:1", "last": "cpu:1"}
    gm = split_and_compare(model, LARGE, (torch.randn(4, 8),), trace=trace, mode="training", pins=pins)
    plan = gm.meta["fxsplit_plan"]
    assert plan.param_devices["own.weight"] == plan.param_devices["own.bias"] == "cpu:1"


class ReturnsItsInputModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = ReturnsItsInput.apply(self.first(x))
        return self.last(a + b)


def test_under_fx_a_tuple_holding_an_argument_is_refused_with_what_to_do() -> None:
    with pytest.raises(TraceError, match=r"'ReturnsItsInput' return, among several results, .*x\.clone\(\)"):
        fxsplit.fxsplit(ReturnsItsInputModel(), LARGE, example_inputs=(torch.randn(4, 8),), trace="fx", mode="training")
    assert Function.__dict__["apply"].__func__.__qualname__ == "Function.apply"


def test_under_export_a_tuple_holding_an_argument_is_followed() -> None:
    torch.manual_seed(0)
    pins = {"first": "cpu:0", "last": "cpu:1"}
    gm = split_and_compare(
        ReturnsItsInputModel(), LARGE, (torch.randn(4, 8),), trace="export", mode="training", pins=pins
    )
    marked = [(n.name, n.meta[FUNCTION_RESULT][0]) for n in gm.graph.nodes if FUNCTION_RESULT in n.meta]
    assert marked == [("getitem", "view")]


@pytest.mark.parametrize("trace", TRACES)
def test_the_plan_covers_the_memory_the_allocator_sees_around_a_kept_function(trace: str) -> None:
    """The memory model runs the Function, so it sees what its forward saves for its backward. (The plan is 12.5%
    above the allocator on cpu:1, as it is with ``OwnLinear`` a leaf module: an opaque call's backward.)"""
    from fxsplit.memory.allocmeter import allocated_peaks

    torch.manual_seed(0)
    x = torch.randn(64, 8)
    pins = {"first": "cpu:0", "own": "cpu:1", "last": "cpu:1"}
    options = {"example_inputs": (x,), "mode": "training", "optimizer": "sgd", "trace": trace, "pins": pins}
    gm = fxsplit.fxsplit(OwnLinearModel().train(), LARGE, **options)
    planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
    allocated = allocated_peaks(gm, x, backward=True)
    assert set(allocated) == {"cpu:0", "cpu:1"}, allocated
    leaf = fxsplit.plan(OwnLinearModel().train(), LARGE, **{**options, "trace": "fx"}, leaf_modules=[OwnLinear])
    assert planned == {d: row["activations_peak"] for d, row in leaf.memory.items()}
    for device, nbytes in allocated.items():
        assert nbytes - 64 <= planned[device] <= nbytes * 1.15 + 64, (device, planned, allocated)


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_pipeline_trains_a_kept_function_with_the_models_gradients(checkpoint: str, trace: str) -> None:
    torch.manual_seed(0)
    model = Model(StraightThrough)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    config = fxsplit.PipelineConfig(chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        options = {"mode": "training", "trace": trace, "pins": PINS, "pipeline": config}
        pipe = fxsplit.fxsplit(model, LARGE, example_inputs=(x,), **options)
    torch.testing.assert_close(pipe(x), reference(x))
    pipe(x).sum().backward()
    reference(x).sum().backward()
    assert_same_grads(model, reference)


def test_without_example_inputs_fx_keeps_the_call_too() -> None:
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
    assert _calls(gm, Reverse, "fx") == 1


def test_the_default_tracer_trains_it_with_no_warning() -> None:
    """``trace="auto"`` with example inputs is torch.export, which keeps the call."""
    torch.manual_seed(0)
    model = Model(Reverse)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        gm = fxsplit.fxsplit(model, BUDGETS, example_inputs=(x,), mode="training", pins=PINS)
    assert gm.meta["fxsplit_plan"].trace == "export" and _calls(gm, Reverse, "export") == 1
    gm(x).sum().backward()
    reference(x).sum().backward()
    assert_same_grads(model, reference)


def test_two_functions_of_one_name_get_an_op_each() -> None:
    def made(sign: float) -> type[Function]:
        class Same(Function):
            @staticmethod
            def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
                return x * 1.0

            @staticmethod
            def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
                return sign * grad

        return Same

    first, second = made(-1.0), made(2.0)

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.last(first.apply(self.first(x)) + second.apply(self.first(x)))

    torch.manual_seed(0)
    gm = split_and_compare(Both(), LARGE, (torch.randn(4, 8),), trace="export", mode="training", pins=PINS)
    ops = {n.target for n in gm.graph.nodes if kept_function(n.target) is not None}
    assert len(ops) == 2 and {kept_function(op) for op in ops} == {first, second}


class FirstRows(Function):
    """``2 * x[:n]``, ``n`` a size computed from the input; backward ``-grad``, padded back."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, n: int) -> torch.Tensor:
        ctx.missing = x.shape[0] - n  # type: ignore[attr-defined]
        return 2 * x[:n]

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -torch.nn.functional.pad(grad, (0, 0, 0, ctx.missing)), None  # type: ignore[attr-defined]


class AllButLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(FirstRows.apply(self.first(x), x.shape[0] - 1))


@pytest.mark.parametrize("trace", TRACES)
def test_a_size_argument_follows_the_input_under_dynamic_shapes(trace: str) -> None:
    """Traced on 4 rows, called on 7: the size is computed on each call, not the traced one kept."""
    torch.manual_seed(0)
    model = AllButLast()
    reference = copy.deepcopy(model)
    options = {"mode": "training", "trace": trace, "pins": PINS}
    dynamic = {"dynamic_shapes": "batch"} if trace == "export" else {}
    gm = fxsplit.fxsplit(model, LARGE, example_inputs=(torch.randn(4, 8),), **options, **dynamic)
    x = torch.randn(7, 8)
    out, expected = gm(x), reference(x)
    assert out.shape == (6, 4)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(model, reference)


def test_a_size_in_the_result_under_dynamic_shapes_is_refused_by_export() -> None:
    class ReturnsSize(Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> tuple[torch.Tensor, int]:
            return 2 * x, x.shape[0]

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor, _: object) -> torch.Tensor:
            return grad

    class Uses(Model):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, n = ReturnsSize.apply(self.first(x))
            return self.last(h) * n

    with pytest.raises(TraceError, match=r"'.*ReturnsSize' returns a number computed from a dynamic size"):
        fxsplit.plan(Uses(Reverse), LARGE, example_inputs=(torch.randn(4, 8),), trace="export", dynamic_shapes="batch")


def test_a_leaf_module_still_runs_the_function_as_written() -> None:
    torch.manual_seed(0)
    model = Model(StraightThrough)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        gm = split_and_compare(
            model, LARGE, (torch.randn(4, 8),), trace="fx", mode="training", pins=PINS, leaf_modules=[Applies]
        )
    assert "self.custom(" in gm.code


@pytest.mark.parametrize("keep", ["fx", "export"])
def test_apply_is_put_back_after_a_failed_trace(keep: str) -> None:
    class Fails(Model):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.custom(self.first(x))
            return self.last(h) if bool(h.sum() > 0) else self.last(-h)  # control flow on a value

    with pytest.raises(TraceError):
        fxsplit.fxsplit(Fails(Reverse), BUDGETS, example_inputs=(torch.randn(4, 8),), trace=keep, mode="training")
    assert Function.__dict__["apply"].__func__.__qualname__ == "Function.apply"


def test_torchs_own_functions_are_not_recorded() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    with recording_functions() as met:
        torch_checkpoint.CheckpointFunction.apply(torch.sin, True, x).sum().backward()
        Reverse.apply(x)
    assert met.dropped == ["Reverse"] and met.kept == []
    assert x.grad is not None


def _bloom() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(n_layer=2, hidden_size=32, n_head=2, vocab_size=128)
    return transformers.BloomForCausalLM(config)  # GeLUFunction in every block


def _recurrent_gemma() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.RecurrentGemmaConfig(
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        lru_width=32,
        attention_window_size=16,
        head_dim=16,
        block_types=["recurrent", "recurrent", "attention"],
    )
    return transformers.RecurrentGemmaForCausalLM(config)  # SqrtBoundDerivative: a clipped gradient


def _phimoe() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.PhimoeConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return transformers.PhimoeForCausalLM(config)  # PhimoeMultiplier: the router's own gradient


def _sew_d() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.SEWDConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        conv_dim=(32, 32),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        squeeze_factor=1,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        position_buckets=16,
        max_position_embeddings=64,
        mask_time_prob=0.0,  # numpy draws SpecAugment's mask: no graph keeps that (and the test cannot seed it)
    )
    return transformers.SEWDModel(config)  # XSoftmax, and XDropout: random numbers inside the Function


@pytest.mark.slow
@pytest.mark.parametrize(
    ("build", "function"),
    [
        (_bloom, "GeLUFunction"),
        (_recurrent_gemma, "SqrtBoundDerivative"),
        (_phimoe, "PhimoeMultiplier"),
        (_sew_d, "XDropout"),
    ],
    ids=["bloom", "recurrent_gemma", "phimoe", "sew_d"],
)
def test_hugging_face_models_with_custom_functions_train_split_with_their_gradients(build: Any, function: str) -> None:
    """Models only torch.export traces. PhiMoE's router gradient is its Function's own: with the forward's ops in
    its place (what export recorded before) the embedding's gradient differs. SEW-D's XDropout draws its mask
    inside the Function, in the order eager PyTorch does."""
    torch.manual_seed(0)
    model = build().train()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    audio = build is _sew_d
    inputs = torch.randn(2, 400, generator=generator) if audio else torch.randint(0, 128, (2, 8), generator=generator)
    budgets = {"cpu:0": int(0.6 * total), "cpu:1": int(0.6 * total)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        kwargs = {} if audio else {"use_cache": False}
        gm = split_and_compare(model, budgets, (inputs,), trace="export", kwargs=kwargs, mode="weights")
    assert f"torch.ops.fxsplit_functions.{function}.default(" in gm.code
