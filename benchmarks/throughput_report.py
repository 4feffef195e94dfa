"""THROUGHPUT_RESULTS.md and RESULTS.md's section for :mod:`benchmarks.pipeline_throughput`: tables and text."""

from __future__ import annotations

from typing import Any

from benchmarks.pipeline_throughput import BALANCE_BAR, CEILING_BAR, RESULTS_MD

__all__ = ["headline_lines", "markdown", "report_section", "stage_table", "throughput_table"]


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
        if "microbatched" in m:
            b = m["microbatched"]
            rows.append([m["model"], f"single process, {m['settings']['chunks']} micro-batches", 1])
            rows[-1] += [f"{b['steps_per_s']:.3f}", f"{b['samples_per_s']:.1f}", f"{b['vs_single']:.2f}"]
            rows[-1] += [f"{b['vs_single'] / c['vs_single']:.2f}", _shares(b), ""]
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
        plans = [(f"{k}, 2 devices", v) for k, v in m.get("variants", {}).items()]
        plans += [(f"{k}, 4 devices", v) for k, v in m.get("four_stages", {}).items()]
        for label, v in plans:
            if "error" in v:
                rows.append([m["model"], label, "error", "", "", "", v["error"][:200], ""])
                continue
            for index, (t, total) in enumerate(zip(v["stage_times"], v["stage_s"], strict=True)):
                balance = f"{v['balance']:.2f}" if v["balance"] is not None and index == 0 else ""
                fwd, bwd = t["forward_s"] * 1e3, t["backward_s"] * 1e3
                held = _where(
                    {**v, "devices": v["devices"][index : index + 1], "per_stage": v["per_stage"][index:][:1]}
                )
                row = [m["model"], label, index, f"{fwd:.1f}", f"{bwd:.1f}", f"{total * 1e3:.1f}", balance, held]
                rows.append(row)
    header = ["model", "plan", "stage", "forward ms", "backward ms", "total ms", "slowest / mean", "holds"]
    return _table(header, rows)


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
            f"x{m['ceiling']['vs_single']:.2f}"
            + (
                f"; the same work in {m['settings']['chunks']} micro-batches in one process "
                f"x{m['microbatched']['vs_single']:.2f}"
                if "microbatched" in m
                else ""
            )
            + "; pipelines: "
            + "; ".join(figures)
            + "."
        )
    return lines


def report_section(result: dict[str, Any]) -> str:
    """RESULTS.md's section: a link to the whole report, and the throughput table."""
    return (
        f"## 5. Pipelined training throughput\n\nThe whole report, with stage times: [{RESULTS_MD}]({RESULTS_MD}). "
        "Two gloo processes, one thread each; *x ceiling* is over two independent copies of the one-process "
        "step run at once.\n\n" + throughput_table(result)
    )


_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def markdown(result: dict[str, Any], context: dict[str, Any]) -> str:
    from benchmarks import pipeline_throughput
    from benchmarks.report import _at_commit, _bars_md

    m = context["machine"]
    models = [x for x in result["models"] if "error" not in x]
    setup = "\n".join(
        f"- {x['model']}: {x['describe']}; {x['settings']['chunks']} micro-batches "
        f"({_SCHEDULES[x['settings'].get('schedule', 'gpipe')]}); traced with "
        f'`trace="{x["trace"]}"`; budgets 2 x {x["budget_bytes"] / 2**20:.0f} MiB '
        f"({x['settings']['budget_factor']} x "
        f"the {x['one_device_bytes'] / 2**20:.0f} MiB fxsplit plans for the whole model on one device, mode "
        f'"training"); {x["settings"]["warmup"]} warm-up step(s), then {x["settings"]["rounds"]} rounds of '
        f"{x['settings']['steps']} timed step(s) of each; 1-minute load {x['loads']['start'][0]:.2f} at the "
        f"launch's start, {x['loads']['end'][0]:.2f} at its end, "
        + ", ".join(f"{load:.2f}" for load in x["single"]["load_1min"])
        + " at the start of each round."
        for x in models
    )
    parts = [
        "# Pipelined training throughput across processes\n\n"
        f"Written by `{context['command']}` {_at_commit(context.get('commit'))}on {context['started']} "
        f"in {context['duration_s']:.0f} s" + (" (**--quick**: tiny models)" if context.get("quick") else "") + ".",
        _table(["machine", ""], [[k, v] for k, v in m.items()]),
        f"1-minute load average at the start and the end: {', '.join(f'{x:.2f}' for x in context['load_samples'])} "
        f"({m['cores']} cores). Each model's baselines and pipelines ran in one launch, interleaved in rounds, "
        "so load from other work falls on all of them alike, but it still slows each: the load is noted per "
        "model, and *CPU / wall* in the table below shows how much of a core each rank got.",
        "## Headlines\n\n" + "\n".join(headline_lines(result)),
        "## Bars\n\n" + _bars_md(result["bars"]),
        "## Setup\n\n"
        + (pipeline_throughput.__doc__ or "").split("\n\n", 1)[1].split("    python -m")[0].strip()
        + "\n\n"
        + setup,
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
