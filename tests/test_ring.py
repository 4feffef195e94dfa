"""Wrapped placements (device 0 also runs the last ops), against brute force (no torch)."""

from __future__ import annotations

import itertools
import random
from typing import Sequence

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from reference import feasible, placements, true_cost
from strategies import draw_dag_values

from fxsplit.errors import BudgetError
from fxsplit.partition.context import Context
from fxsplit.partition.contiguous import candidates, cut_cost_matrix, segment_masks
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.ring import has_long_reach, wrap_points, wrapped_placement
from fxsplit.partition.solve import partition


def wrapped_placements(n: int, k: int, b: int) -> list[tuple[int, ...]]:
    """Every placement with device 0 on ``[0, a)`` and ``[b, n)``, devices 1.. in order on ``[a, b)``."""
    found = []
    for cuts in itertools.combinations_with_replacement(range(b + 1), k - 1):
        bounds = (*cuts, b)
        devices = [0] * n
        for d in range(1, k):
            for op in range(bounds[d - 1], bounds[d]):
                devices[op] = d
        found.append(tuple(devices))
    return found


def all_placements(n: int, k: int) -> list[tuple[int, ...]]:
    return list(itertools.product(range(k), repeat=n))


def wrapped_at(problem: PartitionProblem, budgets: Sequence[int], b: int) -> list[int] | None:
    ctx = Context(problem, list(budgets))
    cands = np.arange(problem.num_ops + 1)
    cost = cut_cost_matrix(ctx, cands)
    seg_weight, masks = segment_masks(ctx, cands, budgets)
    return wrapped_placement(ctx, cands, cost, seg_weight, masks, budgets, b)


@st.composite
def skip_dags(draw: st.DrawFn) -> tuple[PartitionProblem, list[int], int]:
    """Random DAGs with long skips, shared weights, inputs, pins, extra and transient loads."""
    n = draw(st.integers(2, 8))
    k = draw(st.integers(2, 4))
    values = draw_dag_values(draw, n, inputs=False)
    pinned_ops = sorted(draw(st.sets(st.integers(0, n - 1), max_size=2)))
    pins = {op: draw(st.integers(0, k - 1)) for op in pinned_ops}
    extra = tuple(draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))) if draw(st.booleans()) else ()
    transient = tuple(draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))) if draw(st.booleans()) else ()
    problem = PartitionProblem(
        tuple(f"op{i}" for i in range(n)), tuple(values), pins, op_extra=extra, op_transient=transient
    )
    budgets = draw(st.lists(st.integers(0, 200), min_size=k, max_size=k))
    return problem, budgets, draw(st.integers(1, n - 1))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(skip_dags())
def test_wrapped_placement_is_the_cheapest_wrapped_at_that_point(case: tuple[PartitionProblem, list[int], int]) -> None:
    problem, budgets, b = case
    fits = [p for p in wrapped_placements(problem.num_ops, len(budgets), b) if feasible(problem, p, budgets)]
    suffix_pins_ok = all(d == 0 for op, d in problem.pinned.items() if op >= b)
    found = wrapped_at(problem, budgets, b)
    event("a wrapped placement fits" if fits and suffix_pins_ok else "none fits")
    if not fits or not suffix_pins_ok:
        assert found is None or not suffix_pins_ok  # wrap_points never offers a b with pins off device 0 after it
        return
    assert found is not None
    assert feasible(problem, found, budgets)
    assert tuple(found) in set(wrapped_placements(problem.num_ops, len(budgets), b))
    assert true_cost(problem, found) == min(true_cost(problem, p) for p in fits)


def u_net(depth: int = 3, skip: int = 100, step: int = 8, weight: int = 10) -> PartitionProblem:
    """Encoder ops 0..depth-1, bottleneck, decoder: encoder op i sends ``skip`` bytes to its mirror."""
    n = 2 * depth + 1
    values = [Value(f"a{i}", step, i, (i + 1,)) for i in range(n - 1)]
    values += [Value(f"s{i}", skip, i, (n - 1 - i,)) for i in range(depth)]
    values += [Value(f"w{i}", 0, i, (i,), weight=weight * (1 + min(i, n - 1 - i))) for i in range(n)]
    return PartitionProblem(tuple(f"op{i}" for i in range(n)), tuple(values))


