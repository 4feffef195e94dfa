"""Example inputs the model cannot run are an error; a fallback or a plan without activations is a warning."""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from helpers import WithBatchNorm

import fxsplit
from fxsplit.errors import BudgetError, ExampleInputError, FxsplitWarning, TraceError
from fxsplit.planning.plan import Plan
from fxsplit.tracing.capture import trace

BUDGETS = {"cpu:0": "20KiB", "cpu:1": "20KiB"}
X = torch.randn(512, 64)


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


MODEL_LINE = re.escape(inspect.getsource(TwoLayers.forward).splitlines()[-1].strip())  # the user's line, in the message


def test_inputs_the_model_runs_give_the_budget_error() -> None:
    with pytest.raises(BudgetError, match=r"activations peak 256.00 KiB = 288.50 KiB"):
        fxsplit.plan(TwoLayers(), BUDGETS, example_inputs=(X,))


BAD_INPUTS: dict[str, tuple[Any, dict[str, Any] | None, list[str]]] = {
    "wrong width": (
        (torch.randn(512, 32),),
        None,
        [
            r"RuntimeError: a and b must have same reduction dim, but got \[512, 32\] X \[64, 64\]",
            r"x \(example_inputs\[0\]\) = float32\[512, 32\]",
            MODEL_LINE,
        ],
    ),
    "a list": (
        [X],
        None,
        [
            r"TypeError: linear\(\): argument 'input' \(position 1\) must be Tensor, not list",
            r"x \(example_inputs\[0\]\) = a list of 1: \[float32\[512, 64\]\]",
            r"a list given as example_inputs \(or inside its tuple\) reaches forward\(\) as one input: "
            r"only a tuple is spread over forward\(\)'s positional inputs",
            MODEL_LINE,
        ],
    ),
    "a dict": ({"x": X}, None, [r"not dict", r"a dict of 1: \{'x': float32\[512, 64\]\}", r"example_kwargs"]),
    "an unknown keyword": (
        (X,),
        {"y": 1},
        [
            r"forward\(x\) does not take them: got an unexpected keyword "
            r"argument 'y'",
            r"y \(example_kwargs\['y'\]\) = 1",
        ],
    ),
    "a missing input": ((), {"mask": X}, [r"missing a required argument: 'x'"]),
}


@pytest.mark.parametrize("mode", ["auto", "fx", "export"])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_inputs_the_model_cannot_run_are_an_error_naming_them(case: str, mode: str) -> None:
    inputs, keywords, expected = BAD_INPUTS[case]
    model = TwoLayers()
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(ExampleInputError) as caught:
        fxsplit.plan(model, BUDGETS, example_inputs=inputs, example_kwargs=keywords, trace=mode)
    message = str(caught.value)
    assert message.startswith("the model cannot run on the example inputs: ")
    for pattern in expected:
        assert re.search(pattern, message), (pattern, message)
    assert isinstance(caught.value, TraceError) and isinstance(caught.value, ValueError)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no torch traceback under it
    for name, parameter in model.named_parameters():
        assert parameter is before[name][0] and torch.equal(parameter, before[name][1])


