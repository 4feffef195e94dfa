"""partition()'s strategies as a list: custom lists, bad lists, and the rules every strategy's answer keeps."""

from __future__ import annotations

import random

import pytest
from strategies import random_linear_dag, seeded_dag

from fxsplit.errors import BudgetError, SpecError
from fxsplit.partition import DEFAULT_STRATEGIES, Search
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.result import placement_problems
from fxsplit.partition.solve import partition
from fxsplit.partition.strategies import (
    CONTIGUOUS_STRATEGIES,
    contiguous,
    contiguous_and_wrapped,
    exact_fallback,
    exact_search,
    local_moves,
    min_cut_exchanges,
    packing,
)

TIED = PartitionProblem(
    op_names=("embed", "body", "head"),
    values=(
        Value("wte", 1000, 0, (0, 2), weight=1000),
        Value("w_body", 0, 1, (1,), weight=900),
        Value("embed", 10, 0, (1,)),
        Value("body", 10, 1, (2,)),
    ),
)


def problems() -> list[tuple[PartitionProblem, list[int]]]:
    rng = random.Random(3)
    found = []
    for _ in range(12):
        problem = random_linear_dag(rng, rng.randint(3, 14)) if rng.random() < 0.5 else seeded_dag(rng, 10)
        total = sum(problem.op_weights())
        k = rng.randint(2, 4)
        found.append((problem, [int(total * rng.uniform(0.4, 0.9)) + 1 for _ in range(k)]))
    return found


def test_the_contiguous_programme_alone_gives_the_contiguous_answer() -> None:
    for problem, budgets in problems():
        try:
            expected = partition(problem, budgets, contiguous=True)
        except BudgetError:
            with pytest.raises(BudgetError):
                partition(problem, budgets, strategies=[contiguous])
            continue
        result = partition(problem, budgets, strategies=[contiguous])
        assert result == expected
        assert list(result.op_devices) == sorted(result.op_devices)
    assert CONTIGUOUS_STRATEGIES == (contiguous,)


def test_the_default_list_passed_in_gives_the_default_answer() -> None:
    for problem, budgets in problems():
        try:
            expected = partition(problem, budgets)
        except BudgetError:
            continue
        assert partition(problem, budgets, strategies=DEFAULT_STRATEGIES) == expected
        assert partition(problem, budgets, strategies=list(DEFAULT_STRATEGIES)) == expected


def test_a_later_strategy_improves_the_best_so_far() -> None:
    assert partition(TIED, [1500, 1500], strategies=[contiguous]).op_devices == (0, 1, 1)
    improved = partition(TIED, [1500, 1500], strategies=[contiguous, local_moves])
    assert improved.op_devices == (0, 1, 0)
    assert improved.transfer_bytes == 20


def test_strategies_see_the_best_so_far_and_ties_keep_it() -> None:
    seen: list[tuple[int, ...] | None] = []

    def spy(search: Search, best: tuple[int, ...] | None) -> list[int] | None:
        seen.append(best)
        assert search.problem is TIED and search.budgets == [1500, 1500]
        return [0, 1, 1]  # as costly as the best: kept out

    result = partition(TIED, [1500, 1500], strategies=[spy, contiguous, local_moves, spy])
    assert seen == [None, (0, 1, 0)]
    assert result.op_devices == (0, 1, 0)


def test_every_strategy_answers_within_the_rules() -> None:
    lists = [[s] for s in (contiguous, contiguous_and_wrapped, packing, exact_fallback)]
    lists += [[contiguous, s] for s in (min_cut_exchanges, exact_search, local_moves)]
    for problem, budgets in problems():
        search = Search(problem, budgets)
        for chosen in lists:
            best = None
            for strategy in chosen:
                found = strategy(search, best)
                if found is not None:
                    assert placement_problems(problem, found, search.budgets) == [], strategy.__name__
                    best = tuple(found)


def test_an_empty_list_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="at least one strategy"):
        partition(TIED, [1500, 1500], strategies=[])


@pytest.mark.parametrize("bad", ["contiguous", contiguous, 3])
def test_something_other_than_a_list_is_a_spec_error(bad: object) -> None:
    with pytest.raises(SpecError, match="must be a list of strategies"):
        partition(TIED, [1500, 1500], strategies=bad)  # type: ignore[arg-type]


def test_an_item_that_is_not_callable_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"strategies\[1\] must be a callable strategy\(search, best\)"):
        partition(TIED, [1500, 1500], strategies=[contiguous, "local_moves"])  # type: ignore[list-item]


def test_a_strategy_that_breaks_the_rules_is_named() -> None:
    def everything_on_one(search: Search, best: tuple[int, ...] | None) -> list[int]:
        return [0] * search.problem.num_ops

    def too_short(search: Search, best: tuple[int, ...] | None) -> list[int]:
        return [0]

    with pytest.raises(SpecError, match=r"'everything_on_one' .* device 0 needs 1900 bytes, more than its budget"):
        partition(TIED, [1500, 1500], strategies=[everything_on_one])
    with pytest.raises(SpecError, match=r"'too_short' .* places 1 ops, but the problem has 3"):
        partition(TIED, [1500, 1500], strategies=[too_short])
    with pytest.raises(SpecError, match="'local_moves' .* not contiguous"):
        partition(TIED, [1500, 1500], contiguous=True, strategies=[contiguous, local_moves])


def test_when_no_strategy_places_the_error_names_them() -> None:
    with pytest.raises(BudgetError, match=r"by the strategies given \('local_moves'\), though a contiguous"):
        partition(TIED, [1500, 1500], strategies=[local_moves])
    chain = PartitionProblem(("a", "b", "c"), tuple(Value(f"w{i}", 0, i, (i,), weight=60) for i in range(3)))
    with pytest.raises(BudgetError, match="in order or out of order"):
        partition(chain, [100, 100])
    with pytest.raises(BudgetError, match="contiguous=True"):
        partition(chain, [100, 100], contiguous=True)
    with pytest.raises(BudgetError, match=r"cannot be packed into the devices .* strategies given \('contiguous'\)"):
        partition(chain, [100, 100], strategies=[contiguous])
