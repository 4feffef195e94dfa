"""A budget that holds the model exactly is accepted: the partitioner's charge is an upper bound of the activations
(:func:`fxsplit.memory.planloads.charge_slack`), and the exact check of the plan, not the bound, holds budgets."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.cost.build import build_problem
from fxsplit.memory.activations import profile_activations
from fxsplit.memory.planloads import charge_slack, planning_loads
from fxsplit.tracing.capture import trace


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(16, 64, batch_first=True)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0])


MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.LayerNorm(64)), (16, 64)),
    "gru": (Recurrent, (4, 20, 16)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_plans_own_total_is_a_budget_it_fits_and_a_byte_less_is_not(name: str) -> None:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    x = torch.randn(*shape)
    options = {"example_inputs": (x,), "mode": "training", "optimizer": "sgd", "trace": "fx"}
    total = fxsplit.plan(build().train(), {"cpu:0": 1 << 30}, **options).memory["cpu:0"]["total"]
    plan = fxsplit.plan(build().train(), {"cpu:0": total}, **options)  # refused before: the bound was over it
    assert plan.memory["cpu:0"]["total"] <= total
    with pytest.raises(fxsplit.BudgetError, match="activations peak"):
        fxsplit.plan(build().train(), {"cpu:0": total - 1}, **options)


def test_the_slack_is_what_the_charge_holds_beyond_the_simulation() -> None:
    torch.manual_seed(0)
    model, x = Recurrent().train(), torch.randn(4, 20, 16)
    traced = trace(model, example_inputs=(x,), mode="fx")
    costs = build_problem(traced.graph_module, model, device_index={"cpu:0": 0})
    profile = profile_activations(traced.graph_module, costs, training=True)
    assert profile is not None
    extra, transient = planning_loads(profile)
    slack = charge_slack(profile)
    # the GRU's output, saved by the head's linear, is freed after the head's backward; the charge holds it through
    # the GRU's backward too
    assert slack == 4 * 20 * 64 * 4
    assert 0 < slack < sum(extra) + max(transient)
