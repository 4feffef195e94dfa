"""Replicas on the benchmarks' language models: bytes per forward with and without them, and the block optimum.

For GPT-2 and T5 of :mod:`benchmarks.models` (tied embeddings), N = 2 and 4 devices, tight (1.1 x total / N)
and loose (1.5 x total / N) budgets and ``mode="weights"``, as :mod:`benchmarks.quality` plans them:

* fxsplit with replicas (the default) and with ``replicate=False``: bytes copied between devices per
  forward, and the weights held on several devices;
* the block-level optimum of :mod:`benchmarks.reference` (whole top-level blocks, in order) without
  replicas, and with them: the tied embedding may be held on every device that runs one of its readers.

The block optimum with replicas is exact. It is the cheapest of the block optima of the plain problem and
of each problem :func:`fxsplit.planning.replicas.groupings` makes (one copy of the weight per group of its
readers, charged in full where the group's first reader runs). In order, the devices of a weight's
readers never go back, so the readers that share a device are consecutive; with two readers (GPT-2) or
three (T5), every way of grouping consecutive readers is one of those problems (all on one device: the
plain problem; each alone; the first alone; the last alone), and for the placements it describes each
charges exactly the bytes held and copied. Other groupings only over-charge, so the minimum is the optimum.
``tests/test_replication.py`` checks the GPT-2 and T5 rows at 2 loose devices against brute force.

Run: ``python -m benchmarks.replication [--out benchmarks/REPLICATION_RESULTS.md]`` (about 3 minutes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import fxsplit
from benchmarks.models import case_by_name, top_level_blocks
from benchmarks.quality import BUDGET_FACTORS
from benchmarks.reference import block_optimum, block_problem, op_blocks
from fxsplit.cost.build import build_problem
from fxsplit.errors import BudgetError
from fxsplit.planning.replicas import groupings, replicable, replicated_problem
from fxsplit.tracing.capture import trace
from fxsplit.units import format_size

__all__ = ["MODELS", "replicated_optimum", "replication_rows"]

MODELS = ("gpt2", "t5")


def replicated_optimum(costs: Any, blocks: Sequence[int], budgets: Sequence[int]) -> tuple[int | None, int | None]:
    """``(without, with)`` replicas: bytes per forward of the best in-order block placement, None if none fits."""
    plain = block_optimum(block_problem(costs.problem, blocks), budgets)
    shared = replicable(costs, training=False)
    found = [plain.transfer_bytes] if plain is not None else []
    for groups in groupings(costs.problem, shared) if shared else []:
        best = block_optimum(block_problem(replicated_problem(costs.problem, groups), blocks), budgets)
        if best is not None:
            found.append(best.transfer_bytes)
    return (plain.transfer_bytes if plain is not None else None), min(found, default=None)


def _plan(model: Any, budgets: dict[str, int], case: Any, replicate: bool) -> fxsplit.Plan | None:
    try:
        return fxsplit.plan(
            model,
            budgets,
            example_inputs=case.inputs(),
            example_kwargs=case.kwargs() or None,
            mode="weights",
            replicate=replicate,
        )
    except BudgetError:
        return None


def replication_rows(models: Sequence[str] = MODELS, device_counts: Sequence[int] = (2, 4)) -> list[dict[str, Any]]:
    """One row per model, device count and budget."""
    rows = []
    for name in models:
        case = case_by_name(name)
        model = case.build()
        traced = trace(model, example_inputs=case.inputs(), example_kwargs=case.kwargs() or None)
        costs = build_problem(traced.graph_module, model, device_index={})
        blocks = op_blocks(costs.ops, top_level_blocks(model, case.block_classes))
        total = sum(w.nbytes for w in [*costs.weights, *costs.unused])
        for n in device_counts:
            for kind, factor in BUDGET_FACTORS.items():
                budget = int(factor * total / n)
                named = {f"cpu:{k}": budget for k in range(n)}
                with_plan, without_plan = _plan(model, named, case, True), _plan(model, named, case, False)
                without_ref, with_ref = replicated_optimum(costs, blocks, [budget] * n)
                rows.append(
                    {
                        "model": name,
                        "n_devices": n,
                        "budget": kind,
                        "budget_bytes": budget,
                        "fxsplit": with_plan.transfer_bytes if with_plan else None,
                        "replicas": {k: list(r.devices) for k, r in with_plan.replicas.items()} if with_plan else {},
                        "fxsplit_no_replicas": without_plan.transfer_bytes if without_plan else None,
                        "block_optimum": without_ref,
                        "block_optimum_replicas": with_ref,
                    }
                )
    return rows


def _bytes(value: int | None) -> str:
    return "none fits" if value is None else f"{value:,} ({format_size(value)})"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, bytes copied between devices per forward."""
    lines = [
        "| model | N | budget | fxsplit | replicated | fxsplit, replicate=False | block optimum | "
        "block optimum, replicas |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        held = "; ".join(f"{k} on +{', '.join(v)}" for k, v in r["replicas"].items()) or "-"
        lines.append(
            f"| {r['model']} | {r['n_devices']} | {r['budget']} ({format_size(r['budget_bytes'])}) | "
            f"{_bytes(r['fxsplit'])} | {held} | {_bytes(r['fxsplit_no_replicas'])} | {_bytes(r['block_optimum'])} | "
            f"{_bytes(r['block_optimum_replicas'])} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--out", type=Path, default=None, help="write the table (Markdown) here too")
    args = parser.parse_args(argv)
    table = markdown(replication_rows(args.models))
    print(table)
    if args.out is not None:
        header = (
            "# Replicas: bytes copied between devices per forward (`python -m benchmarks.replication`)\n\n"
            "mode='weights'; tight = 1.1 x total / N, loose = 1.5 x total / N per device; the block optimum is\n"
            "the best in-order placement of the top-level blocks (see benchmarks/replication.py).\n\n"
        )
        args.out.write_text(header + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
