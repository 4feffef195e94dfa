"""The time table ``print(plan)`` shows when a plan has time estimates (plain data, no torch).

One row per device: the seconds its ops take and the copies it receives, then the bottleneck and,
for a pipeline of ``chunks`` micro-batches (GPipe: every micro-batch through every stage), the
expected step time and the share of device time left idle (the bubble): with stage times ``t_k``
over ``S`` stages, ``step = sum(t) + (chunks - 1) * max(t)`` and
``bubble = 1 - chunks * sum(t) / (S * step)``, which is ``(S - 1) / (chunks + S - 1)`` for equal stages.

>>> record = {"source": "estimate", "chunks": 4, "training": False,
...           "stages": {"cpu:0": {"compute": 0.002, "copies": 0.0}, "cpu:1": {"compute": 0.0018, "copies": 0.0002}}}
>>> step_and_bubble(record)
(0.01, 0.2)
>>> print("\\n".join(time_lines(record)))
time   compute  copies in  stage    (estimated from FLOPs and bytes, per micro-batch forward)
cpu:0  2.00 ms  0 µs       2.00 ms
cpu:1  1.80 ms  200 µs     2.00 ms
bottleneck: cpu:0 at 2.00 ms (1.00x the mean stage); 4 micro-batches: step ≈ 10.00 ms, bubble 20%
"""

from __future__ import annotations

from typing import Any, Mapping

from fxsplit.hardware import format_seconds

__all__ = ["stage_totals", "step_and_bubble", "time_lines"]

_SOURCES = {"estimate": "estimated from FLOPs and bytes", "profile": "measured per op (profile=True)"}


def stage_totals(record: Mapping[str, Any]) -> dict[str, float]:
    """Device -> seconds of its stage (compute plus received copies), for devices that run anything."""
    totals = {d: row["compute"] + row["copies"] for d, row in record["stages"].items()}
    return {d: t for d, t in totals.items() if t > 0}


def step_and_bubble(record: Mapping[str, Any]) -> tuple[float, float]:
    """A pipeline step's seconds and idle share over ``record["chunks"]`` micro-batches (1 without a pipeline)."""
    totals = list(stage_totals(record).values())
    if not totals:
        return 0.0, 0.0
    chunks = record.get("chunks") or 1
    step = sum(totals) + (chunks - 1) * max(totals)
    busy = chunks * sum(totals) / (len(totals) * step)
    return step, round(1.0 - busy, 12)


def time_lines(record: Mapping[str, Any]) -> list[str]:
    """The rows and the summary line ``print(plan)`` shows."""
    chunks = record.get("chunks")
    per = "micro-batch" if chunks else "forward"
    unit = f"per {per} {'training step (forward + backward)' if record.get('training') else 'forward'}"
    unit = unit.replace("forward forward", "forward")
    rows = [("time", "compute", "copies in", "stage", f"({_SOURCES.get(record['source'], record['source'])}, {unit})")]
    for device, row in record["stages"].items():
        total = row["compute"] + row["copies"]
        rows.append((device, format_seconds(row["compute"]), format_seconds(row["copies"]), format_seconds(total), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    totals = stage_totals(record)
    if not totals:
        return lines
    slowest = max(totals, key=lambda d: totals[d])
    mean = sum(totals.values()) / len(totals)
    summary = (
        f"bottleneck: {slowest} at {format_seconds(totals[slowest])} ({totals[slowest] / mean:.2f}x the mean stage)"
    )
    step, bubble = step_and_bubble(record)
    if chunks:
        summary += f"; {chunks} micro-batches: step ≈ {format_seconds(step)}, bubble {100 * bubble:.0f}%"
    else:
        summary += f"; stages one after another: {format_seconds(step)}"
    return lines + [summary]
