"""Run the benchmark suite and write RESULTS.md, results.json and the plots.

Usage (from the repository root)::

    python benchmarks/run.py            # the full suite, ~15-20 min on 2 cores
    python benchmarks/run.py --quick    # fewer repeats and sizes, Llama-70B shape with 8 layers

See ``benchmarks/README.md`` for each part and its options. Exits 1 when a bar fails
(informational comparisons never fail), 0 when every bar passes.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks` and this checkout's `fxsplit` importable
    sys.path.insert(0, str(ROOT))

PARTS = ("quality", "planning", "runtime", "offload", "throughput")
EXIT_BARS_PASS, EXIT_BAR_FAILED = 0, 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="fxsplit vs Accelerate vs the block-level optimum")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and sizes (a few minutes)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks", help="where RESULTS.md etc. go")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument(
        "--models",
        default="",
        help="comma-separated model names (default: all); the offload and throughput parts run those of their "
        "models named",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--llama-layers",
        type=int,
        default=None,
        help="layers of the Llama-70B-shaped model (default 80, --quick 8; 0 skips it)",
    )
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    return args


def _caveat(samples: list[float], threads: int, cores: int) -> str:
    busiest = max(samples)
    if busiest > threads + 0.5:  # the suite itself keeps `threads` cores busy
        return (
            f"**Load caveat:** the machine was shared with other work (1-minute load up to {busiest:.2f} on "
            f"{cores} cores while this run used {threads} thread(s)), so absolute times are noisy; the "
            "ratios come from interleaved, side-by-side measurements in one process."
        )
    return "The machine was otherwise idle."


def verdicts(bars: dict[str, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """One line per bar to print, and the names of the bars that failed (an ``info`` bar never fails)."""
    lines, failed = [], []
    for name, bar in bars.items():
        if bar.get("info"):
            verdict = "yes " if bar["pass"] else "no  "
        else:
            verdict = "PASS" if bar["pass"] else "FAIL"
            if not bar["pass"]:
                failed.append(name)
        lines.append(f"  {verdict}  {name}  {bar.get('value', '')}")
    return lines, failed


def exit_code(bars: dict[str, dict[str, Any]]) -> int:
    """``EXIT_BAR_FAILED`` when any bar failed, else ``EXIT_BARS_PASS``."""
    return EXIT_BAR_FAILED if verdicts(bars)[1] else EXIT_BARS_PASS


def announce(bars: dict[str, dict[str, Any]], written: list[Path]) -> int:
    """Print every bar's verdict, the files written and the failures; return the exit code."""
    lines, failed = verdicts(bars)
    print("\n".join(lines))
    print("[fxsplit-bench] wrote " + ", ".join(str(p) for p in written))
    if failed:
        print(f"[fxsplit-bench] {len(failed)} bar(s) failed: {'; '.join(failed)}", flush=True)
    return exit_code(bars)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; parts are {', '.join(PARTS)}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, parts)
    finally:
        torch.set_num_threads(previous_threads)


