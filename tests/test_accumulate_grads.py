"""``accumulate_grads``: training plans for backward passes that add to ``.grad`` tensors that exist.

Without it a backward starts with no ``.grad`` (``zero_grad()``'s default) and each weight's first gradient
becomes its ``.grad``; with it each weight's new gradient is held until it is added. The allocator's peak of a
second backward (into the first one's ``.grad``) is what an accumulating plan must hold; the per-case
comparison is in ``tests/test_backward_memory.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import SpecError
from fxsplit.memory.allocmeter import allocated_peaks
from fxsplit.spec import load_spec


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def test_an_accumulating_plan_holds_what_a_second_backward_allocates_and_the_default_what_the_first_does() -> None:
    x = torch.randn(4, 256)
    peaks = {}
    for accumulate in (False, True):
        gm = fxsplit.fxsplit(
            _mlp(),
            {"cpu:0": "64MiB", "cpu:1": "64MiB"},
            example_inputs=(x,),
            mode="training",
            optimizer="sgd",
            accumulate_grads=accumulate,
            pins={"0": "cpu:0", "4": "cpu:1"},
        )
        plan = gm.meta["fxsplit_plan"]
        assert ("gradients accumulated into .grad" in (plan.memory_counts or "")) == accumulate
        planned = {d: row["activations_peak"] for d, row in plan.memory.items()}
        first = allocated_peaks(gm, x, backward=True)
        then = allocated_peaks(gm, x, backward=True)  # into the .grads the first made
        measured = then if accumulate else first
        for device, nbytes in measured.items():
            assert nbytes - 64 <= planned[device] <= nbytes * 1.02 + 64, (accumulate, planned, first, then)
        peaks[accumulate] = planned
    assert peaks[True]["cpu:0"] - peaks[False]["cpu:0"] >= 256 * 256 * 4  # a 256 x 256 weight's gradient held


def test_a_pipeline_plans_as_accumulating() -> None:
    x = torch.randn(8, 256)
    budgets = {"cpu:0": "64MiB", "cpu:1": "64MiB"}
    plan = fxsplit.plan(_mlp(), budgets, example_inputs=(x,), mode="training", optimizer="sgd", pipeline=2)
    assert "gradients accumulated into .grad" in (plan.memory_counts or "")


def test_it_is_read_from_a_spec_and_checked() -> None:
    spec = load_spec("devices:\n  cpu:0: 64MiB\nmode: training\noptimizer: sgd\naccumulate_grads: true\n")
    assert spec.accumulate_grads is True
    x = torch.randn(4, 256)
    plan = fxsplit.plan(_mlp(), example_inputs=(x,), spec=spec)
    assert "gradients accumulated into .grad" in (plan.memory_counts or "")
    with pytest.raises(SpecError, match="accumulate_grads: must be true or false"):
        load_spec("devices:\n  cpu:0: 64MiB\naccumulate_grads: often\n")
    with pytest.raises(SpecError, match="only counts with mode='training'"):
        fxsplit.plan(_mlp(), {"cpu:0": "64MiB"}, example_inputs=(x,), accumulate_grads=True)
    with pytest.raises(SpecError, match="accumulate_grads"):
        fxsplit.plan(_mlp(), {"cpu:0": "64MiB"}, example_inputs=(x,), mode="training", accumulate_grads="yes")
