"""Single-op refinement of placements (fxsplit.partition.refine): loads, frozen ops, improve, pack, repair.

Every result is checked against tests/reference.py (true cost, loads, feasibility), which shares no
code with fxsplit.partition.
"""

from __future__ import annotations

import random

from reference import feasible, loads, true_cost
from strategies import random_linear_dag, seeded_dag

from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.refine import device_loads, frozen_ops, improve, pack, repair


def tied_head() -> PartitionProblem:
    """GPT-2's shape: the embedding (1000 B) is read again by the head, three ops later."""
    return PartitionProblem(
        ("embed", "body0", "body1", "head"),
        (
            Value("wte", 1000, 0, (0, 3), weight=1000),
            Value("w0", 0, 1, (1,), weight=500),
            Value("w1", 0, 2, (2,), weight=500),
            Value("embed", 10, 0, (1,)),
            Value("body0", 10, 1, (2,)),
            Value("body1", 10, 2, (3,)),
        ),
    )


def test_device_loads_are_resident_bytes_plus_the_largest_transient() -> None:
    problem = PartitionProblem(
        ("a", "b", "c"),
        (Value("w", 0, 0, (0, 2), weight=100), Value("x", 5, 0, (1,))),
        op_extra=(1, 2, 3),
        op_transient=(50, 7, 20),
    )
    assert device_loads(problem, [0, 0, 1], 2) == [100 + 1 + 2 + 50, 3 + 20]
    assert device_loads(problem, [1, 0, 1], 3) == [2 + 7, 100 + 1 + 3 + 50, 0]
    for placement in ([0, 0, 0], [0, 1, 0], [1, 1, 0]):
        assert device_loads(problem, placement, 2) == loads(problem, placement, 2)


def test_frozen_ops_are_pinned_grouped_or_between_a_write_and_its_reads() -> None:
    problem = PartitionProblem(
        tuple(f"op{i}" for i in range(8)),
        (Value("state", 4, 5, (6, 7), movable=False),),  # written at 5, read at 6 and 7: 5..7 share a device
        pinned={0: 0},
        together=((2, 3),),
    )
    assert frozen_ops(problem) == {0, 2, 3, 5, 6, 7}
    assert frozen_ops(PartitionProblem(("a", "b"), ())) == set()


def test_improve_moves_the_tied_head_home() -> None:
    problem, budgets = tied_head(), [1600, 1600]
    start = [0, 0, 1, 1]
    assert true_cost(problem, start) == 1000 + 10
    better = improve(problem, start, budgets)
    assert better == [0, 0, 1, 0]  # the head reads the embedding where it lives; its input travels instead
    assert true_cost(problem, better) == 10 + 10 and feasible(problem, better, budgets)
    assert start == [0, 0, 1, 1]  # the caller's list is not changed


def test_improve_keeps_budgets_pins_and_one_device() -> None:
    problem = tied_head()
    assert improve(problem, [0, 0, 1, 1], [1499, 1600]) == [0, 0, 1, 1]  # the head's move would not fit
    pinned = PartitionProblem(problem.op_names, problem.values, pinned={3: 1})
    assert improve(pinned, [0, 0, 1, 1], [1600, 1600]) == [0, 0, 1, 1]
    assert improve(problem, [0, 0, 0, 0], [5000]) == [0, 0, 0, 0]


def test_improve_only_lowers_the_cost_and_keeps_every_constraint_on_random_dags() -> None:
    rng = random.Random(11)
    moved = 0
    for _ in range(40):
        problem = random_linear_dag(rng, rng.randint(6, 30))
        k = rng.randint(2, 4)
        total = sum(problem.op_weights())
        budgets = [int(total / k * rng.uniform(1.1, 2.0)) + 1 for _ in range(k)]
        start = pack(problem, budgets)
        if start is None:
            continue
        frozen = frozen_ops(problem)
        better = improve(problem, start, budgets)
        assert feasible(problem, better, budgets)
        assert true_cost(problem, better) <= true_cost(problem, start)
        assert all(better[op] == start[op] for op in frozen)
        moved += better != start
    assert moved > 5  # the moves were exercised, not only the checks


def test_pack_walks_in_order_then_folds_back() -> None:
    chain = PartitionProblem(
        ("a", "b", "c", "d"), tuple(Value(f"w{i}", 0, i, (i,), weight=w) for i, w in enumerate((60, 60, 60, 20)))
    )
    assert pack(chain, [130, 130]) == [0, 0, 1, 1]
    folds = PartitionProblem(
        ("a", "b", "c", "d"), tuple(Value(f"w{i}", 0, i, (i,), weight=w) for i, w in enumerate((50, 80, 10, 40)))
    )
    # b moves on to device 1 and c follows it; d fits there no more and folds back to device 0 (first fit by
    # size would give [1, 0, 0, 1]: the data flow order is kept where it can be)
    assert pack(folds, [100, 90]) == [0, 1, 1, 0]


