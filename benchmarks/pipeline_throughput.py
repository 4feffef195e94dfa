"""Pipelined training throughput across processes: fxsplit's stages on two CPU cores that run in parallel.

For each model (:mod:`benchmarks.throughput_models`: ResNet-50 and GPT-2 small,
random weights), one ``torchrun --nproc-per-node 2`` launch (gloo, one torch
thread per rank; :mod:`benchmarks.throughput_worker`) measures, in this order:

* ``single``: a training step (forward, backward, SGD) of the whole model on the
  whole batch in one process, one thread, the other rank idle: steps/s;
* ``ceiling``: two independent copies of that step, one per process, at once:
  their summed steps/s over ``single``'s is what two processes get on this
  machine (1.4-1.9x on these 2-core machines, memory bandwidth being shared);
* the pipelines: ``fxsplit.pipeline_stages(model, budgets, example_inputs=(batch,),
  chunks=C, trace=..., mode="training", <variant>)`` under GPipe
  (``torch.distributed.pipelining.ScheduleGPipe``, C micro-batches), rank i
  running stage i, each variant's options being:
  ``default`` (no ``objective``: what a user gets), ``balanced``
  (``objective="balanced"``: even parameter bytes), ``hand`` (``pins=``: the
  PyTorch model-parallel tutorial's ResNet-50 split, layers 1-2 | 3-4, and its
  half/half analogue for GPT-2's blocks), and ``throughput``
  (``objective="throughput"``) where fxsplit has that objective. Each of the two
  budgets is ``budget_factor`` x what fxsplit plans the whole model to need on
  one device for training: each device could hold the whole model, so the plan,
  not memory, decides the split. A plan of one stage runs on rank 0 alone.

After each pipeline's timed steps, rank 0 times every stage's forward and
backward per micro-batch by itself (the other rank waiting), so the table shows
the slowest stage / the mean stage as measured.

Bars, for the default variant (a user's plan): pipeline steps/s >= 0.8 x the
two-process ceiling's, and slowest / mean stage time <= 1.10 (a one-stage plan
fails both: there is nothing pipelined). The other variants' figures are
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
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

__all__ = [
    "MODEL_NAMES",
    "headline_lines",
    "main",
    "report_section",
    "run_throughput",
    "settings_for",
    "summarize",
    "throughput_bars",
    "write_results",
]

MODEL_NAMES = ("resnet50", "gpt2")
RESULTS_MD, RESULTS_JSON = "THROUGHPUT_RESULTS.md", "throughput_results.json"
CEILING_BAR, BALANCE_BAR = 0.8, 1.10
BASE_VARIANTS = ("default", "balanced", "hand")
TIMEOUT_S = {False: 900, True: 240}


def variants() -> list[str]:
    """The pipeline variants; ``throughput`` once fxsplit has that objective."""
    from fxsplit.options import OBJECTIVES

    return [*BASE_VARIANTS, *(["throughput"] if "throughput" in OBJECTIVES else [])]


def settings_for(name: str, quick: bool) -> dict[str, Any]:
    """What the worker runs for one model: micro-batches, timed and warm-up steps, budgets."""
    steps = {"resnet50": 6, "gpt2": 4}[name]
    return {
        "model": name,
        "tiny": quick,
        "chunks": 4 if quick else 8,
        "steps": 3 if quick else steps,
        "warmup": 1 if quick else 2,
        "stage_repeats": 2 if quick else 3,
        "budget_factor": 1.25,
        "variants": variants(),
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(settings: dict[str, Any], quick: bool) -> tuple[list[dict[str, Any]] | None, str]:
    """Run the worker under torchrun; the two ranks' records, or None and the output's tail."""
    with tempfile.TemporaryDirectory(prefix="fxsplit-throughput-") as tmp:
        path = Path(tmp) / "settings.json"
        path.write_text(json.dumps(settings))
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(ROOT / "benchmarks" / "throughput_worker.py"),
            str(path),
            tmp,
        ]
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


def _share(timing: dict[str, Any]) -> float:
    """The rank's CPU seconds per wall second over the timed steps."""
    return float(timing["cpu_s"] / timing["wall_s"])


def _variant(name: str, ranks: list[dict[str, Any]], single: float, ceiling: float, batch: int) -> dict[str, Any]:
    first = ranks[0]["variants"][name]
    if "error" in first:
        return {"error": first["error"], "traceback": first.get("traceback", "")}
    if first["stages"] == 1:
        wall = first["timing"]["wall_s"]
    else:
        wall = max(r["variants"][name]["timing"]["wall_s"] for r in ranks)
    steps_per_s = first["timing"]["steps"] / wall
    stage_s = [t["forward_s"] + t["backward_s"] for t in first["stage_times"]]
    balance = max(stage_s) / (sum(stage_s) / len(stage_s)) if len(stage_s) > 1 else None
    keep = ("stages", "devices", "transfer_bytes", "tied", "per_stage", "stage_times", "plan_s")
    return {
        **{k: first[k] for k in keep},
        "steps_per_s": steps_per_s,
        "samples_per_s": steps_per_s * batch,
        "vs_single": steps_per_s / single,
        "vs_ceiling": steps_per_s / ceiling,
        "stage_s": stage_s,
        "balance": balance,
        "step_s": [r["variants"][name]["timing"]["step_s"] for r in ranks],
        "cpu_share": [_share(r["variants"][name]["timing"]) for r in ranks[: first["stages"]]],  # idle ranks: none
        "load_1min": first["timing"]["load_1min"],
    }