def test_refusing_inputs_leaves_the_model_as_it_was() -> None:
    """A model in training mode with batch norm: the fake run must not touch its running statistics."""
    model = WithBatchNorm().train()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ExampleInputError, match=r"float32\[4, 5\]"):
        fxsplit.plan(model, {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(torch.randn(4, 5),))
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert model.training


class Settings:
    """A plain object as an input: torch.export refuses it, torch.fx follows its attributes."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, settings: Settings) -> torch.Tensor:
        return self.b(self.a(x) * settings.scale)


def test_export_failing_on_good_inputs_falls_back_to_fx_with_a_warning() -> None:
    with pytest.warns(
        FxsplitWarning,
        match=r"torch.export could not trace the model \(ValueError: Unsupported input "
        r"type .*Settings.*\); fxsplit traced it with torch.fx instead",
    ):
        traced = trace(Scaled(), example_inputs=(X, Settings(2.0)))
    assert traced.method == "fx" and traced.has_shapes
    assert issubclass(FxsplitWarning, UserWarning) and fxsplit.FxsplitWarning is FxsplitWarning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trace(Scaled(), example_inputs=(X, Settings(2.0)), mode="fx").method == "fx"  # chosen: no warning


def test_an_input_fake_propagation_cannot_record_is_not_a_silent_gap() -> None:
    """The fx graph has sizes, but not of ``settings``: the activations cannot be profiled, and the plan says so."""
    with pytest.warns(FxsplitWarning) as caught:
        plan = fxsplit.plan(Scaled(), BUDGETS, example_inputs=(X, Settings(2.0)))
    reason = "no example value recorded for input(s) settings (fake shape propagation records tensors and numbers only)"
    assert plan.activations_not_counted == reason
    assert any(str(w.message).startswith(f"activations not counted: {reason}") for w in caught)


def test_fallback_without_sizes_warns_and_the_plan_says_so() -> None:
    """Cumulative batch norm: export fails on good inputs, and fake propagation of the fx graph fails too."""
    model = WithBatchNorm(cumulative=True)
    with pytest.warns(FxsplitWarning) as caught:
        plan = fxsplit.plan(model, {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(torch.randn(4, 8),))
    messages = [str(w.message) for w in caught]
    assert any("fxsplit traced it with torch.fx instead: that graph has no sizes" in m for m in messages)
    assert any(m.startswith("activations not counted: running the fx graph on fake tensors failed") for m in messages)
    assert plan.trace == "fx" and "activations_peak" not in plan.memory["cpu:0"]
    assert plan.activations_not_counted is not None
    assert plan.activations_not_counted.startswith("running the fx graph on fake tensors failed: ")


class Host(nn.Module):
    """Computes on the host with numpy: runs on real tensors only (not on fake ones)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.detach().numpy() * 2)


class WithHost(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.host = Host()
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.host(self.a(x)))


def test_a_model_fake_tensors_cannot_run_is_not_blamed_on_its_inputs() -> None:
    with pytest.warns(
        FxsplitWarning,
        match=r"activations not counted: running the fx graph on fake tensors failed: "
        r"RuntimeError: .numpy\(\) is not supported",
    ):
        plan = fxsplit.plan(WithHost(), BUDGETS, example_inputs=(X,), trace="fx", leaf_modules=[Host])
    assert "activations not counted: running the fx graph" in str(plan)


def test_print_plan_says_activations_are_not_counted_and_the_file_keeps_it() -> None:
    with pytest.warns(FxsplitWarning, match="activations not counted: no example_inputs"):
        plan = fxsplit.plan(TwoLayers(), BUDGETS)
    assert plan.activations_not_counted == "no example_inputs, so the graph has no sizes"
    assert str(plan).splitlines()[-1] == (
        "activations not counted: no example_inputs, so the graph has no sizes; "
        "leave room in the budgets or pass example_inputs"
    )
    text = plan.to_yaml()
    assert "activations_not_counted: no example_inputs, so the graph has no sizes\n" in text
    assert Plan.from_yaml(text) == plan and Plan.from_dict(plan.to_dict()) == plan
    old_file = "".join(line for line in text.splitlines(keepends=True) if "activations_not_counted" not in line)
    assert Plan.from_yaml(old_file).activations_not_counted is None
    with pytest.raises(fxsplit.SpecError, match=r"activations_not_counted: must be a reason \(text\) or null"):
        Plan.from_yaml(
            text.replace(
                "activations_not_counted: no example_inputs, so the graph has no sizes", "activations_not_counted: [1]"
            )
        )


