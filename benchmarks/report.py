"""Write ``results.json``, ``RESULTS.md`` and the PNG plots from one run's results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.runtime_overhead import VARIANT_NAMES
from fxsplit.units import format_size

__all__ = ["write_report"]

PLOTS = {
    "quality": "quality_bytes.png",
    "split": "time_to_split.png",
    "scaling": "planning_scaling.png",
    "runtime": "runtime_overhead.png",
}

QUALITY_NOTE = """\
Budgets per device: tight = 1.1 x total / N, loose = 1.5 x total / N (total = every parameter and buffer,
each tensor once). All placements are scored on the same traced graph with fxsplit's cost model: bytes
copied per forward, each value once per device other than its home that reads it (a lower bound for
Accelerate, whose hooks copy a value again for every module that reads it). fxsplit is called with
`mode="weights"` so that a budget means what Accelerate's `max_memory` means. Accelerate is given
`max_memory={0: b, 1: b, ...}` (ints are its only accelerator keys; int k is read as `cpu:k`):
`accelerate` = `infer_auto_device_map(model, max_memory, no_split_module_classes=<block classes>)`
(`model._no_split_modules` for transformers models), `accelerate-plain` = the same without
`no_split_module_classes`, `hf-auto` = what `from_pretrained(device_map="auto", max_memory=...)` computes
(transformers' `_get_device_map`). Its modules run on their mapped device; modules it maps to
"disk"/"cpu" run on device 0 with their weights streamed in each forward ("streamed", counted in the
bars' first comparison); code outside mapped modules runs where its inputs are. "packable": the tensors
fit the budgets by first-fit-decreasing, in any order. "block optimum": the exact best placement of the
top-level blocks (embeddings, each layer, head) in order, with the same cost (`benchmarks/reference.py`);
"none fits" when no block placement meets the budgets. "max load": heaviest device / its budget. "outputs": the
bytes copied to return the outputs on one device: fxsplit's output device (a value already copied there for an
op is returned from that copy); for Accelerate device 0, where the inputs are given, as its root hook
(`io_same_device`) sends them back; the bar "every copy" compares these totals."""

OPTIMALITY_NOTE = """\
fxsplit's default (out-of-order) placement, `partition(problem, budgets)`, against brute force over all
N^k placements (`benchmarks/optimality.py`; N^k <= 4^10) on seeded random DAGs of 4-10 ops over 2-4
devices: `linear` as issue 14 measured (a weight per op, skip connections, tied weights, budgets of
0.95-1.9 x total / N, equal or per device), `constrained` with pins, ops that write one tensor in place,
values changed in place, transient and extra bytes (budgets from 0.9 x total / N). "worst ratio": fxsplit's
bytes / the optimum at most; "not monotone": cases where the budgets times 1.1, 1.3 or 2 gave more bytes
(or a refusal); "ms": partition()'s median / largest time per case."""

PLANNING_NOTE = """\
Time to a runnable split model on N=2 logical devices with loose budgets: fxsplit's stages (trace with
torch.export; plan = cost model + partition + plan data; codegen = moving weights + emitting the
GraphModule) and the public `fxsplit.fxsplit()` end to end, against Accelerate's
`infer_auto_device_map` (with the block classes) + `dispatch_model`. Both split models' outputs are
checked against the unsplit model. Scaling: `fxsplit.partition.partition` alone, over 4 devices with
budgets 1.2 x total / 4, on synthetic problems (`benchmarks/synthetic.py`: deep residual chains;
wide stages of 16 parallel branches; chains with long skips from the first half to the second) and on
real torch.fx graphs of deep MLPs. The Llama-70B-sized
model is built on the meta device in bfloat16 and planned in a fresh subprocess (`benchmarks/llama70b.py`),
whose peak RSS is its `VmHWM` (imports included; `getrusage(RUSAGE_SELF).ru_maxrss` is shown too, but
Linux carries it over from the parent process across fork + exec, so there it reads the suite's size)."""

RUNTIME_NOTE = """\
Forward time on logical devices `cpu:0..N-1` (tight budgets, so every device is used), same weights,
`torch.no_grad()`. `hand`: the placement fxsplit chose, written by hand in eager PyTorch
(`benchmarks/hand_placed.py`: blocks moved with `module.to`, `x.to(device)` between stages).
`accelerate`: `dispatch_model` with the same device map (every module on the device fxsplit gave its
parameters); on logical devices its hooks copy each module's inputs on every call (`tensor.to("cpu:k")`
always copies on CPU, where on a GPU it is a no-op for a tensor already there). `accelerate-hooks`: the
same hooks all on `"cpu"` with `force_hooks=True`, so `.to` is a no-op: the hooks' own cost with no
copies, a lower bound of Accelerate on real devices. `eager`: the unsplit model. `hand-again`: a second,
identical hand-written copy (an A/A control: its distance from 1.000 is the resolution of the
measurement on this machine). `fxsplit-fx`: the
same split traced with `trace="fx"` (only where torch.fx can trace the model). All variants compute
with the very same weight tensors (the ones fxsplit placed), so memory placement cannot favour one.
Timing interleaves the variants call by call, in a random order each turn; a round's time is the
median of its calls, and the ratio is the median over rounds of variant time / hand time in that round. The optional
`cuda:0` + `cpu` comparison is not part of the suite: no GPU was available where it was written."""


def _size(n: int | None) -> str:
    return "-" if n is None else format_size(int(n))


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _plot_quality(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    groups = sorted({(r["n_devices"], r["budget"]) for r in rows})
    methods = ["fxsplit", "block optimum", "accelerate", "accelerate-plain", "hf-auto"]
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 3.2 * len(groups)), squeeze=False)
    for ax, (n, budget) in zip(axes[:, 0], groups, strict=True):
        sub = [r for r in rows if r["n_devices"] == n and r["budget"] == budget]
        x = np.arange(len(sub))
        for k, method in enumerate(methods):
            values = []
            for r in sub:
                if method == "fxsplit":
                    v = r["fxsplit"].get("bytes_between")
                elif method == "block optimum":
                    v = r["reference"]["bytes_between"] if r["reference"] else None
                else:
                    v = r["accelerate"].get(method, {}).get("total_bytes")
                values.append(np.nan if v is None else max(v, 1))
            ax.bar(x + (k - 2) * 0.16, values, 0.16, label=method)
        ax.set_yscale("log")
        ax.set_xticks(x, [r["model"] for r in sub])
        ax.set_ylabel("bytes moved / forward")
        ax.set_title(f"N={n} devices, {budget} budgets (missing bar: no placement)")
    axes[0, 0].legend(ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_split(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(10, 4))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for stage in ("trace", "plan", "codegen"):
        values = np.array([r["fxsplit"][stage] for r in rows])
        ax.bar(x - 0.2, values, 0.38, bottom=bottom, label=f"fxsplit {stage}")
        bottom += values
    bottom = np.zeros(len(rows))
    for stage in ("map", "dispatch"):
        values = np.array([r["accelerate"][stage] for r in rows])
        ax.bar(x + 0.2, values, 0.38, bottom=bottom, label=f"Accelerate {stage}")
        bottom += values
    ax.set_xticks(x, [r["model"] for r in rows])
    ax.set_ylabel("seconds to a runnable split (N=2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_scaling(planning: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in planning["scaling"].items():
        ops = [p["ops"] for p in curve["points"]]
        ax.loglog(ops, [p["seconds"] for p in curve["points"]], "o-", label=f"{name} (slope {curve['slope']:.2f})")
    real = planning.get("real_graphs") or []
    if real:
        ax.loglog([r["ops"] for r in real], [r["partition_s"] for r in real], "s", label="real FX graphs (MLP)")
    stages = (planning.get("plan_stages") or {}).get("points") or []
    for key, style in (("untraced", "^-"), ("trace", "v:")):
        if stages:
            ax.loglog(
                [p["ops"] for p in stages],
                [p[key] for p in stages],
                style,
                label=f"whole plan(), MLP: {'plan() - trace' if key == 'untraced' else 'trace'}",
            )
    ax.loglog([2_000, 100_000], [0.05, 10.0], "k+", markersize=14, label="bars (50 ms @ 2k, 10 s @ 100k)")
    ax.set_xlabel("ops in the graph")
    ax.set_ylabel("seconds")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_runtime(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    variants = [v for v in VARIANT_NAMES if v != "hand" and any(v in r["ratio_to_hand"] for r in rows)]
    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(rows))
    for k, variant in enumerate(variants):
        ax.bar(
            x + (k - len(variants) / 2 + 0.5) * 0.14,
            [r["ratio_to_hand"].get(variant, np.nan) for r in rows],
            0.14,
            label=variant,
        )
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.axhline(1.03, color="r", linestyle="--", linewidth=0.8, label="bar: 1.03 x hand")
    ax.set_xticks(x, [f"{r['model']} N={r['n_devices']}" for r in rows])
    ax.set_ylabel("forward time / hand placement")
    ax.set_ylim(0.8, max(1.3, max(max(r["ratio_to_hand"].values()) for r in rows) + 0.05))
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _quality_md(quality: dict[str, Any]) -> str:
    rows = []
    for r in quality["rows"]:
        fx, ref = r["fxsplit"], r["reference"]
        fx_cell = (
            f"{_size(fx['bytes_between'])} + {_size(fx.get('output_bytes', 0))} / {fx['max_fraction']:.2f} / "
            f"{fx['empty_devices']}"
            if fx["placed"]
            else "**no placement**"
        )
        acc_cells = []
        for variant in ("accelerate", "accelerate-plain", "hf-auto"):
            a = r["accelerate"].get(variant)
            if a is None:
                acc_cells.append("n/a")
            elif not a["placed"]:
                acc_cells.append("error")
            else:
                acc_cells.append(
                    f"{_size(a['bytes_between'])} + {_size(a['offload_bytes'])} + {_size(a.get('output_bytes', 0))} / "
                    f"{_size(a['spilled_bytes'])} / {a['empty_devices']}"
                )
        rows.append(
            [
                r["model"],
                r["n_devices"],
                r["budget"],
                _size(r["budget_bytes"]),
                r["packable"],
                fx_cell,
                _size(ref["bytes_between"]) if ref else "none fits",
                *acc_cells,
            ]
        )
    header = [
        "model",
        "N",
        "budget",
        "per device",
        "packable",
        "fxsplit: cut + outputs / max load / empty",
        "block optimum",
        "accelerate: between + streamed + outputs / spilled / empty",
        "accelerate-plain",
        "hf-auto",
    ]
    return _table(header, rows)


def _optimality_md(optimality: dict[str, Any]) -> str:
    """The default placement against brute force on small random DAGs (benchmarks/optimality.py): one row per
    family and one for all."""
    rows = []
    for name, s in [*optimality["by_family"].items(), ("all", optimality["summary"])]:
        rows.append(
            [
                name,
                s["cases"],
                s["feasible"],
                f"{s['optimal']} ({s['rate']:.1%})" if s["rate"] is not None else "-",
                f"{s['worst_ratio']:.2f}x",
                s["refused"] + s["errors"],
                s["not_monotone"],
                f"{s['partition_ms']['median']:.1f} / {s['partition_ms']['max']:.0f}" if s["partition_ms"] else "-",
            ]
        )
    header = ["family", "cases", "feasible", "optimal", "worst ratio", "refused or error", "not monotone", "ms"]
    return (
        f"### Against brute force on small DAGs (seed {optimality['seed']})\n\n"
        + OPTIMALITY_NOTE
        + "\n\n"
        + _table(header, rows)
    )


def _failure_summary(failures: list[str]) -> str:
    """'12 failing: gpt2 (9), unet (1) ...; e.g. <first of each model>'."""
    by_model: dict[str, list[str]] = {}
    for failure in failures:
        by_model.setdefault(failure.split("/")[0], []).append(failure)
    counts = ", ".join(f"{model} ({len(items)})" for model, items in by_model.items())
    examples = "; ".join(items[0] for items in by_model.values())
    return f"{len(failures)} failing: {counts}. First of each: {examples}"


def _at_commit(state: dict[str, Any] | None) -> str:
    """'at commit <hash> ' (and whether fxsplit/ or benchmarks/ had uncommitted changes), or nothing."""
    if not state or state.get("commit") in (None, "unknown"):
        return ""
    changes = " with uncommitted changes to fxsplit/ or benchmarks/" if state.get("dirty") else ""
    return f"at commit `{state['commit']}`{changes} "


def _bars_md(bars: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, bar in bars.items():
        detail = bar.get("value", "")
        failures = bar.get("failures") or []
        if failures:
            detail = (detail + " " if detail else "") + _failure_summary(failures)
        verdict = ("yes" if bar["pass"] else "no") if bar.get("info") else ("PASS" if bar["pass"] else "**FAIL**")
        rows.append([name, verdict, detail])
    return _table(["bar", "result", "value / failing cases"], rows)


def _planning_md(planning: dict[str, Any]) -> str:
    split_rows = [
        [
            r["model"],
            f"{r['fxsplit']['trace']:.3f}",
            f"{r['fxsplit']['plan']:.3f}",
            f"{r['fxsplit']['codegen']:.3f}",
            f"{r['fxsplit']['total']:.3f}",
            f"{r['fxsplit']['api_total']:.3f}",
            f"{r['accelerate']['map']:.4f}",
            f"{r['accelerate']['dispatch']:.4f}",
            f"{r['fxsplit']['api_total'] / r['accelerate']['total']:.0f}x",
            "yes" if all(r["outputs_match"].values()) else f"NO {r['outputs_match']}",
        ]
        for r in planning["time_to_split"]
    ]
    parts = [
        _table(
            [
                "model",
                "trace s",
                "plan s",
                "codegen s",
                "stages s",
                "fxsplit() s",
                "Acc. map s",
                "Acc. dispatch s",
                "fxsplit / Acc.",
                "outputs match",
            ],
            split_rows,
        )
    ]
    scale_rows = []
    for name, curve in planning["scaling"].items():
        for p in curve["points"]:
            scale_rows.append([name, p["ops"], p["values"], f"{1000 * p['seconds']:.1f}", p["repeats"]])
    parts.append(_table(["graph", "ops", "values", "partition ms (median)", "repeats"], scale_rows))
    parts.append(
        "Log-log slopes (2k ops and up): "
        + ", ".join(f"{name} {curve['slope']:.2f}" for name, curve in planning["scaling"].items())
    )
    if planning.get("real_graphs"):
        parts.append(
            _table(
                ["real FX graph", "graph nodes", "ops", "partition ms", "whole fxsplit.plan s"],
                [
                    [
                        r["model"],
                        r["graph_nodes"],
                        r["ops"],
                        f"{1000 * r['partition_s']:.1f}",
                        f"{r['fxsplit_plan_s']:.2f}",
                    ]
                    for r in planning["real_graphs"]
                ],
            )
        )
    stages = planning.get("plan_stages")
    if stages:
        names = ("trace", "build", "memory", "partition", "make_plan", "other")
        parts.append(
            _table(
                ["ops", *[f"{n} s" for n in names], "plan() - trace s", "/ partition"],
                [
                    [
                        p["ops"],
                        *[f"{p[n]:.3f}" for n in names],
                        f"{p['untraced']:.3f}",
                        f"{p['untraced'] / p['partition']:.1f}x",
                    ]
                    for p in stages["points"]
                ],
            )
        )
        parts.append(
            'Whole `fxsplit.plan(trace="fx", mode="weights")` on deep MLPs, 4 devices at 1.2 x total / 4, '
            "split by stage (`benchmarks/plan_stages.py`). Log-log slopes: "
            + ", ".join(f"{k} {v:.2f}" for k, v in stages["slopes"].items())
        )
    big = planning.get("llama70b")
    if big and "trace_s" in big:
        parts.append(
            _table(
                ["Llama-70B-sized on meta (bf16, 8 x 20 GiB)", "value"],
                [
                    [
                        "layers / parameters / weights",
                        f"{big['layers']} / {big['parameters'] / 1e9:.1f} G / {_size(big['weight_bytes'])}",
                    ],
                    ["graph nodes / ops", f"{big['graph_nodes']} / {big['ops']}"],
                    ["trace (torch.export) s", f"{big['trace_s']:.1f}"],
                    ["plan (cost model + partition + plan) s", f"{big['plan_s']:.2f}"],
                    ["trace + plan s", f"{big['trace_plan_s']:.1f}"],
                    [
                        "peak RSS of the process, VmHWM (GiB)",
                        f"{big['peak_rss_gib']:.2f} (after imports and model: "
                        f"{big['rss_before_gib']:.2f}; ru_maxrss, which Linux carries over from the parent: "
                        f"{big.get('ru_maxrss_gib', float('nan')):.2f})",
                    ],
                    [
                        "fxsplit: bytes between devices / device loads",
                        f"{_size(big['fxsplit_bytes_between'])} / "
                        f"{', '.join(_size(b) for b in big['fxsplit_device_bytes'])}",
                    ],
                    [
                        "Accelerate (no_split LlamaDecoderLayer): between / spilled / empty devices",
                        f"{_size(big['accelerate_bytes_between'])} / {_size(big['accelerate_spilled_bytes'])} / "
                        f"{big['accelerate_empty_devices']}",
                    ],
                    ["Accelerate infer_auto_device_map s", f"{big['accelerate_map_s']:.3f}"],
                ],
            )
        )
    elif big:
        parts.append(f"Llama-70B run failed: {big.get('error')}")
    return "\n\n".join(parts)


def _runtime_md(runtime: dict[str, Any]) -> str:
    variants = [v for v in VARIANT_NAMES if any(v in r["median_ms"] for r in runtime["rows"])]
    rows = []
    for r in runtime["rows"]:
        ms, ratio = r["median_ms"], r["ratio_to_hand"]
        rows.append(
            [
                r["model"],
                r["n_devices"],
                r["cuts"],
                *[f"{ms[v]:.2f} ({ratio[v]:.3f})" if v in ms else "-" for v in variants],
                "yes" if all(r["outputs_match"].values()) else f"NO {r['outputs_match']}",
            ]
        )
    return _table(["model", "N", "cuts", *[f"{v} ms (x hand)" for v in variants], "outputs match"], rows)


def _spill_split(groups: dict[str, dict[str, Any]]) -> str:
    """' Where Accelerate kept every weight on the devices (N cases): median ...; where it spilled ...'."""
    parts = []
    for key, what in (("on_devices", "kept every weight on the devices"), ("spilled", "spilled weights to disk")):
        group = groups.get(key)
        if group:
            parts.append(
                f"where it {what} ({group['cases']} cases): median {group['median']:.2f}x "
                f"({group['min']:.2f}x to {group['max']:.2f}x)"
            )
    return (" By group: " + "; ".join(parts) + ".") if parts else ""


def _headlines_md(results: dict[str, Any]) -> str:
    lines = []
    quality = (results.get("quality") or {}).get("headlines")
    if quality:
        ratio = quality["bytes_ratio_vs_accelerate"]
        lines.append(
            f"- Placement: fxsplit placed {quality['fxsplit_placed']} of {quality['cases']} cases. Accelerate "
            f'(documented call) spilled weights to "disk" in {quality["accelerate_spilled_cases"]} and left a '
            f"device empty in {quality['accelerate_empty_device_cases']} (fxsplit left one empty in "
            f"{quality['fxsplit_empty_device_cases']}). fxsplit's bytes per forward / Accelerate's (streaming "
            f"included): median {ratio['median']:.2f}x, from {ratio['min']:.2f}x to {ratio['max']:.1f}x; fewer or "
            f"equal in {quality['fxsplit_fewer_bytes_cases']} of the {quality.get('both_placed_cases', '')} "
            "cases both placed." + _spill_split(quality.get("bytes_ratio_by_accelerate_spill") or {})
        )
    optimality = (results.get("quality") or {}).get("optimality")
    if optimality:
        s = optimality["summary"]
        lines.append(
            f"- Default placement against brute force on {s['cases']} small random DAGs (4-10 ops, 2-4 devices): "
            f"optimal in {s['optimal']} of {s['feasible']} feasible cases ({s['rate']:.1%}), at most "
            f"{s['worst_ratio']:.2f}x the optimum, {s['refused'] + s['errors']} feasible refused, "
            f"{s['not_monotone']} where more budget gave more bytes."
        )
    planning = results.get("planning")
    if planning:
        times = sorted(r["fxsplit"]["api_total"] / r["accelerate"]["total"] for r in planning["time_to_split"])
        lines.append(
            f"- Time to a runnable split: fxsplit takes {times[len(times) // 2]:.0f}x Accelerate's "
            f"(median; {times[0]:.0f}x to {times[-1]:.0f}x), almost all of it in torch.export."
        )
        for name, curve in planning["scaling"].items():
            last = curve["points"][-1]
            lines.append(
                f"- partition() on {name} graphs: {1000 * last['seconds']:.0f} ms at {last['ops']} ops, "
                f"log-log slope {curve['slope']:.2f}."
            )
        big = planning.get("llama70b") or {}
        if "trace_plan_s" in big:
            lines.append(
                f"- Llama-70B shape ({big['layers']} layers) on meta: trace + plan "
                f"{big['trace_plan_s']:.1f} s, peak RSS {big['peak_rss_gib']:.2f} GiB."
            )
    runtime = results.get("runtime")
    if runtime and runtime["rows"]:
        for r in runtime["rows"]:
            q = r["ratio_to_hand"]
            lines.append(
                f"- Runtime {r['model']} N={r['n_devices']}: fxsplit {q['fxsplit']:.3f}x hand placement, "
                f"Accelerate {q['accelerate']:.2f}x (hooks alone {q['accelerate-hooks']:.2f}x); "
                f"A/A control {q['hand-again']:.3f}x."
            )
    if results.get("offload"):
        from benchmarks.offload import headline_lines

        lines += headline_lines(results["offload"], link=True)
    if results.get("throughput"):
        from benchmarks.throughput_report import headline_lines as throughput_lines

        lines += throughput_lines(results["throughput"], link=True)
    return "\n".join(lines)


def write_report(results: dict[str, Any], out: Path) -> list[Path]:
    """Write the JSON, the plots and RESULTS.md under ``out``; return the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json"]
    written[0].write_text(json.dumps(results, indent=1) + "\n")
    md: list[str] = [
        f"# fxsplit benchmark results\n\nWritten by `{results['settings']['command']}` "
        f"{_at_commit(results.get('commit'))}on {results['started']} in {results['duration_s']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in results.get("part_durations_s", {}).items())
        + ")"
        + (" (**--quick**: fewer repeats and sizes)" if results["settings"]["quick"] else "")
        + ". Numbers: medians; ratios measured side by side in the same process.\n"
    ]
    m = results["machine"]
    md.append(_table(["machine", ""], [[k, v] for k, v in m.items()]))
    load = results["load"]
    md.append(
        f"\n1-minute load average sampled at the start, after each part and at the end: "
        f"{', '.join(f'{x:.2f}' for x in load['samples_1min'])} ({m['cores']} cores). "
        f"{results['load_caveat']}\n"
    )
    md.append("## Headlines\n\n" + _headlines_md(results))
    md.append("## Bars\n\n" + _bars_md(results["bars"]))
    if results.get("quality"):
        path = out / PLOTS["quality"]
        _plot_quality(results["quality"]["rows"], path)
        written.append(path)
        md.append(
            "## 1. Placement quality\n\n"
            + QUALITY_NOTE
            + "\n\n"
            + _quality_md(results["quality"])
            + (
                "\n\n" + _optimality_md(results["quality"]["optimality"])
                if results["quality"].get("optimality")
                else ""
            )
            + f"\n\n![bytes moved per forward]({path.name})"
        )
    if results.get("planning"):
        planning = results["planning"]
        for key, plot in (("split", _plot_split), ("scaling", _plot_scaling)):
            path = out / PLOTS[key]
            plot(planning["time_to_split"] if key == "split" else planning, path)  # type: ignore[operator]
            written.append(path)
        md.append(
            "## 2. Planning speed\n\n"
            + PLANNING_NOTE
            + "\n\n"
            + _planning_md(planning)
            + f"\n\n![time to split]({PLOTS['split']})\n\n![scaling]({PLOTS['scaling']})"
        )
    if results.get("runtime") and results["runtime"]["rows"]:
        path = out / PLOTS["runtime"]
        _plot_runtime(results["runtime"]["rows"], path)
        written.append(path)
        md.append(
            "## 3. Runtime overhead\n\n"
            + RUNTIME_NOTE
            + "\n\n"
            + _runtime_md(results["runtime"])
            + f"\n\n![runtime]({path.name})"
        )
    if results.get("offload"):
        from benchmarks.offload import NOTE, RESULTS_MD, results_table

        md.append(
            "## 4. Offload\n\n"
            + f"The whole report, with what fxsplit plans under other options: [{RESULTS_MD}]({RESULTS_MD}).\n\n"
            + NOTE
            + "\n\n"
            + results_table(results["offload"]["rows"])
        )
    if results.get("throughput"):
        from benchmarks.throughput_report import report_section

        md.append(report_section(results["throughput"]))
    results_md = out / "RESULTS.md"
    results_md.write_text("\n\n".join(md) + "\n")
    return [results_md, *written]
