"""Pipelined training throughput across processes: fxsplit's stages on two CPU cores that run in parallel.

For each model (:mod:`benchmarks.throughput_models`: ResNet-50 and GPT-2 small,
random weights), one ``torchrun --nproc-per-node 2`` launch (gloo, one torch
thread per rank; :mod:`benchmarks.throughput_worker`) times these, in rounds,
each round running every one in turn (so that load from other work on the
machine falls on all of them alike):

* ``single``: a training step (forward, backward, SGD) of the whole model on the
  whole batch in one process, one thread, the other rank idle;
* ``ceiling``: two independent copies of that step, one per process, at once:
  their summed steps/s over ``single``'s is what two processes get on this
  machine (1.4-1.9x on these 2-core machines, memory bandwidth being shared);
* the pipelines: ``fxsplit.pipeline_stages(model, budgets, example_inputs=(batch,),
  chunks=C, trace=..., mode="training", <variant>)`` under 1F1B
  (``torch.distributed.pipelining.Schedule1F1B``, C micro-batches: the same bubble as
  GPipe, fewer micro-batches' activations held at once), rank i
  running stage i, each variant's options being:
  ``default`` (no ``objective``: what a user gets, which with a pipeline is
  ``objective="throughput"``, stages balanced by estimated time), ``profiled``
  (the same with ``profile=True``: each op's forward and backward measured, on rank
  0, whose plan every rank applies), ``balanced``
  (``objective="balanced"``: even parameter bytes) and ``hand`` (``pins=``: the
  PyTorch model-parallel tutorial's ResNet-50 split, layers 1-2 | 3-4, and its
  half/half analogue for GPT-2's blocks). Each of the two
  budgets is ``budget_factor`` x what fxsplit plans the whole model to need on
  one device for training: each device could hold the whole model, so the plan,
  not memory, decides the split. A plan of one stage runs on rank 0 alone.

steps/s: all rounds' steps over their wall time (a pipeline's round ends when
its last rank does); *x single* and *x ceiling*: the median over rounds of the
round's ratio.

After each pipeline's timed steps, rank 0 times every stage's forward and
backward per micro-batch by itself (the other rank waiting), so the table shows
the slowest stage / the mean stage as measured. Then rank 0 plans each variant
over four devices (same budgets; the hand split one ResNet layer or a quarter
of GPT-2's blocks per device) and times those stages the same way: two cores
cannot run four stages at once, so four-stage plans get no pipeline run.

Bars, for the default variant (a user's plan): pipeline steps/s >= 0.8 x the
two-process ceiling's, and slowest / mean stage time <= 1.10 over two and over
four devices (a one-stage plan fails them: there is nothing pipelined). The other variants' figures are
``info:`` lines.

    python -m benchmarks.pipeline_throughput [--quick] [--models resnet50,gpt2] [--out benchmarks/]

``--quick`` runs tiny versions of the models (one bottleneck per ResNet layer;
two GPT-2 layers of width 64) for the smoke test. Writes
``THROUGHPUT_RESULTS.md`` and ``throughput_results.json`` under ``--out``; exits
1 when a bar fails. Also a part of ``benchmarks/run.py`` (``--parts throughput``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from benchmarks.measure import torchrun_command  # noqa: E402

__all__ = [
    "MODEL_NAMES",
    "main",
    "run_throughput",
    "settings_for",
    "summarize",
    "throughput_bars",
    "write_results",
]

MODEL_NAMES = ("resnet50", "gpt2")
RESULTS_MD, RESULTS_JSON = "THROUGHPUT_RESULTS.md", "throughput_results.json"
CEILING_BAR, BALANCE_BAR = 0.8, 1.10
BASE_VARIANTS = ("default", "profiled", "balanced", "hand")
TIMEOUT_S = {False: 1800, True: 240}


def variants() -> list[str]:
    """The pipeline variants (``default`` is the throughput objective, fxsplit's default with a pipeline)."""
    return list(BASE_VARIANTS)


def settings_for(name: str, quick: bool) -> dict[str, Any]:
    """What the worker runs for one model: batch, micro-batches, rounds of timed steps, warm-up steps, budgets.

    The batches are large enough that a micro-batch keeps a core busy: on one CPU thread ResNet-50
    trains a sample 2x slower in micro-batches of 2 images than of 16 (the first runs of this benchmark
    split a batch of 16 into 8, and their pipelines, doing 1.6x the single process's work, reached
    0.4x the ceiling), and GPT-2 reads and accumulates its 124 M weights once per micro-batch. The
    ``microbatched`` baseline (the whole model, one process, the same micro-batches one after another)
    shows what micro-batching alone costs.
    """
    return {
        "model": name,
        "tiny": quick,
        "batch": 8 if quick else {"resnet50": 128, "gpt2": 32}[name],
        "chunks": 4 if quick else {"resnet50": 8, "gpt2": 8}[name],
        "schedule": "1f1b",  # or "gpipe"
        "rounds": 2,
        "steps": 1,
        "warmup": 1,
        "stage_repeats": 2,
        "budget_factor": 1.25,
        "variants": variants(),
        "four_stages": True,
    }


def _launch(settings: dict[str, Any], quick: bool) -> tuple[list[dict[str, Any]] | None, str]:
    """Run the worker under torchrun; the two ranks' records, or None and the output's tail."""
    with tempfile.TemporaryDirectory(prefix="fxsplit-throughput-") as tmp:
        path = Path(tmp) / "settings.json"
        path.write_text(json.dumps(settings))
        command = torchrun_command(ROOT / "benchmarks" / "throughput_worker.py", str(path), tmp)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
        }
        try:
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S[quick])
        except subprocess.TimeoutExpired as error:
            return None, f"timed out after {error.timeout} s"
        tail = (run.stdout[-3000:] + run.stderr[-3000:]).strip()
        records = [Path(tmp) / f"rank{r}.json" for r in range(2)]
        if run.returncode != 0 or not all(p.exists() for p in records):
            return None, f"torchrun exited {run.returncode}: {tail}"
        return [json.loads(p.read_text()) for p in records], tail


