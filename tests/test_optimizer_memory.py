"""The optimizer's memory the plan counts (state, and ``optimizer.step()``'s temporaries) against what torch's
SGD, Adam and AdamW really hold, for every combination of the settings that change it."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.errors import SpecError
from fxsplit.optimizer import OptimizerSettings
from tests.helpers import LiveBytes

PINS = {"0": "cpu:0", "2": "cpu:0", "4": "cpu:1"}  # the two largest parameters on cpu:0, the rest on cpu:1
BUDGETS = {"cpu:0": "1MiB", "cpu:1": "1MiB"}
LARGEST, SECOND = 128 * 64 * 4, 64 * 64 * 4


def _model() -> nn.Module:
    """Parameters of 16, 32, 0.5, 4 KiB and 32 B, in the order an optimizer steps them: the second largest just
    before the largest, so that what a for-loop step still holds of the previous parameter is as large as can be."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64, bias=False), nn.Tanh(), nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 8))


def _cases() -> list[tuple[Any, dict[str, Any]]]:
    ways: list[dict[str, Any]] = [{"foreach": True}, {"foreach": False}, {"fused": True}]
    cases: list[tuple[Any, dict[str, Any]]] = []
    for way in ways:
        flags = itertools.product((0.0, 0.9), (0.0, 0.01), (False, True), (False, True))
        for momentum, decay, nesterov, maximize in flags:
            if nesterov and not momentum:
                continue
            settings = {"momentum": momentum, "weight_decay": decay, "nesterov": nesterov, "maximize": maximize}
            cases.append((torch.optim.SGD, {**way, **settings}))
        for kind in (torch.optim.Adam, torch.optim.AdamW):
            for decay, amsgrad, maximize in itertools.product((0.0, 0.01), (False, True), (False, True)):
                cases.append((kind, {**way, "weight_decay": decay, "amsgrad": amsgrad, "maximize": maximize}))
    return cases


def _step_peak(split: nn.Module, kind: Any, settings: dict[str, Any], x: torch.Tensor) -> int:
    """Peak bytes ``optimizer.step()`` makes beyond the weights, gradients, state and the batch's output."""
    optimizer = kind(split.parameters(), lr=1e-3, **settings)
    for _ in range(2):  # the second step is measured, once the state exists
        optimizer.zero_grad()
        out = split(x)
        out.sum().backward()
        state = [t for entry in optimizer.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
        grads = [p.grad for p in split.parameters() if p.grad is not None]
        with LiveBytes([*split.parameters(), *state, *grads, out, x]) as meter:
            optimizer.step()
    return meter.peak


@pytest.mark.parametrize(("kind", "settings"), _cases(), ids=lambda c: c.__name__ if isinstance(c, type) else str(c))
def test_each_devices_row_holds_what_the_optimizer_makes_there(kind: Any, settings: dict[str, Any]) -> None:
    """Planned with the optimizer itself, the rows count its state exactly and at least its step's temporaries.

    The logical ``cpu:N`` devices share one torch device, so torch steps them as one: a ``foreach`` step makes
    every device's temporaries at once (the measured peak is the rows' sum), a for-loop step one parameter's
    at a time (the largest row)."""
    model, x = _model(), torch.randn(16, 64)
    planned = kind(model.parameters(), lr=1e-3, **settings)  # the optimizer a user built: the plan reads its settings
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(x,), mode="training", optimizer=planned, pins=PINS)
    plan = split.meta["fxsplit_plan"]
    outputs = 16 * 8 * 4  # the batch's output, which the caller holds through the step
    steps = {d: row["optimizer_step"] - (outputs if d == plan.output_device else 0) for d, row in plan.memory.items()}
    weights = sum(p.numel() * 4 for p in model.parameters())
    state = 1 if kind is torch.optim.SGD and settings["momentum"] else 0
    if kind is not torch.optim.SGD:
        state = 3 if settings["amsgrad"] else 2
    assert sum(row["optimizer"] for row in plan.memory.values()) == state * weights
    measured = _step_peak(split, kind, settings, x)
    if settings.get("foreach"):
        counted = sum(steps.values())
    else:
        counted = max(steps.values())
    scalars = 64  # one-element tensors torch makes beside (4 bytes with Adam's maximize): under any allocator's block
    assert measured <= counted + scalars, (steps, measured)
    assert counted <= measured + 1024, (steps, measured)  # exact, up to Adam's scalar bias corrections


