"""The lines of ``print(plan)`` below the device table: offload, state, replicas, memory."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from fxsplit.units import format_size

if TYPE_CHECKING:
    from fxsplit.planning.plan import Plan

__all__ = [
    "empty_devices_lines",
    "memory_table",
    "offload_lines",
    "replica_lines",
    "row_split_lines",
    "rows_held",
    "state_lines",
    "tied_lines",
]


def replica_lines(plan: Plan) -> list[str]:
    """One line per replicated tensor: its size and every device that holds it (no copy each forward)."""
    return [
        f"replicated: {name} ({format_size(replica.nbytes)}) on {', '.join(plan.holders(name))} "
        "(read-only: held on each, no copy per forward)"
        for name, replica in plan.replicas.items()
    ]


def row_split_lines(plan: Plan) -> list[str]:
    """One line per op whose rows are computed in pieces: each piece's rows and device."""
    lines = []
    for op, split in plan.row_splits.items():
        bounds = split.bounds
        pieces = ", ".join(
            f"{start}-{stop} on {plan.placement.get(f'{op}_rows{k}', '?')}"
            for k, (start, stop) in enumerate(itertools.pairwise(bounds))
        )
        lines.append(
            f"rows split: '{op}' ({bounds[-1]} output features) in {len(bounds) - 1} pieces, rows of "
            f"{split.weight} {pieces}; each stage holds its rows (run by pipeline_stages)"
        )
    return lines


def tied_lines(plan: Plan) -> list[str]:
    """One line per group of tied names: where the tensor lives and where it is copied (or held, or replicated)."""
    stage_copies = bool(plan.timing and plan.timing.get("stage_copies"))
    lines = []
    for group in plan.tied:
        home = plan.param_devices.get(group[0], "?")
        copies = [c for c in plan.cuts if c.kind == "parameter" and c.producer in group]
        replica = plan.replicas.get(group[0])
        if replica is not None:
            how = f"on {home}, replicated on {', '.join(replica.devices)} (no copy)"
        elif copies and stage_copies:
            where = ", ".join(c.destination for c in copies)
            how = f"on {home}, and held by the stages on {where} too (stages one per process: no copy)"
        elif copies:
            where = ", ".join(f"{c.destination} ({format_size(c.nbytes)})" for c in copies)
            how = f"on {home}, copied to {where} each forward"
        else:
            how = f"on {home}, kept together (no copy)"
        lines.append(f"tied: {' = '.join(group)}: {how}{rows_held(plan, group)}")
    return lines


def rows_held(plan: Plan, names: tuple[str, ...]) -> str:
    """``"; rows 0-2752 on cpu:2, ... held there too"`` for a tensor whose rows split ops' pieces hold."""
    held = [
        f"{start}-{stop} on {plan.placement.get(f'{op}_rows{k}', '?')}"
        for op, split in plan.row_splits.items()
        if split.weight in names
        for k, (start, stop) in enumerate(itertools.pairwise(split.bounds))
    ]
    return f"; rows {', '.join(held)} held there too (a split op's pieces)" if held else ""


def empty_devices_lines(plan: Plan) -> list[str]:
    """One line when devices were left empty because that copies fewer bytes, naming the option that spreads."""
    busy = set(plan.placement.values()) | set(plan.param_devices.values())
    empty = [d for d in plan.devices if d not in busy]
    if not empty or plan.objective not in ("min_transfer", "latency"):
        return []
    if plan.streamed:
        return [
            f"empty: {', '.join(empty)}, although weights are streamed: no partition fxsplit tried placed ops "
            "there; pin some modules to it (pins=...) to use it"
        ]
    return [
        f"empty: {', '.join(empty)}: the model fits on the other device(s), and leaving "
        f"{'it' if len(empty) == 1 else 'them'} empty copies the fewest bytes; objective='balanced' "
        "spreads the model over every device, objective='throughput' makes the fastest pipeline of them"
    ]


def state_lines(plan: Plan) -> list[str]:
    """Where the tensors the forward writes in place (a cache, running statistics) live, when there are any."""
    if not plan.mutated:
        return []
    where: dict[str, int] = {}
    for name, nbytes in plan.mutated.items():
        device = plan.param_devices.get(name, "?")
        where[device] = where.get(device, 0) + nbytes
    shares = ", ".join(f"{d} {format_size(n)}" for d, n in where.items())
    return [
        f"written in place: {len(plan.mutated)} tensor(s), {format_size(sum(plan.mutated.values()))} "
        f"(a cache or state, kept on its device between calls): {shares}"
    ]


def offload_lines(plan: Plan) -> list[str]:
    """What is stored off the devices and streamed in, when anything is."""
    if not plan.streamed:
        return []
    stored = ", ".join(
        f"{tier} {format_size(nbytes)}"
        + (f" of {format_size(plan.offload[tier])}" if plan.offload.get(tier) is not None else "")
        for tier, nbytes in plan.stored_bytes.items()
        if nbytes
    )
    where = f" (dir {plan.offload['dir']})" if plan.stored_bytes.get("disk") and plan.offload.get("dir") else ""
    return [
        f"offloaded: {len(plan.streamed)} parameter(s) stored in {stored}{where}; streamed per forward: "
        f"{format_size(plan.stream_bytes)} in {sum(1 for c in plan.cuts if c.kind == 'stream')} copies, "
        f"prefetch {plan.offload.get('prefetch', 1)}"
    ]


def memory_table(plan: Plan) -> list[str]:
    """One row per device: each component of memory, the total and its share of the budget."""
    keys = [
        k
        for k in (
            "params",
            "buffers",
            "grads",
            "optimizer",
            "stage_copies",
            "activations_peak",
            "optimizer_step",
            "streaming",
        )
        if any(k in row and (row[k] or k in ("params", "activations_peak")) for row in plan.memory.values())
    ]
    titles = {
        "params": "params",
        "buffers": "buffers",
        "grads": "grads",
        "optimizer": "optimizer",
        "stage_copies": "stage copies",
        "activations_peak": "activations",
        "optimizer_step": "at step",
        "streaming": "streaming",
    }
    reserving = any(plan.reserved.values())
    rows = [("memory", *(titles[k] for k in keys), "total", "% usable" if reserving else "% budget")]
    usable = plan.usable
    for device in plan.devices:
        row = plan.memory.get(device, {})
        room, total = usable.get(device, 0), row.get("total", 0)
        percent = f"{100 * total / room:.1f}" if room else "-"
        cells = (format_size(row[k]) if k in row else "-" for k in keys)
        rows.append((device, *cells, format_size(total), percent))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    if "optimizer_step" in keys:
        lines.append(
            "at step: optimizer.step()'s temporaries and the outputs still held; a total counts the larger of it and "
            "the activations"
        )
        if plan.memory_counts:
            lines.append(f"counted for {plan.memory_counts}")
    return lines