def test_pack_falls_back_to_first_fit_by_size() -> None:
    # in order: a (30) and b (50) on device 0 (80), c (60) on device 1 (60 of 80), d (40) fits nowhere;
    # by decreasing size: c (60) on 0, b (50) on 1, d (40) on 0 (100), a (30) on 1 (80)
    problem = PartitionProblem(
        ("a", "b", "c", "d"), tuple(Value(f"w{i}", 0, i, (i,), weight=w) for i, w in enumerate((30, 50, 60, 40)))
    )
    budgets = [100, 80]
    placement = pack(problem, budgets)
    assert placement is not None and feasible(problem, placement, budgets)
    assert placement == [1, 1, 0, 0]


def test_pack_keeps_indivisible_runs_and_pins_or_gives_up() -> None:
    problem = PartitionProblem(
        ("a", "b", "c"),
        tuple(Value(f"w{i}", 0, i, (i,), weight=40) for i in range(3)),
        pinned={2: 1},
        together=((0, 1),),
    )
    assert pack(problem, [100, 100]) == [0, 0, 1]
    assert pack(problem, [79, 1000]) == [1, 1, 1]  # the group does not fit device 0: both go to device 1
    assert pack(problem, [100, 79]) == [0, 0, 1]
    assert pack(problem, [79, 79]) is None  # the group (80) fits no device
    assert pack(problem, [1000, 39]) is None  # the pinned op fits only where it may not go
    assert pack(PartitionProblem(("a",), (Value("w", 0, 0, (0,), weight=10),)), [9, 9]) is None


def test_pack_fits_whenever_its_placement_is_returned_on_random_dags() -> None:
    rng = random.Random(5)
    found = 0
    for _ in range(60):
        problem = seeded_dag(rng, n=rng.randint(2, 14), min_weight=1)
        k = rng.randint(1, 4)
        total = sum(problem.op_weights())
        budgets = [int(total / k * rng.uniform(0.8, 1.6)) for _ in range(k)]
        placement = pack(problem, budgets)
        if k == 1:  # one device: packing fails exactly when the model does not fit it
            assert (placement is None) == (total > budgets[0])
        if placement is None:
            continue
        found += 1
        assert len(placement) == problem.num_ops and feasible(problem, placement, budgets)
    assert found > 20


def test_repair_moves_the_cheapest_weights_off_the_device_over_budget() -> None:
    problem = tied_head()
    over = [0, 0, 0, 1]  # device 0 holds 2000 of a 1600 budget
    budgets = [1600, 1600]
    fixed = repair(problem, over, budgets)
    assert fixed is not None and feasible(problem, fixed, budgets)
    # one op moved: the embedding (1000 B) joins the head that reads it again, so nothing big is copied;
    # moving body1 instead would also fit but copy the embedding every forward
    assert fixed == [1, 0, 0, 1] and true_cost(problem, fixed) == 20
    assert sum(a != b for a, b in zip(fixed, over, strict=True)) == 1
    assert over == [0, 0, 0, 1]


def test_repair_returns_a_fitting_placement_unchanged_and_gives_up_when_nothing_fits() -> None:
    problem = tied_head()
    assert repair(problem, [0, 0, 1, 1], [1600, 1600]) == [0, 0, 1, 1]
    assert repair(problem, [0, 0, 0, 0], [1000, 500]) is None  # 2000 bytes into 1500
    pinned = PartitionProblem(problem.op_names, problem.values, pinned={0: 0, 1: 0, 2: 0})
    assert repair(pinned, [0, 0, 0, 1], [1600, 1600]) is None  # every op that holds weights is pinned there


def test_repair_results_always_fit_on_random_dags() -> None:
    rng = random.Random(3)
    repaired = 0
    for _ in range(80):
        problem = random_linear_dag(rng, rng.randint(4, 20))
        k = rng.randint(2, 4)
        total = sum(problem.op_weights())
        budgets = [int(total / k * 1.3) + 1] * k
        contiguous = sorted(rng.randrange(k) for _ in range(problem.num_ops))
        fixed = repair(problem, contiguous, budgets)
        if fixed is not None:
            assert feasible(problem, fixed, budgets)
            assert all(fixed[op] == contiguous[op] for op in frozen_ops(problem))
            repaired += not feasible(problem, contiguous, budgets)
    assert repaired > 10  # placements over budget were brought within it, not only left alone