def test_a_name_counts_torchs_default_step_on_the_devices_planned_for() -> None:
    """``"adam"`` on GPUs: the foreach step, one temporary per trainable byte; on CPU (torch's for-loop step):
    three of the largest parameter (Adam's coupled weight decay counted as set); with a CPU among GPUs, torch
    runs every parameter's step in the for-loop."""
    model, x = _model(), torch.randn(16, 64)
    outputs = 16 * 8 * 4
    for budgets, temporaries in (
        ({"cuda:0": "1MiB"}, sum(p.numel() * 4 for p in model.parameters())),
        ({"cpu": "1MiB"}, 3 * LARGEST + SECOND),  # and the previous parameter's denominator, still referenced
    ):
        plan = fxsplit.plan(model, budgets, example_inputs=(x,), mode="training", optimizer="adam")
        (device,) = plan.devices
        assert plan.memory[device]["optimizer_step"] == temporaries + outputs
    pins = {"0": "cpu", "2": "cuda:0", "4": "cuda:0"}
    mixed = fxsplit.plan(model, {"cpu": "1MiB", "cuda:0": "1MiB"}, example_inputs=(x,), mode="training", pins=pins)
    assert mixed.output_device == "cuda:0"
    assert mixed.memory["cuda:0"]["optimizer_step"] == 3 * LARGEST + 128 * 8 * 4 + outputs  # its own second largest


def test_each_name_keeps_the_state_options_lists_for_it() -> None:
    from fxsplit.options import OPTIMIZERS

    assert {name: OptimizerSettings.coerce(name).state_tensors for name in OPTIMIZERS} == OPTIMIZERS


def test_settings_from_a_mapping_a_spec_and_the_optimizer_agree() -> None:
    model, x = _model(), torch.randn(16, 64)
    given = {"name": "adamw", "amsgrad": True, "fused": True}
    spec = "devices:\n  cuda:0: 1MiB\nmode: training\noptimizer: {name: adamw, amsgrad: true, fused: true}\n"
    optimizer = torch.optim.AdamW(model.parameters(), amsgrad=True, fused=False, foreach=False)
    from_mapping = fxsplit.plan(model, {"cuda:0": "1MiB"}, example_inputs=(x,), mode="training", optimizer=given)
    from_spec = fxsplit.plan(model, example_inputs=(x,), spec=spec)
    assert from_mapping.memory == from_spec.memory
    assert from_mapping.memory["cuda:0"]["optimizer"] == 3 * sum(p.numel() * 4 for p in model.parameters())
    assert from_mapping.memory["cuda:0"]["optimizer_step"] == 16 * 8 * 4  # fused: nothing but the outputs
    settings = OptimizerSettings.coerce(optimizer)
    assert (settings.kind, settings.amsgrad, settings.implementation) == ("adamw", True, "for-loop")


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        ({"name": "adam", "momentum": 0.9}, "'adam' has no 'momentum'"),
        ({"name": "sgd", "lr": 0.1}, "unknown 'lr'"),
        ({"fused": True}, "need 'name'"),
        ({"name": "adamw", "foreach": True, "fused": True}, "cannot both be true"),
        ({"name": "sgd", "weight_decay": -1}, "'weight_decay' must be a number >= 0"),
        ("lion", "must be one of adam, adamw, sgd_momentum, sgd"),
    ],
)
def test_bad_settings_are_refused_saying_which(optimizer: Any, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        model, x = _model(), torch.randn(2, 64)
        fxsplit.plan(model, {"cpu:0": "1MiB"}, example_inputs=(x,), mode="training", optimizer=optimizer)


def test_another_optimizer_class_is_refused_with_what_to_pass_instead() -> None:
    model = _model()
    with pytest.raises(SpecError, match=r"not RMSprop: pass its state as bytes per parameter element"):
        fxsplit.plan(
            model,
            {"cpu:0": "1MiB"},
            example_inputs=(torch.randn(2, 64),),
            mode="training",
            optimizer=torch.optim.RMSprop(model.parameters()),
        )


def test_a_budget_error_names_the_optimizer_as_given() -> None:
    with pytest.raises(fxsplit.BudgetError, match=r"optimizer=\{'name': 'sgd', 'momentum': 0.9\}"):
        fxsplit.plan(
            _model(),
            {"cpu:0": "10KiB"},
            example_inputs=(torch.randn(2, 64),),
            mode="training",
            optimizer={"name": "sgd", "momentum": 0.9},
        )


def test_a_plan_says_which_optimizer_and_step_its_rows_count() -> None:
    """``plan.memory_counts``: in the plan file and under the memory table, so that a saved plan says what its
    rows assumed."""
    model, x = _model(), torch.randn(16, 64)
    budgets = {"cuda:0": "1MiB", "cuda:1": "1MiB"}
    fused = fxsplit.plan(
        model, budgets, example_inputs=(x,), mode="training", optimizer={"name": "adamw", "fused": True}
    )
    assert fused.memory_counts == "mode='training', optimizer={'name': 'adamw', 'fused': True}, fused step"
    named = fxsplit.plan(model, {"cpu:0": "1MiB"}, example_inputs=(x,), mode="training", optimizer="sgd_momentum")
    assert named.memory_counts == "mode='training', optimizer='sgd_momentum', for-loop step"
    assert str(named).splitlines()[-1] == "counted for mode='training', optimizer='sgd_momentum', for-loop step"
    assert fxsplit.Plan.from_yaml(named.to_yaml()).memory_counts == named.memory_counts
    assert fxsplit.plan(model, {"cpu:0": "1MiB"}, example_inputs=(x,)).memory_counts == "mode='inference'"
