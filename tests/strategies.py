"""Random partition problems shared by the partitioner's tests (hypothesis draws and seeded ones)."""

from __future__ import annotations

import random

from hypothesis import strategies as st

from benchmarks.optimality import random_linear_dag
from fxsplit.partition.problem import PartitionProblem, Value

__all__ = ["draw_dag_values", "random_linear_dag", "seeded_dag"]


def draw_dag_values(draw: st.DrawFn, n: int, *, inputs: bool = True) -> list[Value]:
    """Values of a random DAG of ``n`` ops: each op's output read by 1-3 later ops, up to three weights
    shared by 1-3 ops, and (``inputs``) up to two model inputs read by 1-3 ops."""
    values = []
    for i in range(n - 1):
        readers = draw(st.sets(st.integers(i + 1, n - 1), min_size=1, max_size=3))
        values.append(Value(f"a{i}", draw(st.integers(0, 90)), i, tuple(sorted(readers))))
    for j in range(draw(st.integers(0, 3))):
        readers = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=3)))
        w = draw(st.integers(1, 60))
        values.append(Value(f"w{j}", w, readers[0], tuple(readers), weight=w))
    for j in range(draw(st.integers(0, 2)) if inputs else 0):
        readers = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=3)))
        values.append(Value(f"x{j}", draw(st.integers(0, 50)), readers[0], tuple(readers)))
    return values


def seeded_dag(rng: random.Random, n: int = 12, min_weight: int = 0) -> PartitionProblem:
    """``n`` ops, each output read by the next two (or fewer) later ops, one weight per op."""
    values = [
        Value(f"a{i}", rng.randint(1, 99), i, tuple(sorted(rng.sample(range(i + 1, n), min(n - i - 1, 2)))))
        for i in range(n - 1)
    ]
    values += [Value(f"w{i}", 0, i, (i,), weight=rng.randint(min_weight, 40)) for i in range(n)]
    return PartitionProblem(tuple(f"op{i}" for i in range(n)), tuple(values))
