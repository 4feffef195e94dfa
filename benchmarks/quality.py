"""Placement quality: fxsplit vs Accelerate vs the block-level optimum, under tight and loose budgets.

For every model, number of devices N (2, 4) and budget (tight: 1.1 x total / N
per device; loose: 1.5 x total / N), where "total" is the bytes of every
parameter and buffer (each tensor once):

* fxsplit: ``fxsplit.plan(model, {"cpu:0": b, ...}, example_inputs=...)``;
* Accelerate, called the ways :mod:`benchmarks.accelerate_maps` describes;
* the block-level optimum of :mod:`benchmarks.reference`.

All placements are scored by :func:`benchmarks.placements.score` on the same
traced graph, so the bytes are comparable. :func:`run_quality` also runs
:mod:`benchmarks.optimality`: fxsplit's default placement against brute force
over every placement of small random DAGs.
"""

from __future__ import annotations

from typing import Any, Sequence

import fxsplit
from benchmarks.accelerate_maps import VARIANTS, variants_for
from benchmarks.models import Case, top_level_blocks
from benchmarks.optimality import OPTIMALITY_CASES, run_optimality
from benchmarks.placements import Score, from_device_map, from_plan, output_copies, score
from benchmarks.reference import BlockOptimum, block_optimum, block_problem, op_blocks
from fxsplit.cost.build import GraphCosts, build_problem
from fxsplit.errors import BudgetError
from fxsplit.planning.build import output_values
from fxsplit.tracing.capture import trace

__all__ = ["BUDGET_FACTORS", "DEVICE_COUNTS", "packable", "run_quality"]

BUDGET_FACTORS = {"tight": 1.1, "loose": 1.5}
Returned = tuple[str, int, int]  # a returned tensor: name, bytes, the op it comes from (output_values)
DEVICE_COUNTS = (2, 4)


def packable(sizes: Sequence[int], budgets: Sequence[int]) -> str:
    """``"yes"`` if first-fit-decreasing packs the tensors into the budgets in any order,
    ``"no"`` if they cannot be packed at all, else ``"unknown"``."""
    if sum(sizes) > sum(budgets) or (sizes and max(sizes) > max(budgets)):
        return "no"
    free = list(budgets)
    for size in sorted(sizes, reverse=True):
        slot = next((k for k, f in enumerate(free) if f >= size), None)
        if slot is None:
            return "unknown"
        free[slot] -= size
    return "yes"


def _score_dict(result: Score, budgets: Sequence[int]) -> dict[str, Any]:
    return {
        "bytes_between": result.bytes_between,
        "offload_bytes": result.offload_bytes,
        "total_bytes": result.total_bytes,
        "spilled_bytes": result.spilled_bytes,
        "empty_devices": result.empty_devices,
        "device_bytes": list(result.device_bytes),
        "max_fraction": round(result.max_fraction, 4),
        "exceeded": any(b > budget for b, budget in zip(result.device_bytes, budgets, strict=True)),
    }


def _fxsplit_row(
    case: Case, model: Any, costs: GraphCosts, budgets: list[int], returned: Sequence[Returned]
) -> dict[str, Any]:
    named = {f"cpu:{k}": b for k, b in enumerate(budgets)}
    kwargs = case.kwargs() or None
    try:
        plan = fxsplit.plan(model, named, example_inputs=case.inputs(), example_kwargs=kwargs, mode="weights")
    except BudgetError as error:
        return {"placed": False, "error": str(error)}
    placement = from_plan(costs, plan)
    row = _score_dict(score(costs, placement, budgets), budgets)
    outputs = output_copies(costs, returned, placement, list(named).index(plan.output_device), reuse=True)
    row.update(placed=True, plan_transfer_bytes=plan.transfer_bytes, output_bytes=outputs)
    row.update(copied_bytes=row["total_bytes"] + outputs, plan_copied_bytes=plan.copied_bytes)
    return row


def _accelerate_row(
    variant: str, case: Case, model: Any, costs: GraphCosts, budgets: list[int], returned: Sequence[Returned]
) -> dict[str, Any]:
    try:
        device_map = VARIANTS[variant](model, budgets, case.block_classes)
    except Exception as error:  # noqa: BLE001 - report whatever Accelerate raises
        return {"placed": False, "error": f"{type(error).__name__}: {error}"}
    placement = from_device_map(costs, device_map, len(budgets))
    row = _score_dict(score(costs, placement, budgets), budgets)
    outputs = output_copies(costs, returned, placement, 0, reuse=False)  # its root hook: to the inputs' device
    row.update(placed=True, device_map={k: str(v) for k, v in device_map.items()}, output_bytes=outputs)
    row.update(copied_bytes=row["total_bytes"] + outputs)
    return row


def _reference_row(reference: BlockOptimum | None, budgets: list[int]) -> dict[str, Any] | None:
    if reference is None:
        return None
    loads = zip(reference.device_weights, budgets, strict=True)
    return {
        "bytes_between": reference.transfer_bytes,
        "max_fraction": round(max(w / b for w, b in loads), 4),
        "empty_devices": sum(1 for k in range(len(budgets)) if k not in set(reference.op_devices)),
    }


