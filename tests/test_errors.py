"""Errors say what is wrong, with the numbers, and what to do: their messages are part of the contract."""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest
import torch
import torch.nn as nn

import fxsplit

X = (torch.randn(2, 16),)
LINEAR = (16 * 16 + 16) * 4  # bytes of one Linear(16, 16)


def three_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 16))


def test_total_over_the_sum_of_budgets_says_by_how_much() -> None:
    with pytest.raises(fxsplit.BudgetError) as info:
        fxsplit.plan(three_linears(), {"cpu:0": 1000, "cpu:1": 1000}, example_inputs=X, mode="weights")
    message = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, fxsplit.FxsplitError)
    assert "with mode='weights' the model needs parameters 3.19 KiB" in message  # 3 * LINEAR bytes
    assert "before splitting, but the budgets add up to 1.95 KiB: the parameters alone exceed them" in message
    assert f"short by 1.23 KiB ({3 * LINEAR - 2000} bytes); raise the budgets or add a device" in message
    assert "parameters 3.19 KiB = 3.19 KiB" not in message  # one component: no sum of one term


def test_error_for_one_piece_says_what_the_mode_counts_and_the_whole_model() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 64))
    with pytest.raises(fxsplit.BudgetError) as info:
        fxsplit.plan(model, {"cpu:0": 3000, "cpu:1": 4000}, example_inputs=X, mode="weights")
    message = str(info.value)
    assert (
        "(with mode='weights' a budget holds its parameters and buffers; the whole model needs parameters "
        "5.31 KiB)" in message
    )  # (16 * 16 + 16 + 16 * 64 + 64) * 4 bytes
    with pytest.raises(fxsplit.BudgetError) as info:
        fxsplit.plan(model, {"cpu:0": 3000, "cpu:1": 4000}, example_inputs=X)
    assert re.search(
        r"\(with mode='inference' a budget holds its parameters, buffers and activations; the whole "
        r"model needs parameters 5.31 KiB, activations peak \d+ B = [\d.]+ KiB\)",
        str(info.value),
    )


def test_one_parameter_larger_than_every_device_is_named() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 64))
    big = (16 * 64 + 64) * 4
    with pytest.raises(fxsplit.BudgetError) as info:
        fxsplit.plan(model, {"cpu:0": 3000, "cpu:1": 4000, "cpu:2": 2000}, example_inputs=X, mode="weights")
    message = str(info.value)
    assert "'2.weight' 4.00 KiB" in message and "'2.bias' 256 B" in message
    assert f"needs 4.25 KiB ({big} bytes)" in message
    assert "more than the budget of every device (the largest, 'cpu:1', has 3.91 KiB)" in message
    assert f"short by 352 B ({big - 4000} bytes)" in message


