"""Assign every op of a :class:`PartitionProblem` to a device, under budgets: :func:`partition`.

Pure functions over plain data (no torch). :func:`partition` checks its
arguments, then runs a list of *strategies* (:mod:`fxsplit.partition.strategies`)
in order, each offered the cheapest placement found so far, and keeps what
copies fewest bytes per forward. Every device's resident bytes stay within its
budget, pins and together-constraints hold.

By default (:data:`~fxsplit.partition.strategies.DEFAULT_STRATEGIES`) the
placement need not be contiguous: the exact contiguous programme
(:mod:`fxsplit.partition.contiguous`) and wrapped placements, where device 0
also runs the last ops so that skip connections and tied embeddings stay home
(:mod:`fxsplit.partition.ring`), compete over several orders of the devices,
each improved by single-op moves (:mod:`fxsplit.partition.refine`); when
nothing in order fits, ops are packed out of order instead; then pairs of
devices exchange groups of ops along minimum cuts (:mod:`fxsplit.partition.mincut`),
whole module runs are placed in any order by an exact search over the graph
coarsened to them (:mod:`fxsplit.partition.coarse`), and small graphs are
searched exactly (:mod:`fxsplit.partition.exact`). With
``contiguous=True`` only the contiguous programme runs: devices, in the order
given, take consecutive runs of ops, as a pipeline of stages needs.

The objective is the bytes copied between devices per forward. The contiguous
programmes break ties by the more even load; ``objective="balanced"`` first
lowers every budget to the smallest largest budget fraction a contiguous
placement reaches (:class:`~fxsplit.partition.strategies.Search`), so the load
comes first. Between strategies, ties keep the earlier answer (so the budgets'
own order and contiguous placements win them). When nothing fits, the error
says why (:mod:`fxsplit.partition.infeasible`).

>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> chain = PartitionProblem(
...     op_names=("a", "b", "c"),
...     values=(Value("w_a", 0, 0, (0,), weight=60), Value("w_b", 0, 1, (1,), weight=60),
...             Value("w_c", 0, 2, (2,), weight=60), Value("a", 8, 0, (1,)), Value("b", 4, 1, (2,))))
>>> partition(chain, [130, 130]).op_devices
(0, 0, 1)
"""

from __future__ import annotations

import itertools
from typing import Sequence

from fxsplit.errors import BudgetError, SpecError
from fxsplit.gcpause import gc_paused
from fxsplit.options import OBJECTIVES
from fxsplit.partition.colocate import colocate
from fxsplit.partition.contiguous import EXACT_LIMIT, devices_of
from fxsplit.partition.infeasible import ANY_ORDER, IN_ORDER, raise_infeasible
from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.refine import device_loads
from fxsplit.partition.result import Partition, placement_problems, transfer_bytes
from fxsplit.partition.strategies import CONTIGUOUS_STRATEGIES, DEFAULT_STRATEGIES, Search, Strategy
from fxsplit.partition.throughput import TIME_OBJECTIVES, Timing, fastest_boundaries, stage_times, time_of

__all__ = ["EXACT_LIMIT", "OBJECTIVES", "Partition", "partition", "transfer_bytes"]


@gc_paused()
def partition(
    problem: PartitionProblem,
    budgets: Sequence[int],
    *,
    objective: str = "min_transfer",
    device_names: Sequence[str] | None = None,
    contiguous: bool = False,
    strategies: Sequence[Strategy] | None = None,
    timing: Timing | None = None,
) -> Partition:
    """Place every op on a device so that each device's resident bytes fit its budget.

    Args:
        problem: ops, values and constraints.
        budgets: bytes each device may hold, in stage order.
        objective: ``"min_transfer"`` (fewest bytes between devices, then
            balance) or ``"balanced"`` (smallest largest budget fraction, then
            fewest bytes between devices).
        device_names: names for error messages (default ``device 0``, ...).
        contiguous: keep the placement contiguous (devices take consecutive
            runs of ops, in order), as a pipeline of stages needs. When False
            (the default), ops may run out of order wherever that lowers the
            bytes copied.
        strategies: the strategies to run, in order (see :mod:`fxsplit.partition.strategies`);
            None: :data:`~fxsplit.partition.strategies.DEFAULT_STRATEGIES`, or
            :data:`~fxsplit.partition.strategies.CONTIGUOUS_STRATEGIES` with ``contiguous=True``.
        timing: seconds per op on each device and the links between them, for the time objectives
            ``"throughput"`` (contiguous stages, the slowest one fastest) and ``"latency"`` (the shortest
            forward: the fastest contiguous placement, or the out-of-order one that copies fewest bytes
            when that is faster); see :mod:`fxsplit.partition.throughput`.

    Raises:
        BudgetError: no strategy found a placement that fits; the message says what and by how much.
        SpecError: pins contradict the device order, the objective is unknown, a budget is negative,
            ``strategies`` is empty or holds something other than a callable, or a strategy returned a
            placement that breaks a budget, a pin or a together-constraint (or, with
            ``contiguous=True``, is not contiguous); a time objective without ``timing``.
    """
    if objective not in OBJECTIVES:
        raise SpecError(f"objective must be one of {', '.join(OBJECTIVES)} (got {objective!r})")
    if not budgets:
        raise SpecError("budgets must name at least one device")
    names = list(device_names) if device_names else [f"device {k}" for k in range(len(budgets))]
    negative = [f"{name}: {budget}" for name, budget in zip(names, budgets, strict=True) if budget < 0]
    if negative:
        raise SpecError(f"budgets must not be negative ({', '.join(negative)}); is a reserve larger than a budget?")
    contiguous = contiguous or bool(problem.held)  # held weights are pipeline stages' own copies: stages in order
    chosen = _strategy_list(strategies, contiguous)
    _check_pin_order(problem, names)
    if problem.num_ops == 0:
        return Partition((), 0, (0,) * len(budgets))
    if objective in TIME_OBJECTIVES:
        return _fastest(problem, budgets, objective, timing, names, contiguous)
    if contiguous:
        problem = problem.glued()  # a colocated group in a contiguous placement: no cut inside its span
    search = Search(problem, budgets, objective)
    best: tuple[int, ...] | None = None
    cost = 0
    for strategy in chosen:
        found = strategy(search, best)
        if found is not None and problem.colocated:
            found = colocate(problem, found, search.budgets)
        if found is None:
            continue
        placed = _checked(search, strategy, found, contiguous)
        placed_cost = transfer_bytes(problem, placed)
        if best is None or placed_cost < cost:
            best, cost = placed, placed_cost
    if best is None and problem.colocated:  # no group could join its ops anywhere: hold each as a span
        return partition(
            problem.glued(),
            budgets,
            objective=objective,
            device_names=device_names,
            contiguous=contiguous,
            strategies=strategies,
        )
    if best is None:
        raise_infeasible(search.context, names, _how(chosen, contiguous))
    return Partition(best, cost, tuple(device_loads(problem, best, len(budgets))))


