"""The time objectives' programme (fxsplit.partition.throughput) against brute force over every contiguous placement."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxsplit.errors import BudgetError, SpecError
from fxsplit.partition.context import Context
from fxsplit.partition.contiguous import devices_of
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.refine import device_loads
from fxsplit.partition.result import placement_problems, transfer_bytes
from fxsplit.partition.solve import partition
from fxsplit.partition.throughput import Timing, fastest_boundaries, stage_times, time_of
from fxsplit.planning.stagecopies import without_weight_copies
from tests.strategies import draw_dag_values


def _contiguous_placements(n: int, devices: int):
    for cuts in itertools.combinations_with_replacement(range(n + 1), devices - 1):
        yield devices_of(n, [0, *cuts, n])


def _brute_force(problem: PartitionProblem, budgets: list[int], timing: Timing, objective: str) -> float | None:
    best = None
    for placed in _contiguous_placements(problem.num_ops, len(budgets)):
        if placement_problems(problem, placed, budgets):
            continue
        value = time_of(stage_times(problem, placed, timing), objective)
        best = value if best is None else min(best, value)
    return best


def _random_case(rng: random.Random, n: int, devices: int) -> tuple[PartitionProblem, list[int], Timing]:
    values = []
    for i in range(n - 1):
        readers = sorted(rng.sample(range(i + 1, n), min(n - i - 1, rng.randint(1, 3))))
        values.append(Value(f"a{i}", rng.randint(1, 400), i, tuple(readers)))
    for i in range(n):
        values.append(Value(f"w{i}", 0, i, (i,), weight=rng.randint(0, 50)))
    if rng.random() < 0.5:  # a weight read at both ends, like a tied embedding
        values.append(Value("tied", 64, 0, (0, n - 1), weight=30))
    problem = PartitionProblem(tuple(f"op{i}" for i in range(n)), tuple(values))
    total = sum(problem.op_weights())
    budgets = [int(total * rng.uniform(0.3, 1.2)) for _ in range(devices)]
    speeds = [rng.choice([1.0, 1.0, 2.0, 0.5]) for _ in range(devices)]  # unlike devices too
    seconds = np.array([[rng.uniform(0.1, 3.0) for _ in range(n)]] * devices) / np.array(speeds)[:, None]
    return problem, budgets, Timing.uniform(seconds, bandwidth=rng.choice([50.0, 200.0, 1e4]), latency=0.05)


@pytest.mark.parametrize("stage_copies", [False, True])
@pytest.mark.parametrize("objective", ["throughput", "latency"])
def test_programme_equals_brute_force_over_contiguous_placements(objective: str, stage_copies: bool) -> None:
    """``stage_copies``: as pipeline_stages plans, every stage holding the weights it reads (the tied one is
    never copied)."""
    rng = random.Random(13)
    feasible = 0
    for _ in range(400):
        n, devices = rng.randint(2, 9), rng.randint(2, 4)
        problem, budgets, timing = _random_case(rng, n, devices)
        if stage_copies:
            weights = [i for i, value in enumerate(problem.values) if value.weight]
            problem = without_weight_copies(problem, weights)
            assert all(not value.nbytes for value in problem.values if value.weight)
        optimum = _brute_force(problem, budgets, timing, objective)
        boundaries = fastest_boundaries(Context(problem, budgets), timing, objective)
        if optimum is None:
            assert boundaries is None
            continue
        feasible += 1
        assert boundaries is not None
        placed = devices_of(n, boundaries)
        assert not placement_problems(problem, placed, budgets)
        assert time_of(stage_times(problem, placed, timing), objective) == pytest.approx(optimum, rel=1e-9)
    assert feasible > 250  # the corpus exercises the programme, not only refusals


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_partition_throughput_is_the_contiguous_optimum(data: st.DataObject) -> None:
    n = data.draw(st.integers(2, 8))
    devices = data.draw(st.integers(2, 3))
    problem = PartitionProblem(tuple(f"op{i}" for i in range(n)), tuple(draw_dag_values(data.draw, n)))
    total = max(sum(problem.op_weights()), 1)
    budgets = [data.draw(st.integers(total // devices, total)) for _ in range(devices)]
    seconds = np.array([[data.draw(st.floats(0.01, 5.0)) for _ in range(n)] for _ in range(devices)])
    timing = Timing.uniform(seconds, bandwidth=100.0, latency=0.01)
    optimum = _brute_force(problem, budgets, timing, "throughput")
    if optimum is None:
        with pytest.raises(BudgetError):
            partition(problem, budgets, objective="throughput", timing=timing)
        return
    found = partition(problem, budgets, objective="throughput", timing=timing)
    assert list(found.op_devices) == sorted(found.op_devices)  # contiguous stages, in device order
    assert time_of(stage_times(problem, found.op_devices, timing), "throughput") == pytest.approx(optimum, rel=1e-9)


def test_a_weight_each_stage_holds_costs_no_copy_but_activations_still_do() -> None:
    chain = PartitionProblem(
        ("a", "b", "c"), (Value("tied", 64, 0, (0, 2), weight=30), Value("a", 8, 0, (1,)), Value("b", 8, 1, (2,)))
    )
    timing = Timing.uniform(np.ones((2, 3)), bandwidth=8.0, latency=0.0)
    assert stage_times(chain, [0, 0, 1], timing) == [(2.0, 0.0), (1.0, 9.0)]  # in one process: b and the weight
    held = without_weight_copies(chain, [0])
    assert stage_times(held, [0, 0, 1], timing) == [(2.0, 0.0), (1.0, 1.0)]  # stages holding it: b only
    assert fastest_boundaries(Context(held, [100, 100]), timing, "throughput") == [0, 2, 3]
    assert fastest_boundaries(Context(chain, [100, 100]), timing, "throughput") == [0, 3, 3]


def test_throughput_balances_equal_ops_and_uses_every_device() -> None:
    n = 8
    chain = PartitionProblem(
        tuple(f"op{i}" for i in range(n)), tuple(Value(f"a{i}", 10, i, (i + 1,)) for i in range(n - 1))
    )
    timing = Timing.uniform(np.ones((4, n)), bandwidth=1e6, latency=0.0)
    assert partition(chain, [100] * 4, objective="throughput", timing=timing).op_devices == (0, 0, 1, 1, 2, 2, 3, 3)
    # bytes alone leave everything on one device
    assert set(partition(chain, [100] * 4).op_devices) == {0}


def test_a_faster_device_takes_more_ops() -> None:
    n = 9
    chain = PartitionProblem(
        tuple(f"op{i}" for i in range(n)), tuple(Value(f"a{i}", 1, i, (i + 1,)) for i in range(n - 1))
    )
    seconds = np.stack([np.full(n, 2.0), np.full(n, 1.0)])  # device 1 twice as fast
    timing = Timing.uniform(seconds, bandwidth=1e9, latency=0.0)
    placed = partition(chain, [100, 100], objective="throughput", timing=timing).op_devices
    assert placed.count(0) == 3 and placed.count(1) == 6


def test_slow_links_keep_a_heavy_cut_out() -> None:
    # ops 0-3 equal; the value between ops 1 and 2 is huge, the others small: with a slow link the
    # stages split at 1|2 only if copying that value is cheaper than the imbalance.
    values = (Value("a0", 1, 0, (1,)), Value("a1", 10_000, 1, (2,)), Value("a2", 1, 2, (3,)))
    chain = PartitionProblem(("op0", "op1", "op2", "op3"), values)
    fast = Timing.uniform(np.ones((2, 4)), bandwidth=1e9, latency=0.0)
    slow = Timing.uniform(np.ones((2, 4)), bandwidth=1e3, latency=0.0)
    assert partition(chain, [100, 100], objective="throughput", timing=fast).op_devices == (0, 0, 1, 1)
    assert partition(chain, [100, 100], objective="throughput", timing=slow).op_devices in ((0, 1, 1, 1), (0, 0, 0, 1))


def test_stage_times_charge_each_value_once_per_receiving_device() -> None:
    skip = PartitionProblem(("a", "b", "c"), (Value("a", 100, 0, (1, 2)),))
    timing = Timing.uniform(np.ones((3, 3)), bandwidth=100.0, latency=0.5)
    assert stage_times(skip, [0, 1, 1], timing) == [(1.0, 0.0), (2.0, 1.5), (0.0, 0.0)]
    assert stage_times(skip, [0, 1, 2], timing) == [(1.0, 0.0), (1.0, 1.5), (1.0, 1.5)]


def test_time_objective_without_times_is_refused() -> None:
    chain = PartitionProblem(("a", "b"), (Value("a", 1, 0, (1,)),))
    with pytest.raises(SpecError, match="needs the seconds of each of the 2 ops on each of the 2 devices"):
        partition(chain, [10, 10], objective="throughput")


def test_latency_prefers_the_fast_device_over_fewest_bytes() -> None:
    chain = PartitionProblem(("a", "b", "c"), (Value("a", 1, 0, (1,)), Value("b", 1, 1, (2,))))
    seconds = np.stack([np.full(3, 10.0), np.full(3, 1.0)])
    timing = Timing.uniform(seconds, bandwidth=1e6, latency=0.0)
    assert partition(chain, [100, 100], objective="latency", timing=timing).op_devices == (1, 1, 1)
    assert partition(chain, [100, 100]).op_devices == (0, 0, 0)


def test_infeasible_throughput_says_what_does_not_fit() -> None:
    chain = PartitionProblem(("a", "b"), (Value("w", 0, 0, (0,), weight=500), Value("a", 1, 0, (1,))))
    timing = Timing.uniform(np.ones((2, 2)), bandwidth=1e6, latency=0.0)
    with pytest.raises(BudgetError, match="500"):
        partition(chain, [100, 100], objective="throughput", timing=timing)


def test_large_graphs_are_balanced_over_positions_spread_by_time() -> None:
    # past EXACT_LIMIT ops the programme runs over candidate positions; with every cut alike in bytes, the
    # bytes programme's candidates (cheapest cuts first) would all sit at the start of the graph
    rng = random.Random(5)
    n = 1200
    chain = PartitionProblem(
        tuple(f"op{i}" for i in range(n)), tuple(Value(f"a{i}", 64, i, (i + 1,)) for i in range(n - 1))
    )
    seconds = np.array([[rng.uniform(0.5, 1.5) for _ in range(n)]] * 4)
    timing = Timing.uniform(seconds, bandwidth=1e6, latency=1e-6)
    ctx = Context(chain, [10**9] * 4)
    spread = fastest_boundaries(ctx, timing, "throughput")
    exact = fastest_boundaries(ctx, timing, "throughput", np.arange(n + 1))
    assert spread is not None and exact is not None
    value = time_of(stage_times(chain, devices_of(n, spread), timing), "throughput")
    best = time_of(stage_times(chain, devices_of(n, exact), timing), "throughput")
    assert best <= value <= 1.01 * best
    assert value <= 1.01 * seconds[0].sum() / 4


def test_large_graphs_with_pins_keep_the_boundaries_the_pins_need() -> None:
    # a hand split by pins over 1,200 ops (like GPT-2's blocks pinned by quarters): the boundaries must fall
    # in the gaps between pinned runs, which the positions spread by time alone may miss
    n = 1200
    chain = PartitionProblem(
        tuple(f"op{i}" for i in range(n)),
        tuple(Value(f"a{i}", 64, i, (i + 1,)) for i in range(n - 1)),
        pinned={i: min(i // 301, 3) for i in range(n)},
    )
    seconds = np.array([[1.0 + (i % 13) / 13 for i in range(n)]] * 4)
    timing = Timing.uniform(seconds, bandwidth=1e6, latency=1e-6)
    placed = partition(chain, [10**9] * 4, objective="throughput", timing=timing).op_devices
    assert all(placed[op] == device for op, device in chain.pinned.items())


@pytest.mark.parametrize("objective", ["min_transfer", "balanced"])
def test_bytes_programmes_with_held_weights_equal_brute_force(objective: str) -> None:
    """Stages that hold the weights they read (each charged on every stage that reads it): the bytes objectives'
    contiguous optimum, against every contiguous placement within the budgets."""
    rng = random.Random(29)
    feasible = 0
    for _ in range(300):
        n, devices = rng.randint(2, 9), rng.randint(2, 4)
        problem, budgets, _ = _random_case(rng, n, devices)
        problem = without_weight_copies(problem, [i for i, value in enumerate(problem.values) if value.weight])
        fitting = [p for p in _contiguous_placements(n, devices) if not placement_problems(problem, p, budgets)]
        if not fitting:
            with pytest.raises(BudgetError):
                partition(problem, budgets, objective=objective)
            continue
        feasible += 1
        found = partition(problem, budgets, objective=objective)
        assert list(found.op_devices) == sorted(found.op_devices)  # held weights: stages in order
        assert not placement_problems(problem, found.op_devices, budgets)
        if objective == "min_transfer":
            assert found.transfer_bytes == min(transfer_bytes(problem, p) for p in fitting)
        else:  # the smallest largest budget fraction first, to the byte the lowered budgets round up to
            loads_of = [device_loads(problem, p, devices) for p in fitting]
            best = min(max(lo / b if b else 0.0 for lo, b in zip(loads, budgets, strict=True)) for loads in loads_of)
            loads = device_loads(problem, found.op_devices, devices)
            assert all(load <= int(b * best) + 1 for load, b in zip(loads, budgets, strict=True))
    assert feasible > 150
