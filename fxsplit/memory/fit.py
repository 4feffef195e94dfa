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

__all__ = ["MAX_REPLANS", "SMALLER_CAPS", "fit_budgets"]

MAX_REPLANS = 4
"""Re-plans allowed beyond one per device: an over-full run of ops that the default, out-of-order partitioner may
place on any of several equal devices can move to each in turn before every one of them is held below it."""


SMALLER_CAPS = (0.9, 0.8, 0.7, 0.6, 0.5)
"""When no plan tried fits, planning again as for budgets this much smaller (each cap scaled), in turn: a plan that
fits smaller budgets fits these, and the partitioner, held to less, spreads the model further. Without these, a
program that fitted three budgets of 45% of its one-device total was refused at 50% (its activations, charged only
once placed, tipped one device over in each of six plans tried)."""


@gc_paused()
def fit_budgets(model: MemoryModel, budgets: Budgets, solve: Callable[[Sequence[int]], Plan]) -> Plan:
    """Plan so that each device's simulated total fits its budget less its reserve; record the breakdown.

    ``solve`` partitions under per-device caps (bytes, in device order) and makes the plan. The caps start at
    ``budgets.caps()``. When a device's row comes out over its budget less its reserve
    (:func:`fxsplit.planning.rules.budget_overruns`) by an excess, its cap becomes what the partitioner charged it
    for that plan less the excess (or the cap less the excess, if lower), so the next plan moves at least that much
    off it, and the model is planned again. When no plan so made fits, the same again from caps scaled by each of
    :data:`SMALLER_CAPS` in turn (every plan is still checked against the budgets themselves), until the partitioner
    cannot fit the scaled caps at all; the first refusal is raised when none fits.

    Raises:
        BudgetError: nothing fits; says which component does not, where, by how much.
    """
    found = _fit_from(model, budgets, solve, budgets.caps())
    if isinstance(found, Plan):
        return found
    refusal, partitioned = found
    for scale in SMALLER_CAPS if partitioned else ():
        again = _fit_from(model, budgets, solve, [int(cap * scale) for cap in budgets.caps()])
        if isinstance(again, Plan):
            return again
        if not again[1]:  # the partitioner fits nothing under these caps: nor under smaller ones
            break
    raise refusal


def _fit_from(
    model: MemoryModel, budgets: Budgets, solve: Callable[[Sequence[int]], Plan], caps: list[int]
) -> Plan | tuple[BudgetError, bool]:
    """The plan :func:`fit_budgets` makes starting from ``caps``, or why none fits and whether the partitioner
    placed the model under them at all (False: it refused the first caps)."""
    usable = budgets.usable
    usage: dict[str, dict[str, int]] = {}
    refused: BudgetError | None = None  # the first refusal, when planning again with the charge's slack allowed
    attempt = 0
    while attempt < MAX_REPLANS + len(caps) + 1:
        try:
            plan = solve(list(caps))
        except BudgetError as error:
            if refused is not None:
                return refused, False
            slack = charge_slack(model.planned_profile) * max(1, model.chunks) if attempt == 0 and model.profile else 0
            if slack:  # the charge is an upper bound: allow its slack, and let the exact check hold the budgets
                refused = model.explain(error, usable)
                caps = [cap + slack for cap in caps]
                continue
            if attempt == 0:
                return model.explain(error, usable), False
            return model.over_budget(usage, usable), True
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
    return model.over_budget(usage, usable), True