def quality_for_case(case: Case, device_counts: Sequence[int] = DEVICE_COUNTS) -> list[dict[str, Any]]:
    """Every (N, budget) row for one model."""
    model = case.build()
    traced = trace(model, example_inputs=case.inputs(), example_kwargs=case.kwargs() or None)
    costs = build_problem(traced.graph_module, model, device_index={})
    returned = output_values(costs, traced.graph_module)
    blocks = top_level_blocks(model, case.block_classes)
    bp = block_problem(costs.problem, op_blocks(costs.ops, blocks))
    sizes = [w.nbytes for w in [*costs.weights, *costs.unused]]
    total = sum(sizes)
    rows = []
    for n in device_counts:
        for kind, factor in BUDGET_FACTORS.items():
            budgets = [int(factor * total / n)] * n
            reference = block_optimum(bp, budgets)
            row: dict[str, Any] = {
                "model": case.name,
                "family": case.family,
                "n_devices": n,
                "budget": kind,
                "budget_bytes": budgets[0],
                "total_bytes": total,
                "ops": costs.problem.num_ops,
                "blocks": bp.num_blocks,
                "packable": packable(sizes, budgets),
                "fxsplit": _fxsplit_row(case, model, costs, budgets, returned),
                "reference": _reference_row(reference, budgets),
                "accelerate": {
                    v: _accelerate_row(v, case, model, costs, budgets, returned) for v in variants_for(case.family)
                },
            }
            rows.append(row)
    return rows


def quality_bars(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pass/fail of each placement-quality bar, with the failing cases named."""

    def name(row: dict[str, Any]) -> str:
        return f"{row['model']}/N={row['n_devices']}/{row['budget']}"

    unplaced = [name(r) for r in rows if r["packable"] == "yes" and not r["fxsplit"]["placed"]]
    over = [name(r) for r in rows if r["fxsplit"].get("exceeded")]
    above_acc, above_acc_between, above_ref, above_acc_all = [], [], [], []
    for r in rows:
        fx = r["fxsplit"]
        if not fx["placed"]:
            continue
        for variant, acc in r["accelerate"].items():
            if acc["placed"] and fx["bytes_between"] > acc["total_bytes"]:
                above_acc.append(f"{name(r)} vs {variant}: {fx['bytes_between']} > {acc['total_bytes']}")
            if acc["placed"] and fx["copied_bytes"] > acc["copied_bytes"]:
                above_acc_all.append(f"{name(r)} vs {variant}: {fx['copied_bytes']} > {acc['copied_bytes']}")
            if acc["placed"] and fx["bytes_between"] > acc["bytes_between"]:
                above_acc_between.append(f"{name(r)} vs {variant}: {fx['bytes_between']} > {acc['bytes_between']}")
        if r["reference"] is not None and fx["bytes_between"] > r["reference"]["bytes_between"]:
            above_ref.append(f"{name(r)}: {fx['bytes_between']} > {r['reference']['bytes_between']}")
    return {
        "places every packable case": {"pass": not unplaced, "failures": unplaced},
        "cut bytes <= Accelerate's (offload streaming counted)": {"pass": not above_acc, "failures": above_acc},
        "every copy <= Accelerate's, outputs too (its root hook returns them to the inputs' device, 0)": {
            "pass": not above_acc_all,
            "failures": above_acc_all,
        },
        "info: cut bytes <= Accelerate's between the given devices (its disk streaming not counted)": {
            "pass": not above_acc_between,
            "failures": above_acc_between,
            "info": True,
        },
        "cut bytes <= block-level optimum where it exists": {"pass": not above_ref, "failures": above_ref},
        "no budget exceeded": {"pass": not over, "failures": over},
    }


def quality_headlines(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and ratios that sum the table up (fxsplit vs Accelerate's documented call)."""
    ratios, spills, empties = [], 0, 0
    by_spill: dict[bool, list[float]] = {True: [], False: []}
    for r in rows:
        acc, fx = r["accelerate"]["accelerate"], r["fxsplit"]
        spills += bool(acc.get("spilled_bytes"))
        empties += bool(acc.get("empty_devices"))
        if fx["placed"] and acc["placed"] and acc["total_bytes"]:
            ratios.append(fx["bytes_between"] / acc["total_bytes"])
            by_spill[bool(acc.get("spilled_bytes"))].append(ratios[-1])
    ratios.sort()
    return {
        "cases": len(rows),
        "fxsplit_placed": sum(r["fxsplit"]["placed"] for r in rows),
        "accelerate_spilled_cases": spills,
        "accelerate_empty_device_cases": empties,
        "fxsplit_empty_device_cases": sum(bool(r["fxsplit"].get("empty_devices")) for r in rows),
        "bytes_ratio_vs_accelerate": {"min": ratios[0], "median": ratios[len(ratios) // 2], "max": ratios[-1]}
        if ratios
        else None,
        # The ratios are bimodal (Accelerate streaming from "disk" or not): the median of all of them
        # jumps between the two groups as cases come and go, so each group is summed up on its own.
        "bytes_ratio_by_accelerate_spill": {
            ("spilled" if spilled else "on_devices"): {
                "cases": len(group),
                "min": min(group),
                "median": sorted(group)[len(group) // 2],
                "max": max(group),
            }
            for spilled, group in by_spill.items()
            if group
        },
        "fxsplit_fewer_bytes_cases": sum(x <= 1 for x in ratios),
        "both_placed_cases": len(ratios),
    }


def run_quality(
    cases: Sequence[Case],
    device_counts: Sequence[int] = DEVICE_COUNTS,
    optimality_cases: int = OPTIMALITY_CASES["full"],
) -> dict[str, Any]:
    """Rows for every case, the bars and headlines; with ``optimality_cases``, also the default placement
    against brute force on that many small random DAGs (:func:`benchmarks.optimality.run_optimality`), whose
    bars join the rest."""
    rows = [row for case in cases for row in quality_for_case(case, device_counts)]
    found = {"rows": rows, "bars": quality_bars(rows), "headlines": quality_headlines(rows)}
    if optimality_cases:
        found["optimality"] = run_optimality(optimality_cases)
        found["bars"].update(found["optimality"]["bars"])
    return found