def test_u_net_keeps_its_skips_home_where_contiguous_cannot() -> None:
    """The deep middle goes to the other devices; the outer ops and their skips share device 0."""
    problem = u_net()
    total = sum(v.weight for v in problem.values)
    budgets = [total // 2 + 20, total // 2 + 20]
    contiguous = partition(problem, budgets, contiguous=True)
    result = partition(problem, budgets)
    fits = [p for p in all_placements(problem.num_ops, 2) if feasible(problem, p, budgets)]
    best = min(true_cost(problem, p) for p in fits)
    assert result.transfer_bytes == true_cost(problem, result.op_devices) == best
    assert best < contiguous.transfer_bytes
    assert result.op_devices[0] == result.op_devices[-1] == 0  # the wrap: first and last ops together
    assert feasible(problem, result.op_devices, budgets)


def test_wrap_where_no_contiguous_placement_fits() -> None:
    """Heavy middle: in order, device 0 would need prefix+middle; wrapped, the middle fits device 1 alone."""
    n = 7
    weights = [10, 10, 10, 80, 10, 10, 10]
    values = [Value(f"a{i}", 4, i, (i + 1,)) for i in range(n - 1)]
    values += [Value(f"w{i}", 0, i, (i,), weight=w) for i, w in enumerate(weights)]
    values += [Value("skip", 50, 0, (6,))]
    problem = PartitionProblem(tuple(f"op{i}" for i in range(n)), tuple(values))
    budgets = [60, 85]
    result = partition(problem, budgets)
    assert feasible(problem, result.op_devices, budgets)
    assert result.op_devices == (0, 0, 0, 1, 0, 0, 0)
    assert result.transfer_bytes == 8


def test_no_wrap_over_a_pin_to_another_device() -> None:
    problem = u_net()
    pinned = PartitionProblem(problem.op_names, problem.values, {problem.num_ops - 1: 1})
    total = sum(v.weight for v in problem.values)
    budgets = [total // 2 + 5, total // 2 + 5]
    result = partition(pinned, budgets)
    assert result.op_devices[-1] == 1
    assert feasible(pinned, result.op_devices, budgets)
    ctx = Context(pinned, budgets)
    assert wrap_points(ctx, candidates(ctx, None), budgets[0]) == []


def test_chains_have_no_long_reach_so_the_wrap_is_not_tried() -> None:
    values = [Value(f"a{i}", 8, i, (i + 1,)) for i in range(9)]
    chain = PartitionProblem(tuple(f"op{i}" for i in range(10)), tuple(values))
    assert not has_long_reach(Context(chain, [1, 1]))
    assert has_long_reach(Context(u_net(), [1, 1]))


def test_seeded_u_nets_default_never_worse_than_brute_force_over_wrapped_and_contiguous() -> None:
    """Random U-shaped problems, 9 ops on 3 devices: at least as good as every wrapped or contiguous placement."""
    rng = random.Random(5)
    for _ in range(25):
        depth = 4
        n = 2 * depth + 1
        values = [Value(f"a{i}", rng.randint(1, 40), i, (i + 1,)) for i in range(n - 1)]
        values += [Value(f"s{i}", rng.randint(0, 120), i, (n - 1 - i,)) for i in range(depth)]
        values += [Value(f"w{i}", 0, i, (i,), weight=rng.randint(1, 50)) for i in range(n)]
        problem = PartitionProblem(tuple(f"op{i}" for i in range(n)), tuple(values))
        total = sum(v.weight for v in values)
        budgets = [int(total * rng.uniform(0.4, 0.7)) for _ in range(3)]
        shapes = {p for b in range(1, n) for p in wrapped_placements(n, 3, b)} | set(placements(n, 3))
        fits = [p for p in shapes if feasible(problem, p, budgets)]
        try:
            result = partition(problem, budgets)
        except BudgetError:  # then no wrapped or contiguous shape may fit either
            assert not fits
            continue
        assert feasible(problem, result.op_devices, budgets)
        if fits:
            assert result.transfer_bytes <= min(true_cost(problem, p) for p in fits)