def _fastest(
    problem: PartitionProblem,
    budgets: Sequence[int],
    objective: str,
    timing: Timing | None,
    names: list[str],
    contiguous: bool,
) -> Partition:
    """The time objectives: the fastest contiguous placement; for ``"latency"`` out of order, also the
    placement that copies fewest bytes, when it is faster."""
    if timing is None or timing.op_seconds.shape != (len(budgets), problem.num_ops):
        raise SpecError(
            f"objective {objective!r} needs the seconds of each of the {problem.num_ops} ops on each of "
            f"the {len(budgets)} devices (timing=...)"
        )
    glued = problem.glued()
    search = Search(glued, budgets)
    found: list[tuple[int, ...]] = []
    if not search.contiguous_unfit:
        boundaries = fastest_boundaries(search.context, timing, objective)
        if boundaries is not None:
            found.append(_checked(search, fastest_boundaries, devices_of(glued.num_ops, boundaries), True))
    if objective == "latency" and not contiguous:
        try:
            found.append(partition(problem, budgets, device_names=names).op_devices)
        except BudgetError:
            pass
    if not found:
        raise_infeasible(search.context, names, IN_ORDER if objective == "throughput" or contiguous else ANY_ORDER)
    best = min(found, key=lambda p: time_of(stage_times(problem, p, timing), objective))
    return Partition(best, transfer_bytes(problem, best), tuple(device_loads(problem, best, len(budgets))))


def _strategy_list(strategies: Sequence[Strategy] | None, contiguous: bool) -> tuple[Strategy, ...]:
    if strategies is None:
        return CONTIGUOUS_STRATEGIES if contiguous else DEFAULT_STRATEGIES
    example = "like fxsplit.partition.DEFAULT_STRATEGIES or [contiguous, local_moves]"
    if isinstance(strategies, (str, bytes)) or callable(strategies) or not hasattr(strategies, "__iter__"):
        raise SpecError(f"strategies must be a list of strategies, {example} (got {strategies!r})")
    chosen = tuple(strategies)
    if not chosen:
        raise SpecError(f"strategies must list at least one strategy, {example} (got an empty list)")
    for index, strategy in enumerate(chosen):
        if not callable(strategy):
            raise SpecError(
                f"strategies[{index}] must be a callable strategy(search, best) (got {strategy!r}); "
                "see fxsplit.partition.strategies"
            )
    return chosen


def _checked(search: Search, strategy: object, found: Sequence[int], contiguous: bool) -> tuple[int, ...]:
    """``found`` as a tuple, after checking it: one device index per op, every budget, pin and together-group held."""
    problems = placement_problems(search.problem, found, search.budgets)
    if not problems and contiguous and any(a > b for a, b in itertools.pairwise(found)):
        problems = ["it is not contiguous (devices must take consecutive runs of ops, in order), but contiguous=True"]
    if problems:
        raise SpecError(
            f"strategy {_name(strategy)} returned a placement that breaks the rules: {'; '.join(problems[:5])}; "
            "a strategy must return one device index per op within the budgets in use, pins and "
            "together-constraints, or None"
        )
    return tuple(int(d) for d in found)


def _how(chosen: tuple[Strategy, ...], contiguous: bool) -> str:
    """How placements were sought, for the message when none fits."""
    if chosen == (CONTIGUOUS_STRATEGIES if contiguous else DEFAULT_STRATEGIES):
        return IN_ORDER if contiguous else ANY_ORDER
    return f"without exceeding a budget by the strategies given ({', '.join(_name(s) for s in chosen)})"


def _name(strategy: object) -> str:
    return repr(getattr(strategy, "__name__", None) or strategy)


def _check_pin_order(problem: PartitionProblem, names: Sequence[str]) -> None:
    """Pins must name devices among the budgets and, in op order, never go back to an earlier stage."""
    previous: tuple[int, int] | None = None
    for op in sorted(problem.pinned):
        device = problem.pinned[op]
        if not 0 <= device < len(names):
            raise SpecError(
                f"op {problem.label(op)} is pinned to device index {device}, which is not among the budgets"
            )
        if previous is not None and device < previous[1]:
            raise SpecError(
                f"pins contradict the device order: {problem.label(previous[0])} is pinned to "
                f"'{names[previous[1]]}' but the later {problem.label(op)} to the earlier stage "
                f"'{names[device]}'; devices run in the order the budgets list them, so reorder "
                "the budgets or change a pin"
            )
        previous = (op, device)
