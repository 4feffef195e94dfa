"""Exact placement of small graphs by branch and bound (fxsplit.partition.exact), against brute force.

tests/reference.py's any_order_optimum enumerates all k ** n placements and shares no code with it.
The search keeps each constraint's whole span of ops on one device (a together-group, or a value
written in place from its home to its last reader), as the rest of the partitioner does, so the
reference gets those spans as together-groups.
"""

from __future__ import annotations

import dataclasses
import random

from reference import any_order_optimum, feasible, true_cost

from benchmarks.optimality import any_order_optimum as optimality_oracle
from benchmarks.optimality import constrained_dag
from fxsplit.partition.exact import EXACT_OPS, exact_placement, searched
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.result import placement_problems


def random_problem(rng: random.Random, n: int) -> PartitionProblem:
    """Skips, shared weights, an input, and sometimes a pin, a group or a value written in place."""
    values = []
    for i in range(n - 1):
        readers = sorted(rng.sample(range(i + 1, n), rng.randint(1, min(3, n - 1 - i))))
        values.append(Value(f"a{i}", rng.randint(0, 90), i, tuple(readers), movable=rng.random() > 0.1))
    for i in range(n):
        values.append(Value(f"w{i}", 0, i, (i,), weight=rng.randint(0, 40)))
    for j in range(rng.randint(0, 2)):
        readers = sorted(rng.sample(range(n), rng.randint(1, min(3, n))))
        weight = rng.randint(1, 60)
        values.append(Value(f"s{j}", weight, readers[0], tuple(readers), weight=weight))
    pinned = {rng.randrange(n): 0} if rng.random() < 0.3 else {}
    group = tuple(sorted(rng.sample(range(n), 2))) if n > 1 and rng.random() < 0.3 else ()
    return PartitionProblem(tuple(f"op{i}" for i in range(n)), tuple(values), pinned, (group,) if group else ())


def spans_as_groups(problem: PartitionProblem) -> PartitionProblem:
    spans = tuple(tuple(range(lo, hi + 1)) for lo, hi in problem.no_cut_spans())
    return dataclasses.replace(problem, together=problem.together + spans)


def test_the_cheapest_placement_in_any_order_or_none() -> None:
    rng = random.Random(0)
    fitted = 0
    for _ in range(150):
        n, k = rng.randint(1, 7), rng.randint(2, 3)
        problem = random_problem(rng, n)
        total = sum(problem.op_weights())
        budgets = [int(total / k * rng.uniform(0.9, 1.8)) for _ in range(k)]
        optimum = any_order_optimum(spans_as_groups(problem), budgets)
        found = exact_placement(problem, budgets, None)
        if optimum is None:
            assert found is None
            continue
        fitted += 1
        assert found is not None and feasible(problem, found, budgets), (problem, budgets, found)
        assert true_cost(problem, found) == optimum[0]
    assert 50 < fitted < 150  # both outcomes exercised


def test_an_incumbent_as_cheap_as_any_is_kept() -> None:
    rng = random.Random(1)
    for _ in range(60):
        problem = random_problem(rng, rng.randint(2, 6))
        budgets = [sum(problem.op_weights())] * 2  # everything fits anywhere
        optimum = any_order_optimum(spans_as_groups(problem), budgets)
        assert optimum is not None
        cost, best = optimum
        assert exact_placement(problem, budgets, best, cost) == list(best)
        worse = [0] * problem.num_ops
        if true_cost(problem, worse) > cost:  # not the cheapest: replaced by one that is
            replaced = exact_placement(problem, budgets, worse, true_cost(problem, worse))
            assert replaced is not None and true_cost(problem, replaced) == cost


def test_the_doc_example_cuts_where_the_activation_is_smallest() -> None:
    chain = PartitionProblem(
        ("a", "b", "c"),
        (
            Value("w", 0, 0, (0,), weight=60),
            Value("x", 0, 2, (2,), weight=60),
            Value("a", 8, 0, (1,)),
            Value("b", 4, 1, (2,)),
            Value("v", 0, 1, (1,), weight=60),
        ),
    )
    assert exact_placement(chain, [130, 130], None) == [0, 0, 1]  # copies b (4 bytes), not a (8)
    assert exact_placement(chain, [179, 179], None) == [0, 0, 1]
    assert exact_placement(chain, [180, 10], None) == [0, 0, 0]
    assert exact_placement(chain, [100, 100], None) is None  # 180 bytes of weights, 3 of 60 in 2 x 100


def test_graphs_it_does_not_search_give_the_incumbent_back() -> None:
    rng = random.Random(2)
    big = random_problem(rng, EXACT_OPS + 1)  # 4 ** 15 placements: more than EXACT_SPACE
    incumbent = [0] * big.num_ops
    answer = exact_placement(big, [10**9] * 4, incumbent, true_cost(big, incumbent))
    assert answer == incumbent and answer is not incumbent
    assert exact_placement(big, [10**9] * 4, None) is None
    assert searched(14, 4) and not searched(15, 4) and searched(15, 3) and not searched(16, 3)
    assert searched(24, 2) and not searched(25, 2) and not searched(0, 2)
    assert exact_placement(PartitionProblem((), ()), [10], None) is None
    # an input whose first reader comes before its home op: not searched either
    late = PartitionProblem(("a", "b"), (Value("x", 5, 1, (0, 1)), Value("w", 0, 0, (0,), weight=10)))
    assert exact_placement(late, [10, 10], [1, 0], 5) == [1, 0]


def test_colocated_groups_are_kept_together_while_searching() -> None:
    """Pins, colocated groups (one device, the ops between anywhere), values changed in place, transients:
    the search's answer holds them all and is the cheapest (benchmarks/optimality.py's oracle)."""
    rng = random.Random(4)
    grouped = 0
    for _ in range(120):
        k = rng.randint(2, 3)
        problem = constrained_dag(rng, rng.randint(4, 7), k)
        if not problem.colocated:
            problem = dataclasses.replace(problem, colocated=(tuple(sorted(rng.sample(range(problem.num_ops), 2))),))
        total = sum(problem.op_weights())
        budgets = [int(total / k * rng.uniform(0.9, 1.8)) for _ in range(k)]
        optimum = optimality_oracle(problem, budgets)
        found = exact_placement(problem, budgets, None)
        if optimum is None:
            assert found is None
            continue
        grouped += 1
        assert found is not None and not placement_problems(problem, found, budgets), (problem, budgets, found)
        assert true_cost(problem, found) == optimum[0]
    assert 40 < grouped < 120
