"""The lines of ``print(plan)`` below the device table: offload, state, replicas, memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxsplit.units import format_size

if TYPE_CHECKING:
    from fxsplit.planning.plan import Plan

__all__ = ["memory_table", "offload_lines", "replica_lines", "state_lines"]


def replica_lines(plan: Plan) -> list[str]:
    """One line per replicated tensor: its size and every device that holds it (no copy each forward)."""
    return [
        f"replicated: {name} ({format_size(replica.nbytes)}) on {', '.join(plan.holders(name))} "
        "(read-only: held on each, no copy per forward)"
        for name, replica in plan.replicas.items()
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
