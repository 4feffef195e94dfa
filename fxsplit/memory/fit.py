"""Plan until every device's memory row fits its budget less its reserve.

The partitioner charges each op and weight what the memory model can tell before ops are placed; a device's row
(:meth:`~fxsplit.memory.model.MemoryModel.usage`) is exact only once they are (activations copied in, the outputs
kept, what ``optimizer.step()`` holds after the backward, which the partitioner does not charge). :func:`fit_budgets`
plans again where a row comes out over, holding that device below what the partitioner charged it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from fxsplit.errors import BudgetError
from fxsplit.gcpause import gc_paused
from fxsplit.memory.model import MemoryModel
from fxsplit.memory.planloads import charge_slack
from fxsplit.options import Budgets
from fxsplit.partition.milp import milp_places, without_milp
from fxsplit.planning.plan import Plan
from fxsplit.planning.rules import budget_overruns

__all__ = ["CHEAPER_CAPS", "CHEAPER_OPS", "MAX_REPLANS", "SMALLER_CAPS", "fit_budgets", "fit_with"]

MAX_REPLANS = 4
"""Re-plans allowed beyond one per device: an over-full run of ops that the default, out-of-order partitioner may
place on any of several equal devices can move to each in turn before every one of them is held below it."""


SMALLER_CAPS = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
"""When no plan tried fits, planning again as for budgets this much smaller (each cap scaled), in turn: a plan that
fits smaller budgets fits these, and the partitioner, held to less, spreads the model further. Without these, a
program that fitted three budgets of 45% of its one-device total was refused at 50% (its activations, charged only
once placed, tipped one device over in each of six plans tried). The steps are 0.05, not 0.1: random training
program 14118 fits only from 0.8 of the caps of 55% of its total, and at 60% steps of 0.1 passed that by."""


CHEAPER_CAPS = (0.9,)
"""When activations are charged and the plan minimises the bytes copied, it is planned again as for budgets this
much smaller (each cap scaled) too, and the plan that copies fewer bytes wins (ties: the first). A plan that fits
smaller budgets fits these, but the partitioner is not monotone in its caps on graphs too large to search exactly,
so a larger budget could get a plan that copies more than a smaller one did. See docs/MEMORY.md for the numbers."""

CHEAPER_OPS = 2_000
"""Graphs of up to this many ops get the :data:`CHEAPER_CAPS` plans (each is a whole fit loop more)."""


@gc_paused()
def fit_budgets(model: MemoryModel, budgets: Budgets, solve: Callable[[Sequence[int]], Plan]) -> Plan:
    """:func:`fit_with` ``solve``; where the partitioner would solve the graph as a MILP
    (:func:`~fxsplit.partition.milp.milp_places`), the fit loop plans without it
    (:func:`~fxsplit.partition.milp.without_milp`), and the MILP then partitions once more under the caps the plan
    was made under: its plan is kept when its memory rows fit the budgets and it copies fewer bytes.

    In the fit loop itself (a partition per plan tried, each a MILP of 0.1-1 s on 20-40 ops) it made planning random
    training programs 6-14 times slower, and each cheaper partition could lead the loop elsewhere: program 14063
    over three devices at 0.6 of its one-device total was refused with it and fitted without.
    """
    if not milp_places(len(model.costs.ops), len(budgets.devices)):
        return fit_with(model, budgets, solve)
    with without_milp():
        found = _fitted(model, budgets, solve)
    plan = found.plan
    assert plan is not None
    if plan.objective != "min_transfer" or not plan.copied_bytes:
        return plan
    try:
        exact = solve(list(found.caps))
    except BudgetError:
        return plan
    fitted, over = _rows(model, budgets, exact)
    if not over and fitted.copied_bytes < plan.copied_bytes:
        plan = fitted
    return plan


def fit_with(model: MemoryModel, budgets: Budgets, solve: Callable[[Sequence[int]], Plan]) -> Plan:
    """The plan :func:`_fitted` makes (the fit loop, with no MILP pass after it)."""
    found = _fitted(model, budgets, solve)
    assert found.plan is not None
    return found.plan


@gc_paused()
def _fitted(model: MemoryModel, budgets: Budgets, solve: Callable[[Sequence[int]], Plan]) -> _Fit:
    """Plan so that each device's simulated total fits its budget less its reserve; record the breakdown.

    ``solve`` partitions under per-device caps (bytes, in device order) and makes the plan. The caps start at
    ``budgets.caps()``. When a device's row comes out over its budget less its reserve
    (:func:`fxsplit.planning.rules.budget_overruns`) by an excess, its cap becomes what the partitioner charged it
    for that plan less the excess (or the cap less the excess, if lower), so the next plan moves at least that much
    off it, and the model is planned again. When no plan so made fits, the same again from caps scaled by each of
    :data:`SMALLER_CAPS` in turn (every plan is still checked against the budgets themselves), until the partitioner
    cannot fit the scaled caps at all; the first refusal is raised when none fits.

    The partitioner's charge for activations is an upper bound (:func:`~fxsplit.memory.planloads.charge_slack`):
    when it refuses the caps, they are loosened by that slack. When it did not, and the plan minimises the bytes
    copied, the loosened caps are tried too and the plan that copies fewer bytes wins (ties: the first): a budget
    so small that only the loosened caps placed the model would otherwise get a better plan than a larger one.
    On graphs of up to :data:`CHEAPER_OPS` ops, the plans from caps scaled by each of :data:`CHEAPER_CAPS` compete
    the same way, until the partitioner places nothing under the scaled caps.

    Raises:
        BudgetError: nothing fits; says which component does not, where, by how much.
    """
    caps = budgets.caps()
    slack = charge_slack(model.planned_profile) * max(1, model.chunks) if model.profile else 0
    found = _fit_from(model, budgets, solve, caps, slack)
    if found.plan is not None:
        if not slack or found.loosened or found.plan.objective != "min_transfer":
            return found
        best = found
        looser = _fit_from(model, budgets, solve, [cap + slack for cap in caps], 0)
        if looser.plan is not None and looser.plan.copied_bytes < _bytes(best):
            best = looser
        for scale in CHEAPER_CAPS if len(model.costs.ops) <= CHEAPER_OPS else ():
            if not _bytes(best):
                break
            smaller = _fit_from(model, budgets, solve, [int(cap * scale) for cap in caps], slack)
            if smaller.plan is None and not smaller.partitioned:  # nothing placed under these caps: nor smaller
                break
            if smaller.plan is not None and smaller.plan.copied_bytes < _bytes(best):
                best = smaller
        return best
    assert found.refusal is not None
    for scale in SMALLER_CAPS if found.partitioned else ():
        again = _fit_from(model, budgets, solve, [int(cap * scale) for cap in caps], slack)
        if again.plan is not None:
            return again
        if not again.partitioned:  # the partitioner fits nothing under these caps: nor under smaller ones
            break
    raise found.refusal


@dataclass(frozen=True)
class _Fit:
    """What one run of the fit loop from some caps made: the plan, or the refusal and whether the partitioner
    placed the model at all (False: it refused the first caps); ``loosened``: the caps were loosened by the slack."""

    plan: Plan | None
    refusal: BudgetError | None = None
    partitioned: bool = True
    loosened: bool = False
    caps: tuple[int, ...] = ()  # with a plan: the caps it was made under


def _bytes(fit: _Fit) -> int:
    assert fit.plan is not None
    return fit.plan.copied_bytes


def _rows(model: MemoryModel, budgets: Budgets, plan: Plan) -> tuple[Plan, dict[str, int]]:
    """``plan`` with its memory rows, and each device whose row is over its budget less its reserve -> the excess."""
    usage = model.usage(plan)
    plan = dataclasses.replace(plan, memory=usage)
    simulated = {d: row.get("params", 0) + row.get("buffers", 0) for d, row in usage.items()}
    return plan, {o.device: o.excess for o in budget_overruns(plan, simulated, budgets)}


def _fit_from(
    model: MemoryModel, budgets: Budgets, solve: Callable[[Sequence[int]], Plan], caps: list[int], slack: int
) -> _Fit:
    """The plan :func:`fit_budgets` makes starting from ``caps``, loosening them by ``slack`` when the partitioner
    refuses them, or why none fits."""
    usable = budgets.usable
    usage: dict[str, dict[str, int]] = {}
    refused: BudgetError | None = None  # the first refusal, when planning again with the charge's slack allowed
    attempt = 0
    while attempt < MAX_REPLANS + len(caps) + 1:
        try:
            plan = solve(list(caps))
        except BudgetError as error:
            if refused is not None:
                return _Fit(None, refused, partitioned=attempt > 0, loosened=True)
            if attempt == 0 and slack:  # the charge is an upper bound: allow its slack, the exact check holds budgets
                refused = model.explain(error, usable)
                caps = [cap + slack for cap in caps]
                continue
            if attempt == 0:
                return _Fit(None, model.explain(error, usable), partitioned=False)
            return _Fit(None, model.over_budget(usage, usable))
        attempt += 1
        plan, over = _rows(model, budgets, plan)
        usage = plan.memory
        if not over:
            return _Fit(plan, loosened=refused is not None, caps=tuple(caps))
        loads = model.charged_loads(plan)
        caps = [
            max(0, min(cap, loads.get(d, cap)) - over[d]) if d in over else cap
            for d, cap in zip(budgets.devices, caps, strict=True)
        ]
    return _Fit(None, model.over_budget(usage, usable), loosened=refused is not None)
