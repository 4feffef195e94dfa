"""The default (out-of-order) placement against brute force over all N^k placements (no torch).

Random DAGs of 4-10 weighted ops with skip connections and tied weights, on 2-4 devices with budgets
of 0.95-1.9 x total / N (equal for all devices, or drawn per device), as long as N^k <= 4^8 (brute
force is vectorised over placements). Prints the optimality rate and the worst ratio
(``pytest -s`` shows them; benchmarks/RESULTS.md records them).
"""

from __future__ import annotations

import random

import pytest
from reference import any_order_optimum, feasible, true_cost
from strategies import random_linear_dag

from fxsplit.errors import BudgetError
from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.solve import partition

pytestmark = pytest.mark.slow  # exhaustive search over small graphs, 6-11 s each

CASES = 300


def draw_case(rng: random.Random) -> tuple[PartitionProblem, list[int]]:
    devices = rng.randint(2, 4)
    ops = rng.randint(4, {2: 10, 3: 10, 4: 8}[devices])
    problem = random_linear_dag(rng, ops)
    share = sum(v.weight for v in problem.values) / devices
    if rng.random() < 0.5:
        budgets = [int(rng.uniform(0.95, 1.9) * share)] * devices
    else:
        budgets = [int(rng.uniform(0.95, 1.9) * share) for _ in range(devices)]
    return problem, budgets


@pytest.mark.parametrize("seed", [0, 1])
def test_default_placement_is_optimal_on_small_dags(seed: int) -> None:
    rng = random.Random(seed)
    optimal = feasible_cases = 0
    worst = 1.0
    for _ in range(CASES):
        problem, budgets = draw_case(rng)
        best = any_order_optimum(problem, budgets)
        if best is None:
            with pytest.raises(BudgetError):
                partition(problem, budgets)
            continue
        feasible_cases += 1
        result = partition(problem, budgets)  # never refuses a feasible case
        assert feasible(problem, result.op_devices, budgets)
        assert result.transfer_bytes == true_cost(problem, result.op_devices) >= best[0]
        optimal += result.transfer_bytes == best[0]
        if best[0]:
            worst = max(worst, result.transfer_bytes / best[0])
    rate = optimal / feasible_cases
    print(
        f"\nseed {seed}: optimal in {optimal} of {feasible_cases} feasible cases ({rate:.1%}), worst ratio {worst:.2f}"
    )
    assert rate >= 0.98
    assert worst <= 1.25


@pytest.mark.parametrize("seed", [2, 3])
def test_more_budget_never_copies_more(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(CASES // 2):
        problem, budgets = draw_case(rng)
        try:
            tight = partition(problem, budgets)
        except BudgetError:
            continue
        for factor in (1.1, 1.3, 2.0):
            looser = partition(problem, [int(b * factor) for b in budgets])
            assert looser.transfer_bytes <= tight.transfer_bytes, (problem, budgets, factor)