class UnreadTable(nn.Module):
    """A 256 KiB table ``forward`` never reads beside two small layers."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Embedding(1024, 64)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_a_weight_no_op_reads_is_charged_no_gradient_when_it_does_not_fit() -> None:
    """Found by a sweep of Hugging Face models (LUKE's entity table): in training, a weight no op reads gets no
    gradient and no optimizer state, and plans charge it none, but the error for budgets too small for it said
    the model needed them (here 4 x its 256 KiB, "short by" more than the whole model) and pointed at the
    gradients. It now names the unread tensor and what the budgets leave."""
    model = UnreadTable()
    alone = fxsplit.plan(model, {"cpu:0": 1 << 30}, example_inputs=X, mode="training")
    assert alone.memory["cpu:0"]["grads"] == 2 * LINEAR  # the two layers' only
    each = int(0.95 * alone.memory["cpu:0"]["total"])  # together more than the model, each less than the table
    with pytest.raises(fxsplit.BudgetError) as info:
        fxsplit.plan(model, {"cpu:0": each, "cpu:1": each}, example_inputs=X, mode="training")
    message = str(info.value)
    assert "the tensors no op of the graph reads (256.00 KiB: 'unused.weight' 256.00 KiB) do not fit" in message
    assert f"gradients {2 * LINEAR / 1024:.2f} KiB" in message, message  # the whole model's, in the summary
    assert "adding the gradients" not in message


def test_same_errors_from_fxsplit_and_from_fx_tracing() -> None:
    for kwargs in ({"example_inputs": X}, {"trace": "fx"}):
        with pytest.raises(fxsplit.BudgetError, match=rf"short by .* \({3 * LINEAR - 2000} bytes\)"):
            fxsplit.fxsplit(three_linears(), {"cpu:0": 1000, "cpu:1": 1000}, mode="weights", **kwargs)


def test_pinned_piece_too_big_for_its_device() -> None:
    with pytest.raises(fxsplit.BudgetError) as info:
        fxsplit.plan(
            three_linears(),
            {"cpu:0": 2 * LINEAR, "cpu:1": LINEAR - 8, "cpu:2": 2 * LINEAR},
            example_inputs=X,
            pins={"3": "cpu:1"},
            mode="weights",
        )
    message = str(info.value)
    assert "budget of pinned device 'cpu:1'" in message and "short by 8 B (8 bytes)" in message
    assert "raise that budget or unpin" in message


def test_fragmentation_says_how_much_more_would_fit() -> None:
    # 3 equal layers, 2 devices of 1.5 layers: the total fits, no order of layers does.
    with pytest.raises(fxsplit.BudgetError) as info:
        fxsplit.plan(
            three_linears(), {"cpu:0": 3 * LINEAR // 2, "cpu:1": 3 * LINEAR // 2}, example_inputs=X, mode="weights"
        )
    message = str(info.value)
    assert "cannot be packed into the devices without exceeding a budget, in order or out of order" in message
    percent = float(re.search(r"raised by ([0-9.]+)%", message).group(1))  # type: ignore[union-attr]
    assert 30 <= percent <= 36  # 2 layers per device needed: +33.3%
    assert "'cpu:0' short by" in message and "'cpu:1' short by" in message


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ({"cpu:0": "10 GiBs"}, "budget of 'cpu:0' '10 GiBs' has unknown unit 'GiBs'; use one of B, kB, MB"),
        ({"cpu:0": -1}, "budget of 'cpu:0' must not be negative (got -1)"),
        ({0: "1GiB", "cuda:0": "1GiB"}, "budgets name device 'cuda:0' twice"),
        ({"cuda1": "1GiB"}, "'cuda1' is not a device; write 'cuda:0', 'cpu', 'cpu:1', or an int"),
        ({"meta": "1GiB"}, "'meta' holds no data"),
        ({}, "budgets must name at least one device"),
    ],
)
def test_bad_budgets(budgets: dict[object, object], message: str) -> None:
    with pytest.raises(fxsplit.SpecError) as info:
        fxsplit.plan(three_linears(), budgets, example_inputs=X)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"objectve": "balanced"}, "unknown option 'objectve'; did you mean 'objective'?"),
        ({"output_devices": "cpu:0"}, "did you mean 'output_device'?"),
        ({"example_input": X}, "unknown option 'example_input'; did you mean 'example_inputs'?"),
        ({"example_kwarg": {}}, "did you mean 'example_kwargs'?"),
        ({"zzz": 1}, "unknown option 'zzz'; options are example_kwargs, trace, leaf_modules"),
        ({"trace": "jit"}, "trace must be one of auto, fx, export (got 'jit')"),
        ({"objective": "fast"}, "objective must be one of min_transfer, balanced, throughput, latency (got 'fast')"),
        ({"pins": {"0": "cpu:5"}}, "pins['0']: pins to 'cpu:5', which has no budget (devices: cpu:0, cpu:1)"),
        ({"pins": {"nope": "cpu:0"}}, "pins['nope']: no module of the model matches 'nope'; top-level modules: 0, 1"),
        ({"pins": {"0": "cpu:1", "3": "cpu:0"}}, "devices run in the order the budgets list them"),
    ],
)
def test_bad_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(fxsplit.SpecError) as info:
        fxsplit.plan(three_linears(), {"cpu:0": 10**6, "cpu:1": 10**6}, **options)
    assert message in str(info.value)


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # the offending line
            return self.layer(x)
        return x


def test_untraceable_model_says_why_where_and_what_to_do() -> None:
    with pytest.raises(fxsplit.TraceError) as info:
        fxsplit.plan(Untraceable(), {"cpu:0": 10**6})
    message = str(info.value)
    assert "symbolically traced variables cannot be used as inputs to control flow" in message
    assert f"{__file__}:" in message and "if x.sum() > 0:  # the offending line" in message
    for fix in ("example_inputs=", "leaf_modules=", "concrete_args="):
        assert fix in message


class WritesASplitItem(nn.Module):
    """``p.relu_()`` on an item of ``split``: eager allows it under ``torch.no_grad()`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, q = self.a(x).split(4, dim=1)
        p.relu_()
        return self.b(p) + q


def test_an_in_place_write_autograd_forbids_says_to_plan_under_no_grad_and_that_works() -> None:
    model, x = WritesASplitItem().eval(), torch.randn(2, 8)
    options = {"example_inputs": (x,), "trace": "export", "mode": "inference"}
    with pytest.raises(fxsplit.TraceError) as info:
        fxsplit.plan(model, {"cpu:0": 10**6}, **options)
    assert "modified inplace" in str(info.value) and "plan it under torch.no_grad() too" in str(info.value)
    with torch.no_grad():
        split = fxsplit.fxsplit(model, {"cpu:0": 10**6, "cpu:1": 10**6}, pins={"a": "cpu:0", "b": "cpu:1"}, **options)
        torch.testing.assert_close(split(x), model(x))


def test_untraceable_by_both_tracers_reports_both() -> None:
    with pytest.raises(fxsplit.TraceError) as info:
        fxsplit.plan(Untraceable(), {"cpu:0": 10**6}, example_inputs=(torch.randn(2, 4),))
    message = str(info.value)
    assert message.startswith("torch.export could not trace the model on the example inputs")
    assert "fx also failed: torch.fx.symbolic_trace could not trace the model" in message
    assert message.count("if x.sum() > 0:") == 2


def test_export_with_wrong_inputs() -> None:
    with pytest.raises(
        fxsplit.TraceError,
        match=r"(?s)the model cannot run on the example inputs: RuntimeError: .*"
        r"input \(example_inputs\[0\]\) = float32\[2, 3\]",
    ) as caught:
        fxsplit.plan(three_linears(), {"cpu:0": 10**6}, example_inputs=(torch.randn(2, 3),), trace="export")
    assert isinstance(caught.value, fxsplit.ExampleInputError)


def test_meta_model_cannot_be_split() -> None:
    with torch.device("meta"):
        model = three_linears()
    with pytest.raises(fxsplit.FxsplitError, match=r"'0.weight' is on the meta device.*use fxsplit.plan\(\)"):
        fxsplit.fxsplit(model, {"cpu:0": 10**6})


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every public exception or warning class defined in a module of fxsplit, by qualified name."""
    found = {}
    for info in pkgutil.walk_packages(fxsplit.__path__, "fxsplit."):
        if info.name.endswith("__main__"):
            continue  # running it is the command line
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == info.name:
                if not name.startswith("_"):
                    found[f"{info.name}.{name}"] = value
    return found


def test_every_error_is_an_fxsplit_error_and_every_warning_an_fxsplit_warning() -> None:
    classes = _exception_classes()
    assert {"fxsplit.errors.BudgetError", "fxsplit.errors.InvariantError", "fxsplit.factory.ModelLoadError"} <= set(
        classes
    )
    for name, cls in classes.items():
        if issubclass(cls, Warning):
            assert issubclass(cls, fxsplit.FxsplitWarning) and not issubclass(cls, fxsplit.FxsplitError), name
        else:
            assert issubclass(cls, fxsplit.FxsplitError), f"{name} is not an FxsplitError: {cls.__mro__}"


@pytest.mark.parametrize(
    ("name", "also"),
    [
        ("BudgetError", ValueError),
        ("SpecError", ValueError),
        ("CheckpointError", ValueError),
        ("ExampleInputError", ValueError),
        ("InputMismatchError", ValueError),
        ("PlanMismatchError", ValueError),
        ("DeviceError", RuntimeError),
    ],
)
def test_errors_about_values_a_user_can_fix_are_also_builtin_errors(name: str, also: type[Exception]) -> None:
    cls = getattr(fxsplit, name)
    assert issubclass(cls, fxsplit.FxsplitError) and issubclass(cls, also)
    with pytest.raises(also, match="the message"):
        raise cls("the message")


def test_the_error_hierarchy_where_it_branches() -> None:
    from fxsplit.planning.rules import PlanProblems
    from fxsplit.spec import SpecProblems
    from fxsplit.yamlfile import YamlProblems

    assert issubclass(fxsplit.ExampleInputError, fxsplit.TraceError)  # caught by code that catches tracing failures
    assert not issubclass(fxsplit.TraceError, ValueError)  # a model fx cannot trace is not a bad value
    assert issubclass(fxsplit.FxsplitWarning, UserWarning) and not issubclass(
        fxsplit.FxsplitWarning, fxsplit.FxsplitError
    )
    assert issubclass(YamlProblems, fxsplit.SpecError) and issubclass(SpecProblems, YamlProblems)
    assert issubclass(PlanProblems, YamlProblems) and issubclass(PlanProblems, fxsplit.PlanMismatchError)
    assert set(fxsplit.errors.__all__) <= set(fxsplit.__all__)  # every error is reachable as fxsplit.<Name>


def test_a_checkpoint_error_keeps_its_problems() -> None:
    error = fxsplit.CheckpointError("2 problems", ("missing: a", "unexpected: b"))
    assert str(error) == "2 problems" and error.problems == ("missing: a", "unexpected: b")
    assert fxsplit.CheckpointError("none listed").problems == ()


def test_fx_chosen_with_example_inputs_suggests_export_not_example_inputs() -> None:
    """Found by an outside check: with example_inputs given and trace='fx', the fix said to pass example_inputs."""
    with pytest.raises(fxsplit.TraceError) as info:
        fxsplit.plan(Untraceable(), {"cpu:0": 10**6}, example_inputs=(torch.randn(2, 4),), trace="fx")
    message = str(info.value)
    assert "trace='export'" in message and "pass example_inputs" not in message
    with pytest.raises(fxsplit.TraceError) as both:  # export failed first: not suggested again
        fxsplit.plan(Untraceable(), {"cpu:0": 10**6}, example_inputs=(torch.randn(2, 4),))
    assert "trace='export'" not in str(both.value).split("fx also failed")[1]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_what_the_model_needs_before_splitting_is_what_one_device_needs(optimizer: str) -> None:
    """In training the whole-model need counts the optimizer step's temporaries where they are larger than the
    activations, as a device's row does: one device given the bytes the error names holds the model. Before, the
    step was left out of the sum (Adam over 2 devices: 17.41 MiB named, 20.16 MiB needed on one device)."""
    model = three_linears()
    options = dict(example_inputs=X, mode="training", optimizer=optimizer)
    with pytest.raises(fxsplit.BudgetError) as info:
        fxsplit.plan(model, {"cpu:0": 1000, "cpu:1": 1000}, **options)
    message = str(info.value)
    short = re.search(r"short by [^(]+\((\d+) bytes\)", message)
    assert short is not None, message
    named = 2000 + int(short.group(1))  # what the error says the model needs before splitting
    alone = fxsplit.plan(model, {"cpu:0": named}, **options)
    row = alone.memory["cpu:0"]
    assert row["total"] == named, (row, message)
    if optimizer == "adam":  # its step's temporaries exceed these tiny activations: named in the sum
        assert row["optimizer_step"] > row["activations_peak"]
        assert "the larger of activations peak" in message and "optimizer step (temporaries, outputs held)" in message
    with pytest.raises(fxsplit.BudgetError):
        fxsplit.plan(model, {"cpu:0": named - 1}, **options)
