"""Planning speed: time to a runnable split model, scaling of the plan step, a 70B model on meta.

* **Time to split** (N = 2, loose budgets): fxsplit's stages timed one by one
  through the functions :func:`fxsplit.fxsplit` wires (trace; plan = cost
  model + partition + plan data; codegen = moving the weights + emitting the
  GraphModule), and the public call end to end; against Accelerate's
  ``infer_auto_device_map`` (the documented call) + ``dispatch_model``.
* **Scaling**: :func:`fxsplit.partition.solve.partition` on synthetic deep, wide and
  long-skip problems (:mod:`benchmarks.synthetic`) of 1k to 100k ops over 4 devices,
  and on the cost model of real FX graphs (deep MLPs traced with torch.fx);
  slope of log(time) on log(ops).
* **The whole** ``fxsplit.plan()`` on deep MLPs of 1k to 100k ops, split into
  trace / build / memory / partition / make_plan / other
  (:mod:`benchmarks.plan_stages`), and the slope of ``plan() - trace``.
* **Llama-70B** on ``meta`` over 8 devices, in a subprocess
  (:mod:`benchmarks.llama70b`) for its own peak RSS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import torch

import fxsplit
from benchmarks.accelerate_maps import accelerate_map, dispatch, logical_cpu_devices
from benchmarks.measure import fit_slope, median, time_call
from benchmarks.models import MLP, Case
from benchmarks.plan_stages import PLAN_SIZES, QUICK_PLAN_SIZES, plan_scaling
from benchmarks.synthetic import deep, skips, wide
from fxsplit.codegen.emitter import emit, move_weights
from fxsplit.cost.build import build_problem
from fxsplit.options import Budgets
from fxsplit.partition.solve import partition
from fxsplit.planning.build import make_plan
from fxsplit.tracing.capture import trace

__all__ = ["run_planning"]

SCALING_SIZES = (1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000)
QUICK_SIZES = (1_000, 2_000, 5_000)
REAL_DEPTHS = (500, 1_000, 2_500)
QUICK_DEPTHS = (500,)
ROOT = Path(__file__).resolve().parents[1]


def _budgets(model: torch.nn.Module, n: int, factor: float = 1.5) -> dict[str, int]:
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return {f"cpu:{k}": int(factor * sum(seen.values()) / n) for k in range(n)}


def _fxsplit_stages(case: Case, budgets: dict[str, int]) -> tuple[dict[str, float], torch.nn.Module]:
    model = case.build()
    device_budgets = Budgets.parse(budgets)
    devices = list(device_budgets.devices)
    t_trace, traced = time_call(
        lambda: trace(model, example_inputs=case.inputs(), example_kwargs=case.kwargs() or None)
    )

    def plan_step() -> Any:
        costs = build_problem(traced.graph_module, model, device_index={d: k for k, d in enumerate(devices)})
        solution = partition(costs.problem, device_budgets.caps(), device_names=devices)
        made = make_plan(
            costs,
            traced.graph_module,
            solution,
            device_budgets,
            output_device=None,
            trace=traced.method,
            objective="min_transfer",
        )
        return costs, made

    t_plan, (costs, plan) = time_call(plan_step)

    def codegen() -> torch.nn.Module:
        move_weights(traced.graph_module, plan, costs.weights + costs.unused)
        return emit(traced.graph_module, plan)

    t_codegen, split = time_call(codegen)
    return {"trace": t_trace, "plan": t_plan, "codegen": t_codegen}, split


def _accelerate_stages(case: Case, budgets: dict[str, int], offload_dir: str) -> tuple[dict[str, float], Any]:
    model = case.build()
    t_map, device_map = time_call(lambda: accelerate_map(model, list(budgets.values()), case.block_classes))
    t_dispatch, dispatched = time_call(lambda: dispatch(model, device_map, offload_dir=offload_dir))
    return {"map": t_map, "dispatch": t_dispatch}, dispatched


def _same_output(split: Any, case: Case, reference: Any) -> bool:
    with torch.no_grad():
        out = split(*case.inputs(), **case.kwargs())
    first = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values())) if isinstance(out, dict) else out
    return bool(torch.allclose(first.to("cpu"), reference, atol=1e-4, rtol=1e-4))


def time_to_split(case: Case, repeats: int, n: int = 2) -> dict[str, Any]:
    """Median seconds of each stage for fxsplit and Accelerate, and whether both outputs match the model's."""
    reference_model = case.build()
    budgets = _budgets(reference_model, n)
    with torch.no_grad():
        out = reference_model(*case.inputs(), **case.kwargs())
    reference = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values())) if isinstance(out, dict) else out
    fx_runs, acc_runs, api_runs, correct = [], [], [], {}
    for r in range(repeats + 1):  # the first round warms up (imports, first export) and is not counted
        stages, split = _fxsplit_stages(case, budgets)
        model = case.build()
        api = time_call(
            partial(
                fxsplit.fxsplit,
                model,
                budgets,
                example_inputs=case.inputs(),
                example_kwargs=case.kwargs() or None,
                mode="weights",
            )
        )[0]
        with tempfile.TemporaryDirectory() as offload_dir:
            stages_acc, dispatched = _accelerate_stages(case, budgets, offload_dir)
            if r == 0:
                with logical_cpu_devices():
                    correct = {
                        "fxsplit": _same_output(split, case, reference),
                        "accelerate": _same_output(dispatched, case, reference),
                    }
        if r > 0:
            fx_runs.append(stages)
            api_runs.append(api)
            acc_runs.append(stages_acc)
    fx = {k: median([run[k] for run in fx_runs]) for k in fx_runs[0]}
    acc = {k: median([run[k] for run in acc_runs]) for k in acc_runs[0]}
    return {
        "model": case.name,
        "n_devices": n,
        "repeats": repeats,
        "fxsplit": {**fx, "total": sum(fx.values()), "api_total": median(api_runs)},
        "accelerate": {**acc, "total": sum(acc.values())},
        "outputs_match": correct,
    }


