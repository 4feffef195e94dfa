"""The default (out-of-order) placement against brute force on small random graphs (no torch).

A seeded corpus of small partition problems, each solved by
:func:`fxsplit.partition.solve.partition` and by brute force over all ``k ** n``
placements (:func:`any_order_optimum`, vectorised with numpy, written from the
problem's definition and sharing no code with the partitioner). Two families:

* ``linear``: as issue 14 measured: 4-10 ops with a weight each (a ``Linear``),
  each output read by 1-3 later ops (skip connections), up to two tied
  weights; 2-4 devices; budgets of 0.95-1.9 x total / N, equal for all devices
  or drawn per device;
* ``constrained``: the same shapes with what real graphs add: pins (in device
  order), ops that write one tensor in place (colocated groups), values
  changed in place (their readers stay home), model inputs, per-op transient
  and extra bytes, weightless ops and heavy ones; budgets of 0.9-1.9 x total / N.

Every placement has ``N ** k <= 4 ** 10``. For each case the corpus records
whether fxsplit refused it (brute force says whether it is feasible), its
bytes over the optimum, and whether more memory ever gave more bytes (the
budgets times 1.1, 1.3 and 2): :func:`run_optimality` sums these up, with the
bars of issue 14 (optimal on >= 98% of feasible cases, never above 1.25x, no
feasible case refused, monotone in the budget).

Run alone: ``python -m benchmarks.optimality [--cases N] [--seed S]`` (prints JSON).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any, Sequence

import numpy as np

from fxsplit.errors import BudgetError, FxsplitError
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.solve import partition

__all__ = [
    "FAMILIES",
    "LOOSER",
    "OPTIMALITY_CASES",
    "any_order_optimum",
    "constrained_dag",
    "draw_case",
    "every_placement",
    "measure_case",
    "random_linear_dag",
    "run_optimality",
    "summarise",
]

FAMILIES = ("linear", "constrained")
OPTIMALITY_CASES = {"full": 1000, "quick": 80}
"""Cases drawn (half of each family) by a full run and by ``--quick``."""
LOOSER = (1.1, 1.3, 2.0)
"""Factors the budgets are raised by for the monotonicity check."""


def random_linear_dag(rng: random.Random, n: int) -> PartitionProblem:
    """``n`` ops with a weight each (a ``Linear``), each output read by 1-3 later ops (skip connections),
    and up to two weights shared by 1-3 ops (tied)."""
    values = []
    for i in range(n - 1):
        readers = rng.sample(range(i + 1, n), rng.randint(1, min(3, n - 1 - i)))
        values.append(Value(f"a{i}", rng.randint(1, 16) * 64, i, tuple(sorted(readers))))
    values += [Value(f"w{i}", 0, i, (i,), weight=rng.randint(1, 40)) for i in range(n)]
    for j in range(rng.randint(0, 2)):
        readers = sorted(rng.sample(range(n), rng.randint(1, min(3, n))))
        w = rng.randint(1, 60)
        values.append(Value(f"s{j}", w, readers[0], tuple(readers), weight=w))
    return PartitionProblem(tuple(f"op{i}" for i in range(n)), tuple(values))


def constrained_dag(rng: random.Random, n: int, k: int) -> PartitionProblem:
    """A DAG of ``n`` ops for ``k`` devices with pins, a colocated group, values changed in place, a model
    input, transient and extra bytes, and weights from none to heavy."""
    values = []
    for i in range(n - 1):
        readers = tuple(sorted(rng.sample(range(i + 1, n), rng.randint(1, min(3, n - 1 - i)))))
        values.append(Value(f"a{i}", rng.choice([1, 2, 4, 8, 16, 32]) * 16, i, readers, movable=rng.random() > 0.05))
    values += [
        Value(f"w{i}", 0, i, (i,), weight=rng.choice([0, rng.randint(1, 40), rng.randint(30, 90)])) for i in range(n)
    ]
    for j in range(rng.randint(0, 2)):
        readers = tuple(sorted(rng.sample(range(n), rng.randint(1, min(3, n)))))
        w = rng.randint(1, 60)
        values.append(Value(f"s{j}", w, readers[0], readers, weight=w))
    if rng.random() < 0.5:
        readers = tuple(sorted(rng.sample(range(n), rng.randint(1, min(2, n)))))
        values.append(Value("x", rng.randint(1, 8) * 16, readers[0], readers))
    pinned: dict[int, int] = {}
    if rng.random() < 0.3:
        ops = sorted(rng.sample(range(n), rng.randint(1, 2)))
        pinned = dict(zip(ops, sorted(rng.randrange(k) for _ in ops), strict=True))
    colocated = (tuple(sorted(rng.sample(range(n), 2))),) if n > 3 and rng.random() < 0.25 else ()
    transient = tuple(rng.randint(0, 30) for _ in range(n)) if rng.random() < 0.3 else ()
    extra = tuple(rng.randint(0, 20) for _ in range(n)) if rng.random() < 0.3 else ()
    return PartitionProblem(
        tuple(f"op{i}" for i in range(n)),
        tuple(values),
        pinned,
        op_extra=extra,
        op_transient=transient,
        colocated=colocated,
    )


def draw_case(rng: random.Random, family: str) -> tuple[PartitionProblem, list[int]]:
    """One problem of ``family`` (see the module's docstring) and its budgets."""
    devices = rng.randint(2, 4)
    ops = rng.randint(4, 10)
    if family == "linear":
        problem, low = random_linear_dag(rng, ops), 0.95
    else:
        problem, low = constrained_dag(rng, ops, devices), 0.9
    share = sum(problem.op_weights()) / devices
    if rng.random() < 0.5:
        budgets = [int(rng.uniform(low, 1.9) * share)] * devices
    else:
        budgets = [int(rng.uniform(low, 1.9) * share) for _ in range(devices)]
    return problem, budgets


def every_placement(n: int, k: int) -> np.ndarray:
    """All ``k ** n`` placements of ``n`` ops on ``k`` devices, one per row (any order, any device)."""
    return np.indices((k,) * n).reshape(n, -1).T.astype(np.int8)


def any_order_optimum(problem: PartitionProblem, budgets: Sequence[int]) -> tuple[int, tuple[int, ...]] | None:
    """The cheapest feasible placement of all ``k ** n`` (true cost, vectorised over placements), or None.

    Feasible, by the rules :class:`~fxsplit.partition.problem.PartitionProblem` states: every device's resident
    bytes (weights at their home op, ``op_extra``) plus its largest ``op_transient`` within its budget, pins
    held, each together-group on one device with every op between its members, each colocated group on one
    device, and a value that is not movable kept on one device from its home to its last reader (the span
    ``placement_problems`` checks: its readers stay home and no cut falls between).
    Cost: each value's bytes once per device other than its home that reads it. Ties: the first placement
    in the order of :func:`every_placement`.
    """
    k, n = len(budgets), problem.num_ops
    grid = every_placement(n, k)
    ok = np.ones(len(grid), dtype=bool)
    extra = np.asarray(problem.op_extra or (0,) * n, dtype=np.int64)
    transient = np.asarray(problem.op_transient or (0,) * n, dtype=np.int64)
    for d in range(k):
        on_d = grid == d
        load = on_d @ extra
        for v in problem.values:
            if v.weight:
                load = load + on_d[:, v.start] * v.weight
        ok &= load + (on_d * transient).max(axis=1) <= budgets[d]
    for op, d in problem.pinned.items():
        ok &= grid[:, op] == d
    spans = [(min(g), max(g)) for g in problem.together if g]
    spans += [(min(v.start, v.consumers[0]), v.last) for v in problem.values if not v.movable and v.consumers]
    for group in [*(range(lo, hi + 1) for lo, hi in spans), *problem.colocated]:
        for op in list(group)[1:]:
            ok &= grid[:, op] == grid[:, min(group)]
    if not ok.any():
        return None
    grid = grid[ok]
    cost = np.zeros(len(grid), dtype=np.int64)
    for v in problem.values:
        if not v.nbytes or not v.consumers:
            continue
        home = grid[:, v.start]
        for d in range(k):
            reads_on_d = np.zeros(len(grid), dtype=bool)
            for c in v.consumers:
                reads_on_d |= grid[:, c] == d
            cost += v.nbytes * (reads_on_d & (home != d))
    best = int(np.argmin(cost))
    return int(cost[best]), tuple(int(d) for d in grid[best])


def _placed_bytes(problem: PartitionProblem, budgets: Sequence[int]) -> tuple[int | str | None, float]:
    """fxsplit's bytes per forward (None: refused; a string: any other error, which is a bug) and the seconds
    partition() took."""
    clock = time.perf_counter()
    try:
        found: int | str | None = partition(problem, budgets).transfer_bytes
    except BudgetError:
        found = None
    except FxsplitError as error:
        found = f"{type(error).__name__}: {error}"
    return found, time.perf_counter() - clock


def measure_case(problem: PartitionProblem, budgets: Sequence[int]) -> dict[str, Any]:
    """One case: the optimum (None: nothing fits), fxsplit's bytes (None: refused or an error), the error other
    than a refusal (a bug), partition()'s milliseconds, and the budget factors of :data:`LOOSER` under which
    fxsplit copied more bytes, or refused."""
    optimum = any_order_optimum(problem, budgets)
    placed, seconds = _placed_bytes(problem, budgets)
    row: dict[str, Any] = {
        "ops": problem.num_ops,
        "devices": len(budgets),
        "optimum": None if optimum is None else optimum[0],
        "fxsplit": None if isinstance(placed, str) else placed,
        "error": placed if isinstance(placed, str) else None,
        "ms": round(seconds * 1000, 2),
        "not_monotone": [],
    }
    if isinstance(placed, int):
        for factor in LOOSER:
            looser, _ = _placed_bytes(problem, [int(b * factor) for b in budgets])
            if not isinstance(looser, int) or looser > placed:
                row["not_monotone"].append(factor)
    return row


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Feasible cases, how many fxsplit placed at the optimum (and the rate), the worst ratio to the optimum
    (a miss of an optimum of 0 bytes counts as infinite), feasible cases refused, infeasible ones placed
    (would be a bug), errors other than a refusal (bugs), cases whose bytes grew with the budget, and
    partition()'s median and largest milliseconds."""
    feasible = [r for r in rows if r["optimum"] is not None]
    placed = [r for r in feasible if r["fxsplit"] is not None]
    optimal = sum(r["fxsplit"] == r["optimum"] for r in placed)
    ratios = [
        r["fxsplit"] / r["optimum"] if r["optimum"] else float("inf") for r in placed if r["fxsplit"] > r["optimum"]
    ]
    times = sorted(r["ms"] for r in rows)
    return {
        "cases": len(rows),
        "feasible": len(feasible),
        "optimal": optimal,
        "rate": round(optimal / len(feasible), 4) if feasible else None,
        "worst_ratio": round(max(ratios, default=1.0), 3),
        "refused": len(feasible) - len(placed),
        "placed_infeasible": sum(r["optimum"] is None and r["fxsplit"] is not None for r in rows),
        "errors": sum(r["error"] is not None for r in rows),
        "not_monotone": sum(bool(r["not_monotone"]) for r in rows),
        "partition_ms": {"median": times[len(times) // 2], "max": times[-1]} if times else None,
    }


def run_optimality(cases: int = OPTIMALITY_CASES["full"], seed: int = 0) -> dict[str, Any]:
    """Draw ``cases`` cases (families alternating) from ``random.Random(seed)``; the summary over all of them
    and per family, the cases fxsplit missed (first 20), and the bars of issue 14."""
    rng = random.Random(seed)
    rows = []
    for index in range(cases):
        family = FAMILIES[index % len(FAMILIES)]
        problem, budgets = draw_case(rng, family)
        rows.append({"case": index, "family": family, "budgets": budgets, **measure_case(problem, budgets)})
    total = summarise(rows)
    missed = [r for r in rows if r["fxsplit"] != r["optimum"] or r["not_monotone"]]
    rate, worst = total["rate"], total["worst_ratio"]
    bars = {
        "default placement optimal on >= 98% of feasible small DAGs (brute force)": {
            "pass": rate is not None and rate >= 0.98,
            "value": f"{total['optimal']} of {total['feasible']} ({(rate or 0):.1%})",
        },
        "default placement never above 1.25x the optimum on small DAGs": {"pass": worst <= 1.25, "value": worst},
        "no feasible small DAG refused, no infeasible one placed, no error": {
            "pass": not total["refused"] and not total["placed_infeasible"] and not total["errors"],
            "value": f"{total['refused']} refused, {total['placed_infeasible']} placed infeasible, "
            f"{total['errors']} errors",
        },
        "more budget never gives more bytes (budgets x 1.1, 1.3, 2)": {
            "pass": not total["not_monotone"],
            "value": f"{total['not_monotone']} of {total['cases']} cases",
        },
    }
    return {
        "seed": seed,
        "summary": total,
        "by_family": {f: summarise([r for r in rows if r["family"] == f]) for f in FAMILIES},
        "missed": missed[:20],
        "bars": bars,
    }


def _problem_of(case: int, seed: int) -> tuple[PartitionProblem, list[int]]:
    """Case ``case`` of the corpus drawn from ``seed`` (to look at a miss)."""
    rng = random.Random(seed)
    for index in range(case + 1):
        problem, budgets = draw_case(rng, FAMILIES[index % len(FAMILIES)])
    return problem, budgets


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="fxsplit's default placement vs brute force on small DAGs")
    parser.add_argument("--cases", type=int, default=OPTIMALITY_CASES["full"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=None, help="print case N of the corpus and stop")
    args = parser.parse_args(argv)
    if args.show is not None:
        problem, budgets = _problem_of(args.show, args.seed)
        print(problem, budgets, any_order_optimum(problem, budgets), sep="\n")
        return
    result = run_optimality(args.cases, args.seed)
    print(json.dumps({k: result[k] for k in ("summary", "by_family", "missed")}, indent=1))


if __name__ == "__main__":
    main()