def test_plans_that_count_activations_or_need_not_say_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weights = fxsplit.plan(TwoLayers(), BUDGETS, mode="weights")
        counted = fxsplit.plan(TwoLayers(), {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(X,))
    for plan in (weights, counted):
        assert plan.activations_not_counted is None and "not counted" not in str(plan)
        assert "activations_not_counted" not in plan.to_yaml()


class Flagged(nn.Module):
    """A forward with a tensor keyword and a non-tensor one, like ``T5(ids, use_cache=..., decoder_input_ids=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, y: Any = None, flag: bool = True, z: Any = None) -> torch.Tensor:
        out = self.a(x) + y
        return out * 2 if flag else out + z


@pytest.mark.parametrize("order", ["constant first", "constant last", "constant between"])
def test_constant_keyword_inputs_are_defaults_in_any_order(order: str) -> None:
    """A non-tensor keyword input of an export trace is a default of the split, wherever it was passed."""
    y, z = torch.randn(512, 64), torch.randn(512, 64)
    kwargs = {
        "constant first": {"flag": False, "y": y, "z": z},
        "constant last": {"y": y, "z": z, "flag": False},
        "constant between": {"y": y, "flag": False, "z": z},
    }[order]
    model = Flagged()
    gm = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), example_kwargs=kwargs, trace="export", mode="weights")
    parameters = inspect.signature(gm.forward).parameters
    assert parameters["flag"].default is False
    torch.testing.assert_close(gm(X, y=y, z=z), model(X, y=y, z=z, flag=False))
    torch.testing.assert_close(gm(X, z=z, y=y, flag=False), model(X, y=y, z=z, flag=False))
    if order == "constant last":  # trailing defaults: the keyword inputs stay positional too
        torch.testing.assert_close(gm(X, y, z), model(X, y=y, z=z, flag=False))
    else:  # a constant before a keyword without default: keyword-only, as they were passed when traced
        assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in kwargs)


class FlaggedTwo(nn.Module):
    """Two stages' worth of ops, with a constant keyword input before a tensor one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, flag: bool = True, y: Any = None) -> torch.Tensor:
        h = self.a(x)
        return self.b(h * 2 if flag else h + y)


def test_constant_keyword_inputs_are_defaults_of_a_pipeline_and_its_stages() -> None:
    """A pipeline is called as the split is: without the constant keyword inputs it was traced with (its input
    binder, and the first of ``pipeline_stages``' modules, once took every argument, so ``gm(x, y=y)`` failed
    with "forward() missing 1 required positional argument: 'flag'")."""
    model, y = FlaggedTwo().eval(), torch.randn(512, 64)
    kwargs = {"flag": False, "y": y}
    budgets = {"cpu:0": "18KiB", "cpu:1": "18KiB"}  # one Linear each
    pipeline = fxsplit.fxsplit(
        copy.deepcopy(model),
        budgets,
        example_inputs=(X,),
        example_kwargs=kwargs,
        trace="export",
        pipeline=2,
        mode="weights",
    )
    plan = pipeline.meta["fxsplit_plan"]
    assert all(plan.modules[device] for device in plan.devices)
    with torch.no_grad():
        want = torch.cat([model(x, flag=False, y=part) for x, part in zip(X.chunk(2), y.chunk(2), strict=True)])
        assert torch.equal(pipeline(X, y=y), want)
        assert torch.equal(pipeline(X, y=y, flag=False), want)
        with pytest.raises(fxsplit.FxsplitError, match="flag"):  # another value still fails export's guard
            pipeline(X, y=y, flag=True)

    stages = fxsplit.pipeline_stages(
        model, budgets, example_inputs=(X,), example_kwargs=kwargs, trace="export", chunks=2, mode="weights"
    )
    assert len(stages) == 2
    first = inspect.signature(stages.modules[0].forward).parameters
    assert first["flag"].default is False and first["flag"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "flag" not in inspect.signature(stages.modules[1].forward).parameters
    with torch.no_grad():
        middle = stages.modules[0](X[:256], y=y[:256])
        out = stages.modules[1](*(middle if isinstance(middle, tuple) else (middle,)))
    assert torch.equal(out, want[:256])


def test_warnings_point_at_the_line_that_called_fxsplit() -> None:
    """Not at a line inside fxsplit or torch, however deep the warning was raised (``-W error`` names the call)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxsplit.plan(TwoLayers(), {"cpu:0": "1MiB"}, trace="fx")  # no example inputs: activations not counted
        pipeline = fxsplit.fxsplit(
            nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
            {"cpu:0": "1MiB"},
            example_inputs=(torch.randn(4, 4),),
            trace="fx",
            pipeline=2,
            mode="weights",
        )
        pipeline(torch.randn(4, 4))  # batch statistics over micro-batches: warned at this call
    ours = [w for w in caught if issubclass(w.category, FxsplitWarning)]
    assert len(ours) >= 2 and all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]


class _OptionalMask(torch.nn.Module):
    """timm's ``VisionTransformer.forward(x, attn_mask=None)``: an input the caller leaves at its default."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_an_input_left_at_its_default_none_still_lets_fx_count_activations() -> None:
    """Found by an outside check on timm's ViT: fx makes a placeholder for ``attn_mask``, which the fake run never
    gave a value, so the plan warned 'activations not counted' and charged none (up to 348,880 B held)."""
    from fxsplit.memory.allocmeter import allocated_peaks

    torch.manual_seed(0)
    model, x = _OptionalMask().eval(), torch.randn(8, 64)
    expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxsplit.FxsplitWarning)
        gm = fxsplit.fxsplit(model, {"cpu:0": "1GiB"}, example_inputs=(x,), trace="fx")
    planned = gm.meta["fxsplit_plan"].memory["cpu:0"]["activations_peak"]
    with torch.no_grad():
        assert planned == allocated_peaks(gm, x)["cpu:0"] > 0
        torch.testing.assert_close(gm(x), expected)


class PicksByMask(nn.Module):
    """Takes the positions a mask picks (``nonzero``: as many as the mask's values say; Mochi's attention does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        picked = torch.nonzero(mask[0]).flatten()
        return self.b(self.a(x)[:, picked]).sum(1)


def test_a_size_the_inputs_values_decide_is_not_blamed_on_the_example_inputs() -> None:
    """Before, print(plan) ended with "or pass example_inputs", which were passed (diffusers sweep: Mochi)."""
    x, mask = torch.randn(2, 6, 8), torch.tensor([[1, 1, 1, 0, 0, 0]] * 2)
    with pytest.warns(FxsplitWarning, match="activations not counted") as caught:
        plan = fxsplit.plan(
            PicksByMask(), {"cpu:0": "64KiB", "cpu:1": "64KiB"}, example_inputs=(x, mask), trace="export"
        )
    assert not any("pass example_inputs" in str(w.message) for w in caught)
    last = str(plan).splitlines()[-1]
    assert last.startswith("activations not counted:") and last.endswith("leave room in the budgets")


def test_where_a_failure_happened_skips_code_made_at_run_time() -> None:
    """A message said "at <string>:1:" (transformers' generated __init__ of its outputs; generation sweep)."""
    from fxsplit.tracing.example_inputs import user_frame

    namespace: dict[str, Any] = {}
    exec(compile("def made():\n    raise ValueError('inside')\n", "<string>", "exec"), namespace)  # noqa: S102

    def calls_it() -> None:
        namespace["made"]()

    with pytest.raises(ValueError) as raised:
        calls_it()
    where = user_frame(raised.value)
    assert "<string>" not in where and "test_example_inputs.py" in where and "namespace" in where


class _Boxed:
    """An output type torch.export cannot flatten (not a registered pytree node)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class GroupedExperts(nn.Module):
    """Two experts as Hugging Face's MoE layers run them: ``grouped_mm`` when run as is (its CPU kernel takes
    float32, its meta kernel only bfloat16), a plain matmul per group when compiled or exported."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 8, 4))

    def forward(self, x: torch.Tensor) -> _Boxed:
        if torch.compiler.is_compiling():
            return _Boxed(torch.cat([x[:4] @ self.weight[0], x[4:] @ self.weight[1]]))
        offsets = torch.tensor([4, 8], dtype=torch.int32)
        return _Boxed(torch.nn.functional.grouped_mm(x, self.weight, offs=offsets))


def test_a_meta_kernel_stricter_than_the_real_one_is_not_blamed_on_the_inputs() -> None:
    """Export fails on the output type; the fake run behind the inputs check fails in grouped_mm's meta kernel,
    on a path export does not take. The error is export's (and its cause), not 'cannot run on the inputs'."""
    model, x = GroupedExperts(), torch.randn(8, 8)
    assert model(x).tensor.shape == (8, 4)  # it runs on these inputs
    with pytest.raises(TraceError, match="torch.export could not trace") as raised:
        fxsplit.plan(model, BUDGETS, example_inputs=(x,), trace="export")
    assert not isinstance(raised.value, ExampleInputError)
    assert "_Boxed" in str(raised.value) and "BF16" not in str(raised.value)
