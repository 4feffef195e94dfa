"""The time table ``print(plan)`` shows when a plan has time estimates (plain data, no torch).

One row per device: the seconds its ops take and the copies it receives, then the bottleneck and,
for a pipeline of ``chunks`` micro-batches (GPipe: every micro-batch through every stage), the
expected step time and the share of device time left idle (the bubble): with stage times ``t_k``
over ``S`` stages, ``step = sum(t) + (chunks - 1) * max(t)`` and
``bubble = 1 - chunks * sum(t) / (S * step)``, which is ``(S - 1) / (chunks + S - 1)`` for equal stages.

Stages that each hold their own copy of a weight (``fxsplit.pipeline_stages``) sum that copy's gradients
once per training step (the record's ``"allreduce"``: name -> holders, bytes, seconds; see
:mod:`fxsplit.planning.stagecopies`): its own line, and ``step`` adds those seconds to the schedule's,
so the bubble counts the all-reduce as time no stage computes.

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
from fxsplit.units import format_size

__all__ = ["TIME_RECORD_SHAPE", "allreduce_seconds", "is_time_record", "stage_totals", "step_and_bubble", "time_lines"]

_SOURCES = {"estimate": "estimated from FLOPs and bytes", "profile": "measured per op (profile=True)"}


TIME_RECORD_SHAPE = "{source, chunks, training, stages: {device: {compute, copies}}, stage_copies, allreduce}"
_REDUCED = ("devices", "nbytes", "seconds")  # an all-reduce per step: its holders, gradient bytes, seconds


def is_time_record(value: Any) -> bool:
    """Whether ``value`` is a record :func:`time_lines` reads (``Plan.timing``, as a plan file holds it); plans
    written before ``stage_copies`` and ``allreduce`` lack them."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    table = lambda v, check: isinstance(v, dict) and all(isinstance(k, str) and check(x) for k, x in v.items())  # noqa: E731
    keys = {"source", "chunks", "training", "stages"}
    return (
        isinstance(value, dict)
        and keys <= set(value) <= keys | {"stage_copies", "allreduce"}
        and isinstance(value["source"], str)
        and (value["chunks"] is None or (isinstance(value["chunks"], int) and not isinstance(value["chunks"], bool)))
        and isinstance(value["training"], bool)
        and table(value["stages"], lambda row: table(row, number))
        and isinstance(value.get("stage_copies", True), bool)
        and table(value.get("allreduce", {}), lambda e: isinstance(e, dict) and tuple(sorted(e)) == _REDUCED)
        and all(
            isinstance(e["devices"], list)
            and all(isinstance(d, str) for d in e["devices"])
            and isinstance(e["nbytes"], int)
            and number(e["seconds"])
            for e in value.get("allreduce", {}).values()
        )
    )


def stage_totals(record: Mapping[str, Any]) -> dict[str, float]:
    """Device -> seconds of its stage (compute plus received copies), for devices that run anything."""
    totals = {d: row["compute"] + row["copies"] for d, row in record["stages"].items()}
    return {d: t for d, t in totals.items() if t > 0}


def allreduce_seconds(record: Mapping[str, Any]) -> float:
    """Seconds per step of the all-reduces of the gradients of weights several stages hold (0 when none)."""
    return float(sum(entry["seconds"] for entry in record.get("allreduce", {}).values()))


def step_and_bubble(record: Mapping[str, Any]) -> tuple[float, float]:
    """A pipeline step's seconds and idle share over ``record["chunks"]`` micro-batches (1 without a pipeline),
    with the step's gradient all-reduces (:func:`allreduce_seconds`)."""
    totals = list(stage_totals(record).values())
    if not totals:
        return 0.0, 0.0
    chunks = record.get("chunks") or 1
    step = sum(totals) + (chunks - 1) * max(totals) + allreduce_seconds(record)
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
    reduced = record.get("allreduce", {})
    if reduced:
        each = ", ".join(f"{n} {format_size(e['nbytes'])} over {', '.join(e['devices'])}" for n, e in reduced.items())
        lines.append(f"tied gradients: all-reduce ≈ {format_seconds(allreduce_seconds(record))} per step ({each})")
    if chunks:
        with_reduce = " with the all-reduce" if reduced else ""
        summary += f"; {chunks} micro-batches: step ≈ {format_seconds(step)}{with_reduce}, bubble {100 * bubble:.0f}%"
    else:
        summary += f"; stages one after another: {format_seconds(step)}"
    return lines + [summary]
