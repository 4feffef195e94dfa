"""Training over two devices with AdamW matches one device; the budgets hold what training needs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

from fxsplit.memory.measure import measure_training

EXAMPLE = Path(__file__).parent.parent / "examples" / "train_adamw_two_devices.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_adamw_two_devices", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_adamw_over_two_devices_equals_one_device() -> None:
    result = _example().train(steps=4, verbose=False)
    plan = result["plan"]
    assert all(plan.modules[d] for d in plan.devices), "the budgets need both devices"
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["reference_losses"]))
    params, reference = result["params"], result["reference_params"]
    assert params.keys() == reference.keys()
    for name in params:
        torch.testing.assert_close(params[name], reference[name], msg=name)
    for device, row in plan.memory.items():
        assert row["grads"] == row["params"] and row["optimizer"] == 2 * row["params"]  # AdamW: two states
        assert row["total"] <= plan.budgets[device]


def test_a_training_step_fits_the_budgets_it_was_planned_for() -> None:
    example = _example()
    torch.manual_seed(0)
    model = example.Classifier()
    tokens, labels = example.batches(1)[0]
    import fxsplit

    alone = fxsplit.plan(model, {"cpu:0": "1GiB"}, example_inputs=(tokens,), mode="training").memory["cpu:0"]
    each = int(0.7 * alone["total"])
    split = fxsplit.fxsplit(model, {"cpu:0": each, "cpu:1": each}, example_inputs=(tokens,), mode="training")
    plan = split.meta["fxsplit_plan"]
    measured = measure_training(split, tokens)
    for device in plan.devices:
        row = plan.memory[device]
        state = row["params"] + row["buffers"] + row["grads"] + row["optimizer"]
        assert state + measured[device] <= each, (device, measured)
        assert measured[device] <= row["activations_peak"] <= 1.15 * measured[device]
