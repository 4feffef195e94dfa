"""Planned vs measured stage times, and stage balance, for pipelines planned by time (issue 13).

For ResNet-50 and GPT-2 small (:mod:`benchmarks.throughput_models`) over 2 and 4 logical CPU
devices, a pipeline of ``CHUNKS`` micro-batches is planned with the throughput objective (the
default with ``pipeline=``; ``PipelineConfig(processes=True)``, the stages ``pipeline_stages`` runs, one
per process, each holding the weights it reads) twice: from the cost model's estimate (default hardware) and with
``profile=True`` (each op timed on the CPU, one thread). The profiled plan's stages
(:func:`fxsplit.pipeline_stages`) then run one micro-batch after another, forward, one thread,
each stage timed alone (median of ``REPEATS`` runs), and their times are compared with the plan's:

* **estimate error**: planned / measured time per stage, bar within ±25% after ``profile=True``;
* **bottleneck**: the stage the plan names slowest is the slowest measured (or within 5% of it);
* **balance**: slowest / mean stage time, bar <= 1.10, planned and measured.

The analytic estimate (no profiling) is reported beside it: its absolute times come from round
default device speeds, so only its ranking and balance are meant to hold.

Run: ``python -m benchmarks.stage_times [--quick] [--out DIR]``; exits 1 when a bar fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import fxsplit
from benchmarks.measure import run_alone
from benchmarks.throughput_models import MODELS, ModelSpec
from fxsplit.pipeline.microbatch import first_microbatch
from fxsplit.planning.timetable import stage_totals

__all__ = ["CHUNKS", "REPEATS", "main", "measure_model"]

CHUNKS = 4
REPEATS = 9
STAGES = (2, 4)
ERROR_BAR = 0.25
BALANCE_BAR = 1.10
ROOT = Path(__file__).resolve().parent


def _budgets(model: torch.nn.Module, stages: int) -> dict[str, int]:
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return {f"cpu:{k}": int(1.2 * total) + 2**28 for k in range(stages)}


def _stage_seconds(stages: Any, inputs: tuple[torch.Tensor, ...]) -> list[float]:
    """Median forward seconds of each stage, one micro-batch fed through them in order.

    Each stage runs on its own copy of its weights, moved to its device first, as each rank of a
    ``torchrun`` launch holds its own (``build_stage``); else a weight two stages read (GPT-2's tied
    embedding and head) would be copied between logical devices on every call.
    """
    modules = [copy.deepcopy(m).to(torch.device(s.device)) for m, s in zip(stages.modules, stages.specs, strict=True)]
    runs: list[list[float]] = []
    with torch.no_grad():
        for repeat in range(REPEATS + 1):
            value: Any = inputs
            times = []
            for module in modules:
                start = time.perf_counter()
                value = module(*value) if isinstance(value, tuple) else module(value)
                times.append(time.perf_counter() - start)
            if repeat:  # the first run warms up
                runs.append(times)
    return [statistics.median(column) for column in zip(*runs, strict=True)]


def _balance(times: list[float]) -> float:
    return max(times) / (sum(times) / len(times))


def measure_model(spec: ModelSpec, stages: int) -> dict[str, Any]:
    """One model over ``stages`` devices: planned (estimated, profiled) and measured stage times."""
    model = spec.build().eval()
    batch, _ = spec.inputs(0)
    budgets = _budgets(model, stages)
    options = {"trace": spec.trace, "pipeline": fxsplit.PipelineConfig(CHUNKS, processes=True)}  # as pipeline_stages
    estimated = fxsplit.plan(model, budgets, example_inputs=(batch,), **options)
    profiled = fxsplit.plan(model, budgets, example_inputs=(batch,), profile=True, **options)
    micro, _ = first_microbatch((batch,), None, CHUNKS)
    split = fxsplit.pipeline_stages(model, profiled, example_inputs=(batch,), chunks=CHUNKS, trace=spec.trace)
    measured = _stage_seconds(split, tuple(micro))
    busy = [d for d in profiled.devices if d in stage_totals(profiled.timing)]
    planned = [stage_totals(profiled.timing)[d] for d in busy]
    errors = [p / m - 1 for p, m in zip(planned, measured, strict=True)]
    slowest_planned = max(range(len(planned)), key=planned.__getitem__)
    return {
        "model": spec.name,
        "describe": spec.describe,
        "stages": stages,
        "estimated_modules": {d: list(m) for d, m in estimated.modules.items()},
        "profiled_modules": {d: list(m) for d, m in profiled.modules.items()},
        "estimated_seconds": list(stage_totals(estimated.timing).values()),
        "planned_seconds": planned,
        "measured_seconds": measured,
        "errors": errors,
        "bottleneck_planned": slowest_planned,
        "bottleneck_ok": measured[slowest_planned] >= 0.95 * max(measured),
        "balance_estimated": _balance(list(stage_totals(estimated.timing).values())),
        "balance_planned": _balance(planned),
        "balance_measured": _balance(measured),
    }


def _bars(row: dict[str, Any]) -> dict[str, bool]:
    return {
        "error": all(abs(e) <= ERROR_BAR for e in row["errors"]),
        "bottleneck": row["bottleneck_ok"],
        "balance": max(row["balance_planned"], row["balance_measured"]) <= BALANCE_BAR,
    }


def _ms(values: list[float]) -> str:
    return " / ".join(f"{1e3 * v:.1f}" for v in values)


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The results as Markdown."""
    lines = [
        "# Planned vs measured stage times (`benchmarks/stage_times.py`)",
        "",
        f"`{meta['command']}`: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, torch "
        f"{meta['machine']['torch']}, 1 thread; commit {meta['machine']['fxsplit_commit'][:12]}; load average "
        f"{' -> '.join(f'{x:.1f}' for x in meta['load_samples'])}; {meta['duration_s']:.0f} s. "
        f"Each pipeline of {CHUNKS} micro-batches "
        "is planned with the throughput objective from the cost model's estimate and with `profile=True`; the "
        "profiled plan's stages (`fxsplit.pipeline_stages`) then run one micro-batch forward, one thread, each "
        f"stage timed alone (median of {REPEATS}). Bars: planned within ±{ERROR_BAR:.0%} of measured per stage, "
        f"the planned bottleneck measured slowest (within 5%), slowest / mean stage <= {BALANCE_BAR}.",
        "",
        "| model | stages | planned ms (profile) | measured ms | error per stage | bottleneck | balance planned "
        "/ measured | estimate-only ms (balance) | bars |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        bars = _bars(row)
        verdict = "PASS" if all(bars.values()) else "FAIL: " + ", ".join(k for k, ok in bars.items() if not ok)
        errors = " / ".join(f"{100 * e:+.0f}%" for e in row["errors"])
        lines.append(
            f"| {row['model']} | {row['stages']} | {_ms(row['planned_seconds'])} | {_ms(row['measured_seconds'])} | "
            f"{errors} | stage {row['bottleneck_planned']} {'ok' if row['bottleneck_ok'] else 'wrong'} | "
            f"{row['balance_planned']:.2f} / {row['balance_measured']:.2f} | "
            f"{_ms(row['estimated_seconds'])} ({row['balance_estimated']:.2f}) | {verdict} |"
        )
    lines += ["", "Models: " + "; ".join(sorted({r["describe"] for r in rows})) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny models (a smoke run)")
    parser.add_argument("--out", type=Path, default=ROOT, help="where STAGE_RESULTS.md and its json go")
    args = parser.parse_args(argv)
    chosen = [m for m in MODELS if m.tiny == args.quick]

    def measure() -> list[dict[str, Any]]:
        return [measure_model(spec, stages) for spec in chosen for stages in STAGES]

    command = "python -m benchmarks.stage_times" + (" --quick" if args.quick else "")
    rows, meta = run_alone(command, 1, args.quick, measure)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stage_results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (args.out / "STAGE_RESULTS.md").write_text(report(rows, meta))
    print(report(rows, meta))
    return 0 if all(all(_bars(r).values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
