"""Why no placement fits: a :class:`~fxsplit.errors.BudgetError` that says what, where and by how much.

:func:`raise_infeasible` tries the reasons from the plainest down: the weights
exceed the budgets together; one indivisible piece (an op, or ops that
constraints keep together) exceeds every device it may run on; else the
pieces do not fit the gaps, and the message says by how much every budget
would have to grow for a contiguous placement to fit.

>>> from fxsplit.partition.context import Context
>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> one = PartitionProblem(("a",), (Value("w", 0, 0, (0,), weight=2048),))
>>> raise_infeasible(Context(one, [1024, 1024]), ["cuda:0", "cuda:1"], ANY_ORDER)
Traceback (most recent call last):
...
fxsplit.errors.BudgetError: 'a' needs 2.00 KiB (2048 bytes) for its parameters and buffers ('w' 2.00 KiB), \
more than the budget of every device (the largest, 'cuda:0', has 1.00 KiB): short by 1.00 KiB (1024 bytes); \
raise that budget
"""

from __future__ import annotations

import math
from typing import NoReturn, Sequence

from fxsplit.errors import BudgetError
from fxsplit.partition.context import Context
from fxsplit.partition.contiguous import min_scale, relay_boundaries
from fxsplit.partition.problem import PartitionProblem
from fxsplit.units import format_size

__all__ = ["ANY_ORDER", "IN_ORDER", "raise_infeasible"]

IN_ORDER = (
    "in order without exceeding a budget (contiguous=True: ops run on consecutive devices, and "
    "indivisible pieces do not fit the gaps)"
)
"""How the ops were placed, for the message, when the placement had to be contiguous."""

ANY_ORDER = "without exceeding a budget, in order or out of order (indivisible pieces do not fit the gaps)"
"""How the ops were placed, for the message, when any order was allowed (the default strategies)."""


def raise_infeasible(ctx: Context, names: Sequence[str], how: str) -> NoReturn:
    """Raise the :class:`~fxsplit.errors.BudgetError` that best explains why nothing fits ``ctx.budgets``.

    Args:
        ctx: the problem and its budgets.
        names: device names, in budget order.
        how: how placements were sought (:data:`IN_ORDER`, :data:`ANY_ORDER` or another phrase),
            for the message when the pieces do not fit the gaps.
    """
    problem = ctx.problem
    total, capacity = ctx.weight(0, ctx.n), sum(ctx.budgets)
    budget_list = ", ".join(f"'{d}' {format_size(b)}" for d, b in zip(names, ctx.budgets, strict=True))
    if total > capacity:
        what = (
            "parameters, buffers and the activations each op keeps"
            if any(problem.op_extra)
            else "parameters and buffers"
        )
        raise BudgetError(
            f"the model's {what} need {format_size(total)} ({total} bytes) but the "
            f"budgets add up to {format_size(capacity)} ({capacity} bytes): short by "
            f"{format_size(total - capacity)} ({total - capacity} bytes) [{budget_list}]; "
            "raise the budgets or add a device"
        )
    for lo, hi, weight in _indivisible_blocks(ctx):
        pins = {problem.pinned[op] for op in range(lo, hi + 1) if op in problem.pinned}
        allowed = sorted(pins) if pins else list(range(len(ctx.budgets)))
        best = max(allowed, key=lambda k: (ctx.budgets[k], -k))
        if weight > ctx.budgets[best]:
            what = (
                problem.label(lo)
                if lo == hi
                else (f"ops {problem.label(lo)} .. {problem.label(hi)} (they must share a device)")
            )
            where = f"pinned device '{names[best]}' (it" if pins else f"every device (the largest, '{names[best]}',"
            tail = ")"
            raise BudgetError(
                f"{what} needs {format_size(weight)} ({weight} bytes){_heaviest(problem, lo, hi, weight)}, "
                f"more than the budget of {where} has {format_size(ctx.budgets[best])}{tail}: short by "
                f"{format_size(weight - ctx.budgets[best])} ({weight - ctx.budgets[best]} bytes); "
                "raise that budget" + (" or unpin" if pins else "")
            )
    _raise_fragmented(ctx, names, total, capacity, how)


def _heaviest(problem: PartitionProblem, lo: int, hi: int, needed: int) -> str:
    """' for its parameters and buffers (a 4.00 KiB, b 128 B)': the largest weights homed at ops lo..hi.

    When the problem also charges per-op memory (``op_extra``, ``op_transient``),
    the bytes are split into the weights and that memory.
    """
    homed = sorted(((v.weight, v.name) for v in problem.values if v.weight and lo <= v.start <= hi), reverse=True)
    listed = ", ".join(f"'{name}' {format_size(size)}" for size, name in homed[:3])
    more = f" and {len(homed) - 3} more" if len(homed) > 3 else ""
    weights = sum(size for size, _ in homed)
    if needed > weights and (problem.op_extra or problem.op_transient):
        named = f" ({listed}{more})" if homed else ""
        return (
            f": weights {format_size(weights)}{named} and per-op memory (activations) {format_size(needed - weights)}"
        )
    if not homed:
        return ""
    return f" for its parameters and buffers ({listed}{more})"


def _raise_fragmented(ctx: Context, names: Sequence[str], total: int, capacity: int, how: str) -> NoReturn:
    problem = ctx.problem
    if relay_boundaries(ctx, ctx.budgets) is not None:  # only strategies of the caller's own miss it
        raise BudgetError(
            f"no placement of the {problem.num_ops} ops was found {how}, though a contiguous one fits "
            "the budgets; add fxsplit.partition.strategies.contiguous to the strategies, or use the default ones"
        )
    high, _ = min_scale(ctx, ctx.budgets)
    shortfalls = ", ".join(
        f"'{d}' short by {format_size(int(b * high) - b)}" for d, b in zip(names, ctx.budgets, strict=True)
    )
    raise BudgetError(
        f"the budgets hold {format_size(capacity)} and the model needs {format_size(total)}, but its "
        f"{problem.num_ops} ops cannot be packed into the devices {how}; it fits in order when "
        f"every budget is raised by {math.ceil(1000 * (high - 1)) / 10:.1f}% ({shortfalls}); raise the budgets, "
        "add a device, or remove pins and together-constraints"
    )


def _indivisible_blocks(ctx: Context) -> list[tuple[int, int, int]]:
    """Maximal runs of ops with no allowed cut between them, with their resident bytes."""
    blocks, start = [], 0
    for t in range(1, ctx.n + 1):
        if t == ctx.n or not ctx.forbidden[t]:
            blocks.append((start, t - 1, ctx.weight(start, t)))
            start = t
    return blocks
