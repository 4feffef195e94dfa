"""The memory model: activation lifetimes, training state, the plan's breakdown, budgets that hold it all."""

from __future__ import annotations

import dataclasses

import torch

from fxsplit.cost import build_problem
from fxsplit.partition import partition
from fxsplit.planning import make_plan
from fxsplit.trace import trace


def test_device_bytes_stay_parameters_and_buffers_when_the_problem_charges_more() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    traced = trace(model, example_inputs=(torch.randn(4, 16),), mode="fx")
    costs = build_problem(traced.graph_module, model, device_index={"cpu:0": 0, "cpu:1": 1})
    n = costs.problem.num_ops
    costs.problem = dataclasses.replace(costs.problem, op_extra=(1000,) * n, op_transient=(500,) * n)
    solution = partition(costs.problem, [10_000, 10_000])
    made = make_plan(costs, traced.graph_module, solution, ["cpu:0", "cpu:1"], {"cpu:0": 10_000, "cpu:1": 10_000},
                     output_device=None, trace="fx", objective="min_transfer")
    assert sum(solution.device_weights) > 2 * 1088 + 1000 * n  # the partitioner charged the extras...
    assert sum(made.device_bytes.values()) == 2 * (16 * 16 + 16) * 4  # ...the plan reports weights only