def summarize(name: str, settings: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's figures from the two ranks' records."""
    from benchmarks.throughput_models import model_spec

    spec = model_spec(name, settings["tiny"])
    single = ranks[0]["single"]["steps_per_s"]
    copies = [r["ceiling"]["steps_per_s"] for r in ranks]
    ceiling = sum(copies)
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
            **ranks[0]["single"],
            "steps_per_s": single,
            "samples_per_s": single * spec.batch,
            "cpu_share": [_share(ranks[0]["single"])],
        },
        "ceiling": {
            "steps_per_s": ceiling,
            "vs_single": ceiling / single,
            "copies_steps_per_s": copies,
            "cpu_share": [_share(r["ceiling"]) for r in ranks],
            "load_1min": ranks[0]["ceiling"]["load_1min"],
        },
        "variants": {v: _variant(v, ranks, single, ceiling, spec.batch) for v in settings["variants"]},
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
                bars[f"{prefix}: pipeline_stages and GPipe ran"] = {"pass": False, "info": info, "value": v["error"]}
                continue
            one = " (one stage: nothing pipelined)" if v["stages"] == 1 else ""
            bars[f"{prefix}: pipeline >= {CEILING_BAR} x two-process ceiling"] = {
                "pass": v["stages"] > 1 and v["vs_ceiling"] >= CEILING_BAR,
                "info": info,
                "value": f"{v['vs_ceiling']:.2f} (x{v['vs_single']:.2f} single, ceiling "
                f"x{m['ceiling']['vs_single']:.2f}){one}",
            }
            bars[f"{prefix}: slowest / mean stage <= {BALANCE_BAR} (measured)"] = {
                "pass": v["balance"] is not None and v["balance"] <= BALANCE_BAR,
                "info": info,
                "value": f"{v['balance']:.2f}" if v["balance"] is not None else "one stage",
            }
    return bars


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)])


def _where(v: dict[str, Any]) -> str:
    parts = []
    for device, stage in zip(v["devices"], v["per_stage"], strict=True):
        blocks = "-".join(dict.fromkeys(b.removeprefix("model.transformer.") for b in stage["blocks"]))
        named = f" ({blocks})" if blocks else ""
        parts.append(f"{device}: {stage['parameters'] / 1e6:.2f} M params, {stage['block_count']} blocks{named}")
    return "; ".join(parts)


def _shares(row: dict[str, Any]) -> str:
    return ", ".join(f"{x:.2f}" for x in row["cpu_share"])


def throughput_table(result: dict[str, Any]) -> str:
    rows = []
    for m in result["models"]:
        if "error" in m:
            rows.append([m["model"], "(failed)", "", "", "", "", "", "", ""])
            continue
        s, c = m["single"], m["ceiling"]
        rows.append([m["model"], "single process", 1, f"{s['steps_per_s']:.3f}", f"{s['samples_per_s']:.1f}", "1.00"])
        rows[-1] += [f"{1 / c['vs_single']:.2f}", _shares(s), ""]
        rows.append([m["model"], "two independent copies (ceiling)", "", f"{c['steps_per_s']:.3f}", ""])
        rows[-1] += [f"{c['vs_single']:.2f}", "1.00", _shares(c), ""]
        for variant, v in m["variants"].items():
            if "error" in v:
                rows.append([m["model"], variant, "error", "", "", "", "", "", v["error"][:200]])
                continue
            rows.append(
                [
                    m["model"],
                    variant,
                    v["stages"],
                    f"{v['steps_per_s']:.3f}",
                    f"{v['samples_per_s']:.1f}",
                    f"{v['vs_single']:.2f}",
                    f"**{v['vs_ceiling']:.2f}**",
                    _shares(v),
                    _where(v),
                ]
            )
    header = ["model", "run", "stages", "steps/s", "samples/s", "x single", "x ceiling", "CPU / wall", "stages hold"]
    return _table(header, rows)


def stage_table(result: dict[str, Any]) -> str:
    rows = []
    for m in result["models"]:
        for variant, v in m.get("variants", {}).items():
            if "error" in v:
                continue
            for index, (t, total) in enumerate(zip(v["stage_times"], v["stage_s"], strict=True)):
                balance = f"{v['balance']:.2f}" if v["balance"] is not None and index == 0 else ""
                fwd, bwd = t["forward_s"] * 1e3, t["backward_s"] * 1e3
                rows.append([m["model"], variant, index, f"{fwd:.1f}", f"{bwd:.1f}", f"{total * 1e3:.1f}", balance])
    return _table(["model", "plan", "stage", "forward ms", "backward ms", "total ms", "slowest / mean"], rows)


def headline_lines(result: dict[str, Any], *, link: bool = False) -> list[str]:
    """A bullet per model; ``link``: name THROUGHPUT_RESULTS.md (in RESULTS.md)."""
    lines = []
    where = f" ([{RESULTS_MD}]({RESULTS_MD}))" if link else ""
    for m in result["models"]:
        if "error" in m:
            lines.append(f"- Pipelined throughput{where}, {m['model']}: the run failed: {m['error'][-300:]}")
            continue
        figures = [
            f"{variant} {v['vs_ceiling']:.2f}x ceiling ({v['stages']} stage{'s' if v['stages'] > 1 else ''})"
            if "error" not in v
            else f"{variant}: error"
            for variant, v in m["variants"].items()
        ]
        lines.append(
            f"- Pipelined throughput{where}, {m['model']}: single process {m['single']['steps_per_s']:.3f} steps/s; "
            "two-process ceiling "
            f"x{m['ceiling']['vs_single']:.2f}; pipelines: " + "; ".join(figures) + "."
        )
    return lines


def report_section(result: dict[str, Any]) -> str:
    """RESULTS.md's section: a link to the whole report, and the throughput table."""
    return (
        f"## 5. Pipelined training throughput\n\nThe whole report, with stage times: [{RESULTS_MD}]({RESULTS_MD}). "
        "Two gloo processes, one thread each; *x ceiling* is over two independent copies of the one-process "
        "step run at once.\n\n" + throughput_table(result)
    )


def markdown(result: dict[str, Any], context: dict[str, Any]) -> str:
    from benchmarks.report import _at_commit, _bars_md

    m = context["machine"]
    models = [x for x in result["models"] if "error" not in x]
    setup = "\n".join(
        f"- {x['model']}: {x['describe']}; {x['settings']['chunks']} micro-batches (GPipe); traced with "
        f'`trace="{x["trace"]}"`; budgets 2 x {x["budget_bytes"] / 2**20:.0f} MiB '
        f"({x['settings']['budget_factor']} x "
        f"the {x['one_device_bytes'] / 2**20:.0f} MiB fxsplit plans for the whole model on one device, mode "
        f'"training"); {x["settings"]["warmup"]} warm-up and {x["settings"]["steps"]} timed steps per run; '
        f"1-minute load {x['loads']['start'][0]:.2f} at its start, {x['loads']['end'][0]:.2f} at its end."
        for x in models
    )
    parts = [
        "# Pipelined training throughput across processes\n\n"
        f"Written by `{context['command']}` {_at_commit(context.get('commit'))}on {context['started']} "
        f"in {context['duration_s']:.0f} s" + (" (**--quick**: tiny models)" if context.get("quick") else "") + ".",
        _table(["machine", ""], [[k, v] for k, v in m.items()]),
        f"1-minute load average at the start and the end: {', '.join(f'{x:.2f}' for x in context['load_samples'])} "
        f"({m['cores']} cores). Every figure comes from one run per model, its baselines and pipelines one "
        "after the other in the same launch, so load from other work moves them; the load is noted per model.",
        "## Headlines\n\n" + "\n".join(headline_lines(result)),
        "## Bars\n\n" + _bars_md(result["bars"]),
        "## Setup\n\n" + (__doc__ or "").split("\n\n", 1)[1].split("    python -m")[0].strip() + "\n\n" + setup,
        "## Throughput\n\n*x ceiling*: steps/s over the two independent copies' summed steps/s (the bar: "
        f">= {CEILING_BAR}). *stages hold*: parameters and the model's blocks with weights on each stage (a block "
        "cut in two counts on both). *CPU / wall*: each rank's process CPU time over the timed steps' wall time "
        "(below 1: the rank waited, for a core the machine's other work held or for its neighbour stage).\n\n"
        + throughput_table(result),
        "## Stage times\n\nPer micro-batch, each stage run by itself on rank 0 (one thread), median over the "
        "micro-batches of the repeats after the first; forward, then backward from the loss (last stage) or "
        f"from ones (the others). The bar: slowest / mean <= {BALANCE_BAR}.\n\n" + stage_table(result),
    ]
    errors = [
        f"### {x['model']} {v}\n\n```text\n{d['traceback'] or d['error']}\n```"
        for x in models
        for v, d in x["variants"].items()
        if "error" in d
    ]
    if errors:
        parts.append("## Errors\n\n" + "\n\n".join(errors))
    return "\n\n".join(parts) + "\n"


def write_results(result: dict[str, Any], context: dict[str, Any], out: Path) -> list[Path]:
    """Write THROUGHPUT_RESULTS.md and throughput_results.json under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / RESULTS_MD, out / RESULTS_JSON
    js.write_text(json.dumps({**context, "throughput": result}, indent=1) + "\n")
    md.write_text(markdown(result, context))
    return [md, js]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models, fewer steps (about a minute)")
    parser.add_argument("--models", default=",".join(MODEL_NAMES), help="comma-separated subset of resnet50,gpt2")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    args = parser.parse_args(argv)
    from benchmarks.measure import run_alone
    from benchmarks.run import announce

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