def _share(timings: list[dict[str, Any]]) -> float:
    """The rank's CPU seconds per wall second over its timed steps."""
    return sum(t["cpu_s"] for t in timings) / sum(t["wall_s"] for t in timings)


def _rate(timings: list[dict[str, Any]]) -> float:
    """Steps per second over all rounds."""
    return sum(t["steps"] for t in timings) / sum(t["wall_s"] for t in timings)


def _per_round(timings: list[dict[str, Any]]) -> list[float]:
    return [t["steps"] / t["wall_s"] for t in timings]


def _slowest(ranks: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per round, the timing of the rank that finished last (a pipeline's step ends on every rank)."""
    return [max(rounds, key=lambda t: t["wall_s"]) for rounds in zip(*ranks, strict=True)]


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _variant(
    name: str, ranks: list[dict[str, Any]], single: list[float], ceiling: list[float], batch: int
) -> dict[str, Any]:
    first = ranks[0]["variants"][name]
    if "error" in first:
        return {"error": first["error"], "traceback": first.get("traceback", "")}
    busy = [r["variants"][name]["timing"] for r in ranks[: first["stages"]]]  # a one-stage plan: rank 0 only
    timing = _slowest(busy)
    rate, rounds = _rate(timing), _per_round(timing)
    stage_s = [t["forward_s"] + t["backward_s"] for t in first["stage_times"]]
    keep = ("stages", "devices", "transfer_bytes", "tied", "per_stage", "stage_times", "plan_s")
    return {
        **{k: first[k] for k in keep},
        "steps_per_s": rate,
        "samples_per_s": rate * batch,
        "rounds_steps_per_s": rounds,
        "vs_single": _median([v / s for v, s in zip(rounds, single, strict=True)]),
        "vs_ceiling": _median([v / c for v, c in zip(rounds, ceiling, strict=True)]),
        "stage_s": stage_s,
        "balance": _balance(stage_s),
        "step_s": [[x for t in rank for x in t["step_s"]] for rank in busy],
        "cpu_share": [_share(rank) for rank in busy],
        "load_1min": [t["load_1min"] for t in busy[0]],
    }


def _balance(stage_s: list[float]) -> float | None:
    return max(stage_s) / (sum(stage_s) / len(stage_s)) if len(stage_s) > 1 else None


def _four(record: dict[str, Any]) -> dict[str, Any]:
    if "error" in record:
        return record
    stage_s = [t["forward_s"] + t["backward_s"] for t in record["stage_times"]]
    return {**record, "stage_s": stage_s, "balance": _balance(stage_s)}


def summarize(name: str, settings: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's figures from the two ranks' records."""
    from benchmarks.throughput_models import batched, model_spec

    spec = batched(model_spec(name, settings["tiny"]), settings["batch"])
    single = _per_round(ranks[0]["single"])
    microbatched = _per_round(ranks[0]["microbatched"])
    copies = [_per_round(r["ceiling"]) for r in ranks]
    ceiling = [sum(rates) for rates in zip(*copies, strict=True)]
    variants = {v: _variant(v, ranks, single, ceiling, spec.batch) for v in settings["variants"]}
    rate = _rate(ranks[0]["single"])
    return {
        "model": name,
        "describe": spec.describe,
        "batch": spec.batch,
        "trace": spec.trace,
        "settings": settings,
        "parameters": ranks[0]["parameters"],
        "one_device_bytes": ranks[0]["one_device_bytes"],
        "budget_bytes": ranks[0]["budget_bytes"],
        "single": {
            "steps_per_s": rate,
            "samples_per_s": rate * spec.batch,
            "rounds_steps_per_s": single,
            "step_s": [x for t in ranks[0]["single"] for x in t["step_s"]],
            "cpu_share": [_share(ranks[0]["single"])],
            "load_1min": [t["load_1min"] for t in ranks[0]["single"]],
        },
        "microbatched": {
            "steps_per_s": _rate(ranks[0]["microbatched"]),
            "samples_per_s": _rate(ranks[0]["microbatched"]) * spec.batch,
            "vs_single": _median([m / s for m, s in zip(microbatched, single, strict=True)]),
            "cpu_share": [_share(ranks[0]["microbatched"])],
        },
        "ceiling": {
            "steps_per_s": sum(_rate(r["ceiling"]) for r in ranks),
            "vs_single": _median([c / s for c, s in zip(ceiling, single, strict=True)]),
            "rounds_steps_per_s": ceiling,
            "copies_steps_per_s": [_rate(r["ceiling"]) for r in ranks],
            "cpu_share": [_share(r["ceiling"]) for r in ranks],
        },
        "variants": variants,
        "four_stages": {v: _four(r) for v, r in ranks[0].get("four_stages", {}).items()},
        "loads": {"start": ranks[0]["load_start"], "end": ranks[0]["load_end"]},
    }


def run_throughput(names: list[str], *, quick: bool) -> dict[str, Any]:
    """Every named model's launch; a model whose launch failed is kept with the error."""
    models = []
    for name in names:
        settings = settings_for(name, quick)
        print(f"[fxsplit-bench] pipeline throughput: {name}{' (tiny)' if quick else ''} ...", flush=True)
        ranks, tail = _launch(settings, quick)
        models.append({"model": name, "error": tail} if ranks is None else summarize(name, settings, ranks))
    result = {"models": models, "variants": variants()}
    return {**result, "bars": throughput_bars(result)}


def _balance_bar(v: dict[str, Any], info: bool) -> dict[str, Any]:
    if "error" in v:
        return {"pass": False, "info": info, "value": v["error"]}
    if v["balance"] is None:
        return {"pass": False, "info": info, "value": "one stage"}
    return {"pass": v["balance"] <= BALANCE_BAR, "info": info, "value": f"{v['balance']:.2f} ({v['stages']} stages)"}


def throughput_bars(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The default plan's bars per model, and the other variants' figures as info lines."""
    bars: dict[str, dict[str, Any]] = {}
    for m in result["models"]:
        name = m["model"]
        if "error" in m:
            bars[f"throughput {name}: the benchmark ran"] = {"pass": False, "value": m["error"][-300:]}
            continue
        for variant, v in m["variants"].items():
            info = variant != "default"
            prefix = f"{'info: ' if info else ''}throughput {name} {variant}"
            if "error" in v:
                ran = f"{prefix}: pipeline_stages and its schedule ran"
                bars[ran] = {"pass": False, "info": info, "value": v["error"]}
                continue
            one = " (one stage: nothing pipelined)" if v["stages"] == 1 else ""
            bars[f"{prefix}: pipeline >= {CEILING_BAR} x two-process ceiling"] = {
                "pass": v["stages"] > 1 and v["vs_ceiling"] >= CEILING_BAR,
                "info": info,
                "value": f"{v['vs_ceiling']:.2f} (x{v['vs_single']:.2f} single, ceiling "
                f"x{m['ceiling']['vs_single']:.2f}){one}",
            }
            bars[f"{prefix}: slowest / mean stage <= {BALANCE_BAR} (measured)"] = _balance_bar(v, info)
        for variant, v in m.get("four_stages", {}).items():
            info = variant != "default"
            prefix = f"{'info: ' if info else ''}throughput {name} {variant}, 4 devices"
            bars[f"{prefix}: slowest / mean stage <= {BALANCE_BAR} (measured)"] = _balance_bar(v, info)
    return bars


def write_results(result: dict[str, Any], context: dict[str, Any], out: Path) -> list[Path]:
    """Write THROUGHPUT_RESULTS.md and throughput_results.json under ``out``."""
    from benchmarks.throughput_report import markdown

    out.mkdir(parents=True, exist_ok=True)
    md, js = out / RESULTS_MD, out / RESULTS_JSON
    js.write_text(json.dumps({**context, "throughput": result}, indent=1) + "\n")
    md.write_text(markdown(result, context))  # benchmarks.throughput_report
    return [md, js]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models, fewer steps (about a minute)")
    parser.add_argument("--models", default=",".join(MODEL_NAMES), help="comma-separated subset of resnet50,gpt2")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    args = parser.parse_args(argv)
    from benchmarks.measure import run_alone
    from benchmarks.run import announce
    from benchmarks.throughput_report import stage_table, throughput_table

    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODEL_NAMES]
    if unknown:
        raise SystemExit(f"unknown throughput model(s) {unknown}; models are {', '.join(MODEL_NAMES)}")
    command = " ".join(["python -m benchmarks.pipeline_throughput", *(argv if argv is not None else sys.argv[1:])])
    result, context = run_alone(command, 1, args.quick, lambda: run_throughput(names, quick=args.quick))
    written = write_results(result, context, args.out)
    print(throughput_table(result))
    print(stage_table(result))
    return announce(result["bars"], written)


if __name__ == "__main__":
    sys.exit(main())