def _run(args: argparse.Namespace, parts: list[str]) -> int:
    from benchmarks.measure import git_commit, load_average, machine, time_call
    from benchmarks.models import CASES, case_by_name
    from benchmarks.offload import DEVICE_FRACTIONS, OFFLOAD_CASES, run_offload, write_results
    from benchmarks.optimality import OPTIMALITY_CASES
    from benchmarks.pipeline_throughput import MODEL_NAMES, run_throughput
    from benchmarks.planning_speed import run_planning
    from benchmarks.quality import run_quality
    from benchmarks.report import write_report
    from benchmarks.runtime_overhead import RUNTIME_MODELS, run_runtime

    named = [n for n in args.models.split(",") if n]
    offload_names = [c.name for c in OFFLOAD_CASES if (c.name in named if named else c.default)]
    throughput_names = [n for n in MODEL_NAMES if n in named] if named else list(MODEL_NAMES)
    case_names = {c.name for c in CASES}
    cases = [case_by_name(n) for n in named if n in case_names or n not in {*offload_names, *throughput_names}]
    cases = cases if named else list(CASES)
    layers = args.llama_layers if args.llama_layers is not None else (8 if args.quick else 80)
    started, load_start, clock = datetime.now(timezone.utc), load_average(), time.perf_counter()
    results: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "threads": args.threads,
            "parts": parts,
            "models": [c.name for c in cases],
            "offload_models": offload_names if "offload" in parts else [],
            "throughput_models": throughput_names if "throughput" in parts else [],
            "llama_layers": layers,
            "command": " ".join(["python benchmarks/run.py", *args.argv]),
        },
        "machine": machine(args.threads),
        "commit": git_commit(),
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
    }
    samples, durations = [load_start[0]], {}
    if "quality" in parts:
        print("[fxsplit-bench] placement quality ...", flush=True)
        optimality = OPTIMALITY_CASES["quick" if args.quick else "full"]
        durations["quality"], results["quality"] = time_call(lambda: run_quality(cases, optimality_cases=optimality))
        samples.append(load_average()[0])
    if "planning" in parts:
        print("[fxsplit-bench] planning speed ...", flush=True)
        durations["planning"], results["planning"] = time_call(
            lambda: run_planning(cases, quick=args.quick, threads=args.threads, llama_layers=layers)
        )
        samples.append(load_average()[0])
    if "runtime" in parts:
        print("[fxsplit-bench] runtime overhead ...", flush=True)
        models = [c.name for c in cases if c.name in RUNTIME_MODELS]
        durations["runtime"], results["runtime"] = time_call(lambda: run_runtime(models, quick=args.quick))
        samples.append(load_average()[0])
    if "offload" in parts and offload_names:
        print("[fxsplit-bench] offload ...", flush=True)
        durations["offload"], results["offload"] = time_call(
            lambda: run_offload(offload_names, DEVICE_FRACTIONS, quick=args.quick)
        )
    elif "offload" in parts:
        known = ", ".join(c.name for c in OFFLOAD_CASES)
        print(f"[fxsplit-bench] offload: skipped, none of --models is one of its models ({known})", flush=True)
    if "throughput" in parts and throughput_names:
        durations["throughput"], results["throughput"] = time_call(
            lambda: run_throughput(throughput_names, quick=args.quick)
        )
        samples.append(load_average()[0])
    elif "throughput" in parts:
        print(f"[fxsplit-bench] throughput: skipped, none of --models is {' or '.join(MODEL_NAMES)}", flush=True)
    load_end = load_average()
    samples.append(load_end[0])
    results["load"] = {"start": list(load_start), "end": list(load_end), "samples_1min": samples}
    results["load_caveat"] = _caveat(samples, args.threads, results["machine"]["cores"] or 1)
    results["duration_s"] = time.perf_counter() - clock
    results["part_durations_s"] = durations
    results["bars"] = {name: bar for part in PARTS if results.get(part) for name, bar in results[part]["bars"].items()}
    written = write_report(results, args.out)
    if results.get("offload"):
        context = {
            **{k: results[k] for k in ("machine", "commit", "started")},
            "command": results["settings"]["command"] + " (its offload part)",
            "quick": args.quick,
            "duration_s": durations["offload"],
            "load_samples": samples[-2:],
        }
        written += write_results(results["offload"], context, args.out)
    if results.get("throughput"):
        from benchmarks.pipeline_throughput import write_results as write_throughput

        context = {
            **{k: results[k] for k in ("machine", "commit", "started")},
            "command": results["settings"]["command"] + " (its throughput part)",
            "quick": args.quick,
            "duration_s": durations["throughput"],
            "load_samples": samples[-2:],
        }
        written += write_throughput(results["throughput"], context, args.out)
    return announce(results["bars"], written)


if __name__ == "__main__":
    sys.exit(main())
