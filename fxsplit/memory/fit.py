"""Plan until every device's memory row fits its budget less its reserve.

The partitioner charges each op and weight what the memory model can tell before ops are placed; a device's row
(:meth:`~fxsplit.memory.model.MemoryModel.usage`) is exact only once they are (activations copied in, the outputs
kept, what ``optimizer.step()`` holds after the backward, which the partitioner does not charge). :func:`fit_budgets`
plans again where a row comes out over, holding that device below what the partitioner charged it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from fxsplit.errors import BudgetError
from fxsplit.gcpause import gc_paused
from fxsplit.memory.model import MemoryModel
from fxsplit.memory.planloads import charge_slack
from fxsplit.options import Budgets
from fxsplit.planning.plan import Plan
from fxsplit.planning.rules import budget_overruns

__all__ = ["MAX_REPLANS", "fit_budgets"]

MAX_REPLANS = 4
"""Re-plans allowed beyond one per device: an over-full run of ops that the default, out-of-order partitioner may
place on any of several equal devices can move to each in turn before every one of them is held below it."""


@gc_paused()
def fit_budgets(model: MemoryModel, budgets: Budgets, solve: Callable[[Sequence[int]], Plan]) -> Plan:
    """Plan so that each device's simulated total fits its budget less its reserve; record the breakdown.

    ``solve`` partitions under per-device caps (bytes, in device order) and makes the plan. The caps start at
    ``budgets.caps()``. When a device's row comes out over its budget less its reserve
    (:func:`fxsplit.planning.rules.budget_overruns`) by an excess, its cap becomes what the partitioner charged it
    for that plan less the excess (or the cap less the excess, if lower), so the next plan moves at least that much
    off it, and the model is planned again.

    Raises:
        BudgetError: nothing fits; says which component does not, where, by how much.
    """
    usable = budgets.usable
    caps = budgets.caps()
    usage: dict[str, dict[str, int]] = {}
    refused: BudgetError | None = None  # the first refusal, when planning again with the charge's slack allowed
    attempt = 0
    while attempt < MAX_REPLANS + len(caps) + 1:
        try:
            plan = solve(list(caps))
        except BudgetError as error:
            if refused is not None:
                raise refused from None
            slack = charge_slack(model.planned_profile) * max(1, model.chunks) if attempt == 0 and model.profile else 0
            if slack:  # the charge is an upper bound: allow its slack, and let the exact check hold the budgets
                refused = model.explain(error, usable)
                caps = [cap + slack for cap in caps]
                continue
            raise (model.explain(error, usable) if attempt == 0 else model.over_budget(usage, usable)) from None
        attempt += 1
        usage = model.usage(plan)
        plan = dataclasses.replace(plan, memory=usage)
        simulated = {d: row.get("params", 0) + row.get("buffers", 0) for d, row in usage.items()}
        over = {o.device: o.excess for o in budget_overruns(plan, simulated, budgets)}
        if not over:
            return plan
        loads = model.charged_loads(plan)
        caps = [
            max(0, min(cap, loads.get(d, cap)) - over[d]) if d in over else cap
            for d, cap in zip(budgets.devices, caps, strict=True)
        ]
    raise model.over_budget(usage, usable)
