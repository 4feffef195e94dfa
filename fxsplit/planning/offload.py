"""Plans for models the devices cannot hold: keep what fits resident, store the rest, stream it in.

Used only when planning within the budgets failed and an
:class:`~fxsplit.options.Offload` says where weights may be stored. The ops
are partitioned as if the devices were larger, in proportion to their
budgets, so that every device runs its share (a few such partitions, with
more or less headroom, and the one that streams the fewest bytes, then
copies the fewest between devices, wins); then each device keeps as many
of its weights resident as fit beside its buffers, activations and streaming
buffers (:func:`~fxsplit.partition.streaming.choose_streamed`), and the rest
is stored in host memory, then on disk, within their budgets. The plan
records where each streamed weight is stored (:attr:`Plan.streamed`) and one
``"stream"`` cut per op that reads one; the memory rows gain a
``streaming`` column (the copies in flight).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Sequence

import torch.fx

from fxsplit.callsite import user_stacklevel
from fxsplit.cost.build import GraphCosts, Weight
from fxsplit.errors import BudgetError, FxsplitWarning
from fxsplit.memory.fit import fit_budgets
from fxsplit.memory.model import MemoryModel, row_total
from fxsplit.options import Budgets, Offload
from fxsplit.partition.milp import without_milp
from fxsplit.partition.streaming import StreamChoice, choose_streamed
from fxsplit.planning.build import cuts_for, reads_of, weights_by_node
from fxsplit.planning.plan import Plan
from fxsplit.units import format_size

__all__ = ["fit_or_offload", "plan_offloaded", "training_refusal"]

SPREADS = (1.02, 1.1, 1.3, 2.0)
"""How much larger than needed the virtual budgets are (times the model over the budgets), in the order tried:
each partition gives each device another share of the ops; the plan that streams the fewest bytes wins."""


def fit_or_offload(
    memory: MemoryModel,
    budgets: Budgets,
    solve: Callable[[Sequence[int]], Plan],
    offload: Offload | None,
    graph_module: torch.fx.GraphModule,
) -> Plan:
    """The plan within the budgets (:func:`~fxsplit.memory.fit.fit_budgets`); when nothing fits and
    ``offload`` is given, one that streams weights (:func:`plan_offloaded`).

    Raises:
        BudgetError: nothing fits, even streaming; or it does not fit and the plan is for training.
    """
    try:
        return fit_budgets(memory, budgets, solve)
    except BudgetError as error:
        if offload is None:
            raise
        if memory.spec.training:
            raise training_refusal(error) from None
        with without_milp():  # a partition for each spread tried: the heuristics alone (fxsplit.memory.fit says why)
            return plan_offloaded(memory, budgets, offload, solve, graph_module, error)


def training_refusal(error: BudgetError) -> BudgetError:
    """The error when the model does not fit and the plan is for training: streaming is for inference."""
    return BudgetError(
        f"{error}; offload cannot help here: weights stored off the devices are streamed in for inference only, "
        "and training with offloaded weights (mode='training') is not supported; plan with mode='inference' "
        "(or 'weights'), raise the budgets or add devices"
    )


def plan_offloaded(
    memory: MemoryModel,
    budgets: Budgets,
    offload: Offload,
    solve: Callable[[Sequence[int]], Plan],
    graph_module: torch.fx.GraphModule,
    error: BudgetError,
) -> Plan:
    """A plan that streams what the devices cannot hold from ``offload``'s storage.

    Args:
        memory: what the devices are charged.
        budgets: the devices' budgets.
        offload: where weights may be stored.
        solve: partitions the ops under per-device caps and makes the plan.
        graph_module: the traced graph (which op reads which weight).
        error: why the plan without offload failed (said again if this fails too).

    When no plan fits with ``offload.prefetch``, a lower prefetch is tried
    (down to 0, copying each weight right before its op), with a warning.

    Raises:
        BudgetError: even streaming does not fit: a device cannot hold the
            weights of one of its ops with the streaming buffers, or the
            storage budgets cannot hold what is streamed.
    """
    offload = offload.resolved(budgets.devices)
    depth = offload.prefetch or 0
    asked: list[tuple[int, str]] = []  # (bytes short, why) of each plan that failed, with the asked prefetch
    problems = asked
    for prefetch in range(depth, -1, -1):
        problems = asked if prefetch == depth else []
        found = _spreads(
            memory, budgets, dataclasses.replace(offload, prefetch=prefetch), solve, graph_module, problems
        )
        if found is not None:
            if prefetch < depth:
                why = min(asked)[1] if asked else "no partition fits"
                warnings.warn(
                    FxsplitWarning(f"offload: prefetch lowered from {depth} to {prefetch}: with it, {why}"),
                    stacklevel=user_stacklevel(),
                )
            return found
    detail = min(problems)[1] if problems else "no partition of the ops fits even with larger devices"
    raise BudgetError(f"{error}; streaming weights from {_storage_words(offload)} does not help either: {detail}")


def _spreads(
    memory: MemoryModel,
    budgets: Budgets,
    offload: Offload,
    solve: Callable[[Sequence[int]], Plan],
    graph_module: torch.fx.GraphModule,
    problems: list[tuple[int, str]],
) -> Plan | None:
    """The best plan that streams, over partitions with more or less headroom, or None."""
    found: list[Plan] = []
    for virtual in _virtual_caps(budgets.caps(), row_total(memory.totals(budgets.devices))):
        try:
            spread = solve(virtual)
        except BudgetError:
            continue
        made = _stream(spread, memory, budgets, offload, graph_module, problems)
        if made is not None:
            found.append(made)
    return min(found, key=lambda plan: (plan.stream_bytes, plan.copied_bytes)) if found else None


def _virtual_caps(caps: list[int], needed: int) -> list[list[int]]:
    """Per-device caps to partition under, as if the devices held the model: the candidates tried.

    Every device larger in proportion to its budget (several amounts of
    headroom: each gives each device another share of the ops and of the
    streaming); and, for each device, that one device large enough to run
    every op whose weights do not fit while the others keep their budgets
    (they then hold resident what they run, and one device streams, as
    Accelerate's offload does). Where the budgets add up to the model but
    the ops do not pack into them (one op, or ops that must share a
    device, larger than any budget), that device is taken twice as large.

    >>> _virtual_caps([100, 100], 300)[-2:]  # 100 B short: one device 106 B larger
    [[206, 100], [100, 206]]
    >>> _virtual_caps([100, 100], 150)[-2:]  # room enough, packing failed: never smaller than the budgets
    [[201, 100], [100, 201]]
    """
    base = max(1.0, needed / max(1, sum(caps)))
    found = [[int(cap * base * factor) + 1 for cap in caps] for factor in SPREADS]
    short = needed - sum(caps)
    for device in range(len(caps) if len(caps) > 1 else 0):
        extra = int(short * 1.05) + 1 if short > 0 else caps[device] + 1
        found.append([cap + (extra if k == device else 0) for k, cap in enumerate(caps)])
    return found


def _storage_words(offload: Offload) -> str:
    return " and ".join(f"{tier} {format_size(n)}" for tier, n in offload.tiers().items())


def _stream(
    spread: Plan,
    memory: MemoryModel,
    budgets: Budgets,
    offload: Offload,
    graph_module: torch.fx.GraphModule,
    problems: list[tuple[int, str]],
) -> Plan | None:
    """``spread`` with each device's overflow streamed, or None (with ``(bytes short, why)`` in ``problems``)."""
    costs = memory.costs
    usage = memory.usage(spread)
    readers = _readers(costs, graph_module, spread)
    order = {node.name: i for i, node in enumerate(graph_module.graph.nodes)}
    usable = budgets.usable
    choices: dict[str, StreamChoice] = {}
    weights_by_name = {w.names[0]: w for w in [*costs.weights, *costs.unused]}
    for device in spread.devices:
        movable = {
            name: w.nbytes
            for name, w in weights_by_name.items()
            if spread.param_devices[name] == device and _streamable(w, readers.get(name, {}), device)
        }
        row = usage.get(device, {})
        fixed = row.get("total", 0) - sum(movable.values())
        op_reads = [[w for w in reads if w in movable] for reads in _op_reads(readers, order, device)]
        choice = choose_streamed(movable, op_reads, usable[device] - fixed, offload.prefetch or 0)
        if choice is None:
            problems.append(_no_fit(device, usable[device], fixed, movable, op_reads, offload.prefetch or 0))
            return None
        choices[device] = choice
    tiers = _store(
        {name: weights_by_name[name].nbytes for c in choices.values() for name in c.streamed}, offload, problems
    )
    if tiers is None:
        return None
    return _record(spread, memory, graph_module, usage, choices, tiers, weights_by_name, offload)


def _readers(costs: GraphCosts, graph_module: torch.fx.GraphModule, plan: Plan) -> dict[str, dict[str, str]]:
    """Canonical weight name -> {reading op node name: its device}, in graph order."""
    by_node = weights_by_node(costs)
    found: dict[str, dict[str, str]] = {}
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        for read in reads_of(node, by_node):
            if read.weight is not None:
                found.setdefault(read.key, {})[node.name] = plan.placement[node.name]
    return found


def _streamable(weight: Weight, readers: dict[str, str], device: str) -> bool:
    """Parameters (not buffers, which may be state) read only on their own device, or not read at all."""
    return not weight.is_buffer and all(d == device for d in readers.values())


def _op_reads(readers: dict[str, dict[str, str]], order: dict[str, int], device: str) -> list[list[str]]:
    """For each op on ``device`` that reads weights, in graph order, the canonical names it reads."""
    ops: dict[str, list[str]] = {}
    for name, by_op in readers.items():
        for op, where in by_op.items():
            if where == device:
                ops.setdefault(op, []).append(name)
    return [ops[op] for op in sorted(ops, key=order.__getitem__)]


def _no_fit(
    device: str, usable: int, fixed: int, movable: dict[str, int], op_reads: list[list[str]], prefetch: int
) -> tuple[int, str]:
    windows = [op_reads[max(0, i - prefetch) : i + 1] for i in range(len(op_reads))]
    largest = max((sum(movable[w] for reads in run for w in reads) for run in windows), default=0)
    need = fixed + largest
    ops = "one of its ops reads" if prefetch == 0 else f"{prefetch + 1} of its ops in a row read"
    return need - usable, (
        f"'{device}' holds {format_size(fixed)} that cannot be streamed (buffers, activations, weights read on "
        f"other devices) and {ops} {format_size(largest)} of weights, which streamed with prefetch {prefetch} "
        f"needs {format_size(need)} of its {format_size(usable)}; raise its budget by "
        f"{format_size(max(0, need - usable))} or more" + (", or lower prefetch" if prefetch else "")
    )


def _store(sizes: dict[str, int], offload: Offload, problems: list[tuple[int, str]]) -> dict[str, str] | None:
    """Streamed weight -> storage tier: host first, largest first, then disk; None if they do not fit."""
    left = offload.tiers()
    where: dict[str, str] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        tier = next((t for t, room in left.items() if sizes[name] <= room), None)
        if tier is None:
            total = sum(sizes.values())
            room = sum(offload.tiers().values())
            short = total - room if total > room else sizes[name]
            problems.append(
                (
                    short,
                    f"the weights to stream ({format_size(total)}) do not fit the offload storage "
                    f"({_storage_words(offload)}); raise the host or disk budget by "
                    f"{format_size(total - sum(offload.tiers().values()))} or more"
                    if total > sum(offload.tiers().values())
                    else f"the weights to stream ({format_size(total)}) do not pack into the offload storage "
                    f"({_storage_words(offload)}): '{name}' ({format_size(sizes[name])}) fits in none of what is left",
                )
            )
            return None
        where[name] = tier
        left[tier] -= sizes[name]
    return where


def _record(
    spread: Plan,
    memory: MemoryModel,
    graph_module: torch.fx.GraphModule,
    usage: dict[str, dict[str, int]],
    choices: dict[str, StreamChoice],
    tiers: dict[str, str],
    weights: dict[str, Weight],
    offload: Offload,
) -> Plan:
    """``spread`` with the streamed weights stored off the devices, their copies as cuts, the memory rows updated."""
    streamed = {name: tiers[w.names[0]] for w in weights.values() if w.names[0] in tiers for name in w.names}
    rows = {}
    device_bytes = dict(spread.device_bytes)
    for device, row in usage.items():
        choice = choices.get(device)
        gone = sum(weights[n].nbytes for n in choice.streamed) if choice is not None else 0
        updated = {**row, "params": row.get("params", 0) - gone, "streaming": choice.buffer_bytes if choice else 0}
        updated["total"] = row.get("total", 0) - gone + updated["streaming"]
        rows[device] = updated
        if device in device_bytes:
            device_bytes[device] -= gone
    homes = {name: spread.param_devices[name] for name in weights}
    cuts = cuts_for(memory.costs, graph_module, spread.placement, homes, tiers)
    stored = dict.fromkeys(offload.tiers(), 0)
    for name, tier in tiers.items():
        stored[tier] += weights[name].nbytes
    return dataclasses.replace(
        spread,
        device_bytes=device_bytes,
        memory=rows,
        cuts=tuple(cuts),
        streamed=dict(sorted(streamed.items())),
        offload=offload.to_dict(),
        stored_bytes=stored,
    )
