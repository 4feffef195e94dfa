"""Whole module runs placed in any order (fxsplit.partition.coarse, the module_runs strategy): the coarsened
problem copies and loads exactly what the full one does, runs keep the constraints, and the strategy only
ever lowers the bytes."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from benchmarks.optimality import constrained_dag, random_linear_dag
from benchmarks.synthetic import skips
from fxsplit.errors import BudgetError
from fxsplit.partition import DEFAULT_STRATEGIES
from fxsplit.partition.coarse import coarsened, label_runs, merged, module_placements, run_limit
from fxsplit.partition.context import Context
from fxsplit.partition.exact import exact_placement, taken_placements
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.refine import device_loads
from fxsplit.partition.result import placement_problems, transfer_bytes
from fxsplit.partition.solve import partition
from fxsplit.partition.strategies import module_runs


def labelled(problem: PartitionProblem, rng: random.Random) -> PartitionProblem:
    """``problem`` with module labels: consecutive ops grouped into blocks of a few ops, some nested."""
    labels, block = [], 0
    while len(labels) < problem.num_ops:
        size = rng.randint(1, 4)
        for i in range(size):
            labels.append(f"blocks.{block}.part{i % 2}" if rng.random() < 0.7 else "")
        block += 1
    return dataclasses.replace(problem, op_labels=tuple(labels[: problem.num_ops]))


def cases(seed: int, count: int, sizes: tuple[int, int] = (4, 12)) -> list[tuple[PartitionProblem, list[int]]]:
    rng = random.Random(seed)
    found = []
    for _ in range(count):
        k = rng.randint(2, 4) if sizes[1] <= 14 else rng.randint(3, 4)
        n = rng.randint(*sizes)
        problem = constrained_dag(rng, n, k) if rng.random() < 0.5 else random_linear_dag(rng, n)
        total = sum(problem.op_weights()) + max(problem.transients(), default=0)
        budgets = [int(total * rng.uniform(0.9, 1.9) / k) + 1 for _ in range(k)]
        found.append((labelled(problem, rng), budgets))
    return found


@pytest.mark.parametrize("seed", [0, 1])
def test_the_coarsened_problem_copies_and_loads_what_the_full_one_does(seed: int) -> None:
    rng = random.Random(seed)
    for problem, budgets in cases(seed, 40):
        ctx = Context(problem, budgets)
        forbidden = np.asarray(ctx.forbidden[: problem.num_ops], dtype=bool)
        starts = label_runs(problem, ctx.label_depths, forbidden, 2)
        assert starts[0] == 0 and not any(forbidden[s] for s in starts[1:])
        small, run = coarsened(problem, starts)
        assert small.num_ops == len(starts) and run.tolist() == sorted(run.tolist())
        for _ in range(10):
            coarse = [rng.randrange(len(budgets)) for _ in range(small.num_ops)]
            full = [coarse[r] for r in run]
            assert transfer_bytes(small, coarse) == transfer_bytes(problem, full)
            assert device_loads(small, coarse, len(budgets)) == device_loads(problem, full, len(budgets))


def test_merging_keeps_the_lightest_pairs_together_and_never_joins_two_pins() -> None:
    chain = PartitionProblem(
        op_names=tuple(f"op{i}" for i in range(6)),
        values=tuple(Value(f"w{i}", 0, i, (i,), weight=w) for i, w in enumerate([50, 1, 1, 50, 50, 50]))
        + tuple(Value(f"a{i}", 4, i, (i + 1,)) for i in range(5)),
        pinned={0: 0, 1: 1},
    )
    crossing = Context(chain, [100, 100]).crossing
    # 1 + 1 first, then that pair with the 50 after it (the lighter 50 + 2 before it would join two pins)
    assert merged(chain, [0, 1, 2, 3, 4, 5], 4, crossing) == [0, 1, 4, 5]
    assert merged(chain, [0, 1, 2, 3, 4, 5], 1, crossing)[:2] == [0, 1]  # the two pinned ops stay apart
    assert run_limit(2) == 24 and run_limit(3) == 15 and run_limit(4) == 14


@pytest.mark.parametrize("seed", [0, 1])
def test_module_runs_keeps_every_rule_and_never_raises_the_bytes(seed: int) -> None:
    without = tuple(s for s in DEFAULT_STRATEGIES if s is not module_runs)
    for problem, budgets in cases(seed, 30):
        for placed in module_placements(Context(problem, budgets), budgets):
            assert placement_problems(problem, placed, budgets) == []
    for problem, budgets in cases(seed, 8, (16, 40)):  # too large for exact_search: module_runs runs
        try:
            before = partition(problem, budgets, strategies=without)
        except BudgetError:
            continue
        after = partition(problem, budgets)
        assert after.transfer_bytes <= before.transfer_bytes


def test_interleaved_towers_go_to_one_device_each() -> None:
    """Two towers whose ops alternate in op order: no contiguous cut separates them, their modules do."""
    n = 12
    values = [Value(f"w{i}", 0, i, (i,), weight=10) for i in range(n)]
    values += [Value(f"a{i}", 100, i, (i + 2,)) for i in range(n - 2)]
    towers = PartitionProblem(
        op_names=tuple(f"op{i}" for i in range(n)),
        values=tuple(values),
        op_labels=tuple(f"{'text' if i % 2 else 'vision'}.layers.{i // 2}" for i in range(n)),
    )
    placed = partition(towers, [60, 60])
    assert placed.transfer_bytes == 0
    assert len({placed.op_devices[i] for i in range(0, n, 2)}) == 1


def test_a_wrapped_skip_chain_copies_less_than_the_programmes_alone() -> None:
    problem = skips(1000)
    total = sum(v.weight for v in problem.values)
    budgets = [int(1.5 * total / 3)] * 3
    without = tuple(s for s in DEFAULT_STRATEGIES if s is not module_runs)
    assert partition(problem, budgets).transfer_bytes < partition(problem, budgets, strategies=without).transfer_bytes


def test_module_runs_does_nothing_without_labels_or_with_one_device() -> None:
    problem, budgets = cases(5, 1)[0]
    bare = dataclasses.replace(problem, op_labels=())
    assert module_placements(Context(bare, budgets), budgets) == []
    assert module_placements(Context(problem, budgets[:1]), budgets[:1]) == []
    assert list(itertools.islice(DEFAULT_STRATEGIES, None)).count(module_runs) == 1


@pytest.mark.parametrize("seed", [3, 17, 29])
def test_the_search_gives_the_placements_it_took_as_its_best_in_turn(seed: int) -> None:
    """Each fits, each copies less than the one before, the last is what exact_placement finds; ``keep`` takes the
    last ones and ``below`` drops the dearer."""
    for problem, budgets in cases(seed, 20, (5, 10)):
        best = exact_placement(problem, budgets, None)
        taken = taken_placements(problem, budgets, below=None, keep=100)
        if best is None:
            assert taken == []
            continue
        assert taken[-1] == best
        costs = [transfer_bytes(problem, placed) for placed in taken]
        assert costs == sorted(set(costs), reverse=True)
        assert all(placement_problems(problem, placed, budgets) == [] for placed in taken)
        assert taken_placements(problem, budgets, below=None, keep=2) == taken[-2:]
        assert taken_placements(problem, budgets, below=costs[0], keep=100) == taken[1:]
