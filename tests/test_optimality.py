"""The default (out-of-order) placement against brute force over all N^k placements (no torch).

The corpus and the oracle are benchmarks/optimality.py's (the benchmark reports the same figures in
benchmarks/RESULTS.md): random DAGs of 4-10 ops on 2-4 devices, ``linear`` ones as issue 14 measured
(skip connections, tied weights, budgets of 0.95-1.9 x total / N) and ``constrained`` ones (pins,
colocated groups, values changed in place, transient and extra bytes, budgets from 0.9 x total / N).
Issue 14's bars: optimal on >= 98% of feasible cases, never above 1.25x the optimum, no feasible case
refused, and more budget never gives more bytes. ``pytest -s`` prints the figures.
"""

from __future__ import annotations

import pytest
from reference import true_cost

from benchmarks.optimality import any_order_optimum, run_optimality
from fxsplit.errors import BudgetError
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.result import placement_problems
from fxsplit.partition.solve import partition


def _assert_bars(seed: int, cases: int) -> None:
    result = run_optimality(cases, seed)
    total = result["summary"]
    print(
        f"\nseed {seed}: optimal in {total['optimal']} of {total['feasible']} feasible cases ({total['rate']:.1%}), "
        f"worst ratio {total['worst_ratio']}, {total['refused']} refused, {total['not_monotone']} not monotone"
    )
    assert total["feasible"] > cases // 2  # most cases fit: the rate is over many
    assert total["rate"] >= 0.98, result["missed"]
    assert total["worst_ratio"] <= 1.25, result["missed"]
    assert total["refused"] == total["placed_infeasible"] == total["errors"] == 0, result["missed"]
    assert total["not_monotone"] == 0, result["missed"]
    assert all(bar["pass"] for bar in result["bars"].values())


def test_default_placement_is_optimal_and_monotone_on_small_dags() -> None:
    _assert_bars(seed=1, cases=60)


@pytest.mark.slow  # brute force over up to 4^10 placements, ~1-2 min each
@pytest.mark.parametrize("seed", [2, 3])
def test_default_placement_is_optimal_and_monotone_on_many_small_dags(seed: int) -> None:
    _assert_bars(seed, cases=400)


def _dag(n: int, activations: list[tuple[int, int, tuple[int, ...]]], weights: list[int]) -> tuple[Value, ...]:
    """Values: each ``(nbytes, start, readers)`` an activation, then one weight per op."""
    values = [Value(f"a{i}", nbytes, start, readers) for i, (nbytes, start, readers) in enumerate(activations)]
    return (*values, *(Value(f"w{i}", 0, i, (i,), weight=w) for i, w in enumerate(weights)))


def test_a_colocated_group_that_fits_only_apart_from_the_ops_between_is_placed() -> None:
    # ops 0 and 4 write one tensor: they share a device, the ops between need not. Held as one span the
    # five ops need 234 B, more than a device (this was refused); apart, the group and op 3 fit on device 0.
    values = _dag(
        5,
        [(64, 0, (2, 3, 4)), (16, 1, (2, 3, 4)), (32, 2, (4,)), (128, 3, (4,)), (128, 0, (0, 1))],
        [59, 65, 64, 25, 21],
    )
    problem = PartitionProblem(tuple(f"op{i}" for i in range(5)), values, colocated=((0, 4),))
    optimum = any_order_optimum(problem, [142, 142])
    assert optimum is not None and optimum[0] == 240
    found = partition(problem, [142, 142])
    assert not placement_problems(problem, found.op_devices, [142, 142])
    assert found.transfer_bytes == true_cost(problem, found.op_devices) == 240


def test_a_colocated_group_is_searched_exactly_not_moved_after() -> None:
    # the cheapest placement ignoring the group then moving it costs 640 B; searching with it, 384 B
    values = _dag(4, [(128, 0, (1, 2, 3)), (256, 1, (2,)), (512, 2, (3,))], [32, 46, 7, 13])
    problem = PartitionProblem(tuple(f"op{i}" for i in range(4)), values, op_extra=(5, 11, 12, 0), colocated=((0, 3),))
    assert any_order_optimum(problem, [98, 90]) == (384, (0, 1, 0, 0))
    found = partition(problem, [98, 90])
    assert found.transfer_bytes == true_cost(problem, found.op_devices) == 384
    assert found.op_devices[0] == found.op_devices[3]


def test_moving_a_colocated_group_takes_the_span_it_shares_an_op_with() -> None:
    # op 4 is colocated with op 1 and reads a2, a value changed in place (ops 2-4 share a device): bringing
    # the group together must move ops 2-4 too (it split them, and partition raised a SpecError)
    values = (
        Value("a0", 16, 0, (4,)),
        Value("a1", 512, 1, (2, 3, 4)),
        Value("a2", 128, 2, (3, 4), movable=False),
        Value("a3", 64, 3, (4,)),
        Value("w1", 0, 1, (1,), weight=7),
        Value("w2", 0, 2, (2,), weight=31),
        Value("s0", 33, 0, (0, 4), weight=33),
        Value("x0", 64, 2, (2, 4)),
    )
    problem = PartitionProblem(tuple(f"op{i}" for i in range(5)), values, colocated=((1, 4),))
    for budgets in ([35, 35, 35], [40, 40, 40], [71, 71]):
        optimum = any_order_optimum(problem, budgets)
        if optimum is None:
            with pytest.raises(BudgetError):
                partition(problem, budgets)
            continue
        found = partition(problem, budgets)
        assert not placement_problems(problem, found.op_devices, budgets)
        assert found.transfer_bytes == optimum[0]