def scaling(sizes: Sequence[int], repeats: int) -> dict[str, Any]:
    """Median seconds of ``partition`` per synthetic problem size, and the log-log slope."""
    curves: dict[str, Any] = {}
    for name, make in (("deep", deep), ("wide", wide), ("skips", skips)):
        points = []
        for size in sizes:
            problem = make(size)
            total = sum(v.weight for v in problem.values)
            budgets = [int(1.2 * total / 4)] * 4
            reps = repeats if size <= 10_000 else max(1, repeats // 2)
            times = [time_call(partial(partition, problem, budgets))[0] for _ in range(reps)]
            points.append({"ops": size, "values": len(problem.values), "seconds": median(times), "repeats": reps})
        fit = [p for p in points if p["ops"] >= 2_000] or points
        curves[name] = {"points": points, "slope": fit_slope([p["ops"] for p in fit], [p["seconds"] for p in fit])}
    return curves


def real_graphs(depths: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    """``partition`` and the whole ``fxsplit.plan`` on deep MLPs traced with torch.fx."""
    rows = []
    for depth in depths:
        model = MLP(dim=8, depth=depth).eval()
        x = torch.randn(2, 8)
        traced = trace(model, example_inputs=(x,), mode="fx")
        costs = build_problem(traced.graph_module, model, device_index={})
        budgets = list(_budgets(model, 4, 1.2).values())
        named = {f"cpu:{k}": b for k, b in enumerate(budgets)}
        times = [time_call(partial(partition, costs.problem, budgets))[0] for _ in range(repeats)]
        plan_time = time_call(partial(fxsplit.plan, model, named, example_inputs=(x,), trace="fx", mode="weights"))[0]
        rows.append(
            {
                "model": f"mlp(depth={depth})",
                "graph_nodes": len(traced.graph_module.graph.nodes),
                "ops": costs.problem.num_ops,
                "partition_s": median(times),
                "fxsplit_plan_s": plan_time,
            }
        )
    return rows


def llama70b(layers: int, threads: int) -> dict[str, Any]:
    """Run :mod:`benchmarks.llama70b` in a fresh interpreter and return its JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.llama70b", "--layers", str(layers), "--threads", str(threads)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["failed"], "layers": layers}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def planning_bars(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pass/fail of the planning-speed bars."""
    bars: dict[str, dict[str, Any]] = {}
    for name, curve in result["scaling"].items():
        by_size = {p["ops"]: p["seconds"] for p in curve["points"]}
        if 2_000 in by_size:
            bars[f"{name}: plan <= 50 ms at 2k ops"] = {
                "pass": by_size[2_000] <= 0.05,
                "value": f"{1000 * by_size[2_000]:.1f} ms",
            }
        if 100_000 in by_size:
            bars[f"{name}: plan <= 10 s at 100k ops"] = {
                "pass": by_size[100_000] <= 10.0,
                "value": f"{by_size[100_000]:.2f} s",
            }
        bars[f"{name}: near-linear (log-log slope <= 1.2)"] = {
            "pass": curve["slope"] <= 1.2,
            "value": f"{curve['slope']:.2f}",
        }
    stages = result.get("plan_stages") or {}
    if len(stages.get("points", ())) > 2:
        slope = stages["slopes"]["untraced"]
        bars["plan() minus trace: near-linear (log-log slope <= 1.1)"] = {"pass": slope <= 1.1, "value": f"{slope:.2f}"}
        last = stages["points"][-1]
        factor = last["untraced"] / last["partition"]
        bars[f"plan() minus trace <= 2 x partition() at {last['ops']} ops"] = {
            "pass": factor <= 2.0,
            "value": f"{factor:.1f}x",
        }
    big = result.get("llama70b") or {}
    if "trace_plan_s" in big and big.get("layers") == 80:
        bars["Llama-70B on meta, 8 devices: trace + plan <= 30 s"] = {
            "pass": big["trace_plan_s"] <= 30.0,
            "value": f"{big['trace_plan_s']:.1f} s",
        }
        bars["Llama-70B on meta: peak RSS <= 3 GiB"] = {
            "pass": big["peak_rss_gib"] <= 3.0,
            "value": f"{big['peak_rss_gib']:.2f} GiB",
        }
    return bars


def run_planning(cases: Sequence[Case], *, quick: bool, threads: int, llama_layers: int | None) -> dict[str, Any]:
    """Every planning-speed measurement and its bars."""
    repeats = 1 if quick else 3
    result: dict[str, Any] = {
        "time_to_split": [time_to_split(case, repeats) for case in cases],
        "scaling": scaling(QUICK_SIZES if quick else SCALING_SIZES, 3 if quick else 5),
        "real_graphs": real_graphs(QUICK_DEPTHS if quick else REAL_DEPTHS, 3),
        "plan_stages": plan_scaling(QUICK_PLAN_SIZES if quick else PLAN_SIZES, 1 if quick else 3),
        "llama70b": llama70b(llama_layers, threads) if llama_layers else None,
    }
    result["bars"] = planning_bars(result)
    return result
