"""Synthetic partition problems of any size, for timing the partitioner.

* :func:`deep`: a chain of ops, each with its own weight, passing one
  activation on, with a residual skip over four ops from every eighth op.
* :func:`skips`: a chain like :func:`deep` whose first half also sends a
  value to its mirror op in the second half every 50 ops (a U-Net's long
  skip connections: only a wrapped placement keeps them home).
* :func:`wide`: stages of ``width`` parallel branch ops reading the same
  fork value, merged by one op that reads every branch (fan-out and fan-in).

Sizes are pseudo-random but fixed by ``seed``, so every run times the same
problems.
"""

from __future__ import annotations

import random

from fxsplit.partition.problem import PartitionProblem, Value

__all__ = ["deep", "skips", "wide"]


def deep(num_ops: int, seed: int = 0) -> PartitionProblem:
    """A deep residual chain of ``num_ops`` ops."""
    rng = random.Random(seed)
    values: list[Value] = []
    for op in range(num_ops):
        weight = rng.randint(1, 64) * 4096
        values.append(Value(f"w{op}", weight, op, (op,), weight=weight))
        if op + 1 < num_ops:
            values.append(Value(f"a{op}", 4096, op, (op + 1,)))
        if op % 8 == 0 and op + 4 < num_ops:
            values.append(Value(f"s{op}", 4096, op, (op + 1, op + 4)))
    labels = tuple(f"layers.{op // 8}.op{op % 8}" for op in range(num_ops))
    return PartitionProblem(tuple(f"op{op}" for op in range(num_ops)), tuple(values), op_labels=labels)


def skips(num_ops: int, seed: int = 0, every: int = 50) -> PartitionProblem:
    """A chain of ``num_ops`` ops with long skips from the first half to the mirror op in the second."""
    rng = random.Random(seed)
    values: list[Value] = []
    for op in range(num_ops):
        weight = rng.randint(1, 64) * 4096
        values.append(Value(f"w{op}", weight, op, (op,), weight=weight))
        if op + 1 < num_ops:
            values.append(Value(f"a{op}", 4096, op, (op + 1,)))
        if op % every == 0 and op < num_ops // 2:
            values.append(Value(f"s{op}", 8192, op, (op + 1, num_ops - 1 - op)))
    labels = tuple(f"layers.{op // 8}.op{op % 8}" for op in range(num_ops))
    return PartitionProblem(tuple(f"op{op}" for op in range(num_ops)), tuple(values), op_labels=labels)


def wide(num_ops: int, width: int = 16, seed: int = 0) -> PartitionProblem:
    """Stages of one fork op, ``width`` branch ops and one merge op, ``num_ops`` ops in all."""
    rng = random.Random(seed)
    values: list[Value] = []
    labels: list[str] = []
    op = 0
    stage = 0
    while op < num_ops:
        fork = op
        branches = list(range(fork + 1, min(fork + 1 + width, num_ops)))
        merge = fork + 1 + width if fork + 1 + width < num_ops else None
        values.append(Value(f"w{fork}", 4096, fork, (fork,), weight=4096))
        if branches:
            values.append(Value(f"f{fork}", 8192, fork, tuple(branches)))
        for branch in branches:
            weight = rng.randint(1, 32) * 4096
            values.append(Value(f"w{branch}", weight, branch, (branch,), weight=weight))
            if merge is not None:
                values.append(Value(f"b{branch}", 2048, branch, (merge,)))
        labels += [f"stages.{stage}.fork"] + [f"stages.{stage}.branches.{i}" for i in range(len(branches))]
        op = fork + 1 + len(branches)
        if merge is not None:
            if merge + 1 < num_ops:
                values.append(Value(f"m{merge}", 8192, merge, (merge + 1,)))
            labels.append(f"stages.{stage}.merge")
            op = merge + 1
        stage += 1
    return PartitionProblem(tuple(f"op{i}" for i in range(num_ops)), tuple(values), op_labels=tuple(labels))
