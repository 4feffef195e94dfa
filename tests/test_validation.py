"""Bad input is refused up front with a SpecError naming the option, what it must be and what it got.

Each case here was once accepted with another meaning (``contiguous='no'``
was True, ``reserve=0.1`` was 0 bytes, ``cuda:300`` was ``cuda:44``) or
failed deep inside with a raw ``AttributeError``, ``IndexError`` or
``OverflowError``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.cli import main

LINEAR = (16 * 16 + 16) * 4  # bytes of one Linear(16, 16)
ROOMY = {"cpu:0": 10**6, "cpu:1": 10**6}


def three_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 16))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pins": ["0"]}, "'pins' must be a mapping, like {'lm_head': 'cuda:1'}, or None (got ['0'])"),
        ({"pins": {("0",): "cpu:0"}}, "'pins' keys must be strings"),
        ({"pins": {"0": 1.5}}, "pins['0']: device must be a string, torch.device or int (got float)"),
        ({"output_device": "cuda:300"}, "output_device: device 'cuda:300' has index 300"),
        (
            {"leaf_modules": [42]},
            "'leaf_modules'[0] must be an nn.Module subclass (like torch.nn.MultiheadAttention) "
            "or a module path or class name as a string (got 42)",
        ),
        ({"leaf_modules": [int]}, "'leaf_modules'[0] must be an nn.Module subclass"),
        (
            {"leaf_modules": "Linear"},
            "'leaf_modules' must be a list of module classes or module names (got 'Linear'); write ['Linear']",
        ),
        ({"contiguous": "no"}, "'contiguous' must be True or False (got 'no')"),
        ({"contiguous": 1}, "'contiguous' must be True or False (got 1)"),
        ({"check": "yes"}, "'check' must be True or False (got 'yes')"),
        (
            {"concrete_args": {"nope": 1}},
            "concrete_args names 'nope', which is not an argument of Sequential.forward "
            "(its arguments: input); fix the name or drop it",
        ),
        ({"concrete_args": [("input", 1)]}, "'concrete_args' must be a mapping, like {'use_cache': False}"),
        ({"example_kwargs": [1]}, "'example_kwargs' must be a mapping"),
        ({"dynamic_shapes": 1}, "'dynamic_shapes' must be 'batch', 'all', a torch.export dynamic_shapes spec"),
        (
            {"reserve": 1.5},
            "reserve 1.5 is a float, which means a fraction of the budget from 0 to below 1 (0.1 is "
            "'10%'); for bytes write an int or a size like '100MiB'",
        ),
        ({"reserve": float("nan")}, "reserve nan is a float"),
    ],
)
def test_bad_option_types(options: dict[str, Any], message: str) -> None:
    with pytest.raises(fxsplit.SpecError) as info:
        fxsplit.plan(three_linears(), ROOMY, **options)
    assert message in str(info.value)


@pytest.mark.parametrize("model", [42, nn.Linear, {"weight": torch.zeros(2)}])
def test_a_model_that_is_not_a_module(model: Any) -> None:
    message = f"model must be a torch.nn.Module (got {type(model).__name__}); pass the module itself"
    with pytest.raises(fxsplit.SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fxsplit.plan(model, ROOMY)
    with pytest.raises(fxsplit.SpecError, match="model must be a torch.nn.Module"):
        fxsplit.fxsplit(model, ROOMY)
    plan = fxsplit.plan(three_linears(), ROOMY, trace="fx")
    with pytest.raises(fxsplit.SpecError, match="model must be a torch.nn.Module"):
        fxsplit.apply(model, plan)
    with pytest.raises(fxsplit.SpecError, match="model must be a torch.nn.Module"):
        fxsplit.check_plan(model, plan)


def test_apply_and_check_plan_name_unknown_options() -> None:
    model = three_linears()
    plan = fxsplit.plan(model, ROOMY, trace="fx")
    with pytest.raises(
        fxsplit.SpecError,
        match="apply\\(\\) takes no option 'objective'; its options are "
        "example_kwargs, concrete_args, leaf_modules, dynamic_shapes",
    ):
        fxsplit.apply(model, plan, objective="balanced")
    with pytest.raises(fxsplit.SpecError, match="check_plan\\(\\) takes no option 'budget'"):
        fxsplit.check_plan(model, plan, budget=ROOMY)
    with pytest.raises(fxsplit.SpecError, match="concrete_args names 'x', which is not an argument"):
        fxsplit.apply(model, plan, concrete_args={"x": 1})
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_concrete_args_of_a_forward_with_kwargs_are_not_checked() -> None:
    class Flexible(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, **extra: Any) -> torch.Tensor:
            return self.layer(x)

    plan = fxsplit.plan(Flexible(), {"cpu:0": 10**6}, concrete_args={"double": True})
    assert plan.devices == ("cpu:0",)


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ({"cuda:300": "1GiB"}, "device 'cuda:300' has index 300, but torch's device indices go from 0 to 127"),
        ({"cuda:128": "1GiB"}, "device 'cuda:128' has index 128"),
        ({"cpu:0": "1GiB", "cpu:255": "1GiB"}, "device 'cpu:255' has index 255"),
        ({200: "1GiB"}, "device 200 has index 200"),
        (
            {torch.device("cuda", 128): "1GiB"},
            "device 'cuda:-128' has a negative index: torch keeps device indices in 8 bits",
        ),
        (
            {"cuda": "1GiB", "cuda:0": "1GiB"},
            "budgets name device 'cuda:0' twice (as 'cuda' and 'cuda:0'); a bare "
            "'cuda' means the current cuda device, index 0 here",
        ),
        ({"cuda:0": "1GiB", "cuda": "1GiB"}, "budgets name device 'cuda:0' twice (as 'cuda:0' and 'cuda')"),
        ({"cpu:0": "1e400GiB"}, "budget of 'cpu:0' '1e400GiB' is larger than the largest size fxsplit handles, 8 EiB"),
        ({"cpu:0": "1e18GiB"}, "is larger than the largest size fxsplit handles"),
        ({"cpu:0": 2**64}, "budget of 'cpu:0' is larger than the largest size fxsplit handles"),
        ({"cpu:0": "9" * 400}, "(400 characters) is larger than the largest size"),
    ],
)
def test_bad_devices_and_sizes(budgets: dict[Any, Any], message: str) -> None:
    with pytest.raises(fxsplit.SpecError) as info:
        fxsplit.plan(three_linears(), budgets)
    assert message in str(info.value)
    assert len(str(info.value)) < 400


def test_a_bare_cpu_and_logical_cpus_stay_distinct() -> None:
    plan = fxsplit.plan(three_linears(), {"cpu": 2 * LINEAR, "cpu:0": 2 * LINEAR}, trace="fx", mode="weights")
    assert plan.devices == ("cpu", "cpu:0")


def test_a_float_reserve_is_a_fraction_like_a_percentage() -> None:
    by_float = fxsplit.plan(three_linears(), ROOMY, trace="fx", reserve=0.1)
    by_percent = fxsplit.plan(three_linears(), ROOMY, trace="fx", reserve="10%")
    assert by_float.reserved == by_percent.reserved == {"cpu:0": 10**5, "cpu:1": 10**5}
    spec = fxsplit.load_spec("devices: {cpu:0: 1000000}\nreserve: 0.25")
    assert spec.reserve_for("cpu:0").of(10**6) == 250_000
    assert fxsplit.plan(three_linears(), ROOMY, trace="fx", reserve=2048).reserved == {"cpu:0": 2048, "cpu:1": 2048}


def test_a_reserve_on_a_zero_budget_holds_nothing_back() -> None:
    plan = fxsplit.plan(three_linears(), {"cpu:0": 0, "cpu:1": 10**6}, trace="fx", reserve="1KiB")
    assert plan.reserved == {"cpu:0": 0, "cpu:1": 1024}
    assert set(plan.param_devices.values()) == {"cpu:1"}
    with pytest.raises(fxsplit.SpecError, match="reserve 1.00 KiB of 'cpu:0' leaves nothing of its budget 1.00 KiB"):
        fxsplit.plan(three_linears(), {"cpu:0": 1024, "cpu:1": 10**6}, trace="fx", reserve="1KiB")


@pytest.mark.parametrize("reserve", [None, "1KiB", {"cpu:0": "1KiB"}])
def test_all_zero_budgets_do_not_fit(reserve: Any) -> None:
    with pytest.raises(fxsplit.BudgetError, match="the budgets add up to 0 B: the parameters alone exceed them"):
        fxsplit.plan(three_linears(), {"cpu:0": 0, "cpu:1": 0}, trace="fx", reserve=reserve)


def test_the_partitioner_refuses_negative_budgets() -> None:
    from fxsplit.partition.problem import PartitionProblem, Value
    from fxsplit.partition.solve import partition

    problem = PartitionProblem(op_names=("a", "b"), values=(Value("w", 0, 0, (0,), weight=10), Value("a", 4, 0, (1,))))
    with pytest.raises(fxsplit.SpecError, match=r"budgets must not be negative \(x: -1\)"):
        partition(problem, [100, -1], device_names=["w", "x"])


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.py"
    path.write_text(
        "import sys\nimport torch\n\n"
        "def factory():\n    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))\n\n"
        "def quits():\n    sys.exit(0)\n\n"
        "def fails():\n    sys.exit('no model today')\n"
    )
    return path


def test_cli_repeated_budget_for_one_device(factory_file: Path) -> None:
    code, out, err = run_cli("plan", f"{factory_file}:factory", "--budget", "cpu:0=1MiB", "--budget", "cpu:0=2MiB")
    assert code == 2 and out == ""
    assert err.strip() == (
        "fxsplit: error: --budget names 'cpu:0' twice (cpu:0=1MiB and cpu:0=2MiB); give each "
        "device one --budget, in stage order"
    )
    code, _, err = run_cli("plan", f"{factory_file}:factory", "--budget", "cuda:0=1MiB", "--budget", "cuda=2MiB")
    assert code == 2 and "budgets name device 'cuda:0' twice (as 'cuda:0' and 'cuda')" in err


def test_cli_size_overflow_is_bad_input(factory_file: Path) -> None:
    code, _, err = run_cli("plan", f"{factory_file}:factory", "--budget", "cpu:0=1e400GiB")
    assert code == 2
    assert "'1e400GiB' is larger than the largest size fxsplit handles" in err and "internal error" not in err


@pytest.mark.parametrize(
    ("factory", "fragment"),
    [("quits", "called sys.exit(0) instead of returning a model"), ("fails", "called sys.exit('no model today')")],
)
def test_cli_factory_that_exits(factory_file: Path, factory: str, fragment: str) -> None:
    code, out, err = run_cli("plan", f"{factory_file}:{factory}", "--budget", "cpu:0=1MiB")
    assert code == 2 and out == ""
    assert err.startswith("fxsplit: error: ") and fragment in err


def test_cli_model_file_that_exits_on_import(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import sys\nsys.exit(3)\n")
    code, _, err = run_cli("plan", f"{script}:factory", "--budget", "cpu:0=1MiB")
    assert code == 2 and f"importing '{script}' called sys.exit(3)" in err
