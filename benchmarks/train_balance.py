"""Measured stage balance of a training plan, in one process.

``python -m benchmarks.train_balance MODEL STAGES [PROFILE] [--repeats N]``:

MODEL is ``resnet50`` or ``gpt2`` (full size, :mod:`benchmarks.throughput_models`), at the pipelined-throughput
benchmark's batches: ResNet-50 128 images and GPT-2 32 sequences, in 8 micro-batches. STAGES logical CPU
devices (``cpu:0`` ...) get the benchmark's budgets (1.25x what the whole model needs on one), so the plan
is the throughput objective's choice alone; PROFILE
``1`` plans with ``profile=True``, ``0`` (the default) from the estimate.

Each stage of ``fxsplit.pipeline_stages`` then runs one micro-batch forward, all stages in order, and back
(each stage's backward from the gradient the next one handed it, as a pipeline does), on one thread;
the script prints the plan, the planned and the measured forward + backward milliseconds per stage
(medians of ``--repeats`` runs after one warm-up) and the measured balance, slowest stage / mean stage.
Copies between stages are not timed (they are a few percent of a stage on one CPU). It is the
in-process check of the issue's bar "slowest / mean stage <= 1.10"; the machine's load skews it, so
compare runs of one session.

``--bound`` instead measures each op's forward and backward alone (``fxsplit.cost.profile``, as
``profile=True`` does, one micro-batch) and prints the best balance any contiguous split of the op order
into STAGES non-empty stages can reach with those times (copies left out): the floor under the bar for a
model with one op heavier than a mean stage, such as GPT-2's tied LM head.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import fxsplit
from benchmarks.throughput_models import ModelSpec, batched, model_spec
from fxsplit.pipeline.microbatch import first_microbatch
from fxsplit.planning.timetable import stage_totals, time_lines

BATCHES = {"resnet50": 128, "gpt2": 32}  # the throughput benchmark's batches, in CHUNKS micro-batches
CHUNKS = 8


def measure(
    model: torch.nn.Module, plan: fxsplit.Plan, batch: torch.Tensor, trace: str, repeats: int
) -> tuple[list[float], float]:
    """Median seconds of each stage's forward + backward on one micro-batch, and the median of the runs'
    balances (slowest / mean stage of one run: steadier than the medians' when the machine's load drifts)."""
    stages = fxsplit.pipeline_stages(model, plan, example_inputs=(batch,), chunks=CHUNKS, trace=trace, mode="training")
    micro, _ = first_microbatch((batch,), None, CHUNKS)
    modules = [copy.deepcopy(m).to(torch.device(s.device)) for m, s in zip(stages.modules, stages.specs, strict=True)]
    runs = []
    for run in range(repeats + 1):
        values: tuple = tuple(micro)
        forward, outputs, inputs = [], [], []
        for module in modules:
            values = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in values)
            inputs.append(values)
            start = time.perf_counter()
            out = module(*values)
            forward.append(time.perf_counter() - start)
            outputs.append(out)
            values = out if isinstance(out, tuple) else (out,)
        backward = [0.0] * len(modules)
        grads = None
        for i in reversed(range(len(modules))):
            out = outputs[i] if isinstance(outputs[i], tuple) else (outputs[i],)
            given = [torch.ones_like(t) for t in out] if grads is None else grads
            pairs = [(t, g) for t, g in zip(out, given, strict=True) if t.requires_grad]
            start = time.perf_counter()
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            backward[i] = time.perf_counter() - start
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs[i]]
        if run:  # the first run warms up
            runs.append([f + b for f, b in zip(forward, backward, strict=True)])
    balances = [max(run) / (sum(run) / len(run)) for run in runs]
    return [statistics.median(stage) for stage in zip(*runs, strict=True)], statistics.median(balances)


def contiguous_bound(seconds: list[float], stages: int) -> tuple[float, list[float]]:
    """The smallest slowest-stage / mean-stage over splits of ``seconds`` into ``stages`` non-empty runs."""
    count = len(seconds)
    best: dict[tuple[int, int], tuple[float, list[float]]] = {}  # (first op, stages left) -> (slowest, sums)
    prefix = [0.0]
    for s in seconds:
        prefix.append(prefix[-1] + s)
    for left in range(1, stages + 1):
        for first in range(count - left, -1, -1):
            if left == 1:
                best[first, 1] = (prefix[count] - prefix[first], [prefix[count] - prefix[first]])
                continue
            options = []
            for end in range(first + 1, count - left + 2):
                slowest, sums = best[end, left - 1]
                here = prefix[end] - prefix[first]
                options.append((max(here, slowest), [here, *sums]))
            best[first, left] = min(options, key=lambda option: option[0])
    slowest, sums = best[0, stages]
    return slowest / (prefix[count] / stages), sums


def bound(model: torch.nn.Module, spec: ModelSpec, batch: torch.Tensor, stages: int) -> None:
    from fxsplit.api import trace_and_plan
    from fxsplit.cost.profile import profile_op_seconds

    micro, _ = first_microbatch((batch,), None, CHUNKS)
    planned = trace_and_plan(model, {"cpu:0": "1TiB"}, tuple(micro), {"trace": spec.trace, "mode": "training"})
    graph, ops = planned.traced.graph_module, planned.costs.ops
    seconds = profile_op_seconds(graph, ops, tuple(micro), {}, "cpu", repeats=5, backward=True)
    heaviest = max(range(len(ops)), key=lambda i: seconds[i])
    balance, sums = contiguous_bound(seconds, stages)
    total, top = sum(seconds) * 1e3, seconds[heaviest] * 1e3
    print(f"ops {len(ops)}, fwd+bwd {total:.0f} ms; heaviest {ops[heaviest].name} {top:.0f} ms")
    print(f"best contiguous {stages} stages: ms", [f"{s * 1e3:.0f}" for s in sums], f"balance {balance:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(BATCHES))
    parser.add_argument("stages", type=int)
    parser.add_argument("profile", type=int, nargs="?", default=0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bound", action="store_true", help="the best contiguous balance from per-op times")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = batched(model_spec(args.model, False), BATCHES[args.model])
    model = spec.build()
    batch, _ = spec.inputs(0)
    if args.bound:
        bound(model, spec, batch, args.stages)
        return
    whole = fxsplit.plan(
        model, {"cpu:0": "1TiB"}, example_inputs=(batch,), trace=spec.trace, mode="training", pipeline=CHUNKS
    )
    budget = int(1.25 * whole.memory["cpu:0"]["total"])  # as the throughput benchmark: memory does not bind
    budgets = {f"cpu:{k}": budget for k in range(args.stages)}
    start = time.perf_counter()
    plan = fxsplit.plan(
        model,
        budgets,
        example_inputs=(batch,),
        pipeline=fxsplit.PipelineConfig(CHUNKS, processes=True),  # the stages pipeline_stages runs
        trace=spec.trace,
        mode="training",
        profile=bool(args.profile),
    )
    print(f"planned in {time.perf_counter() - start:.1f} s")
    print({d: (m[0], m[-1]) for d, m in plan.modules.items() if m})
    print("\n".join(time_lines(plan.timing)))
    measured, balance = measure(model, plan, batch, spec.trace, args.repeats)
    planned = list(stage_totals(plan.timing).values())
    mean = sum(measured) / len(measured)
    print("planned ms ", [f"{s * 1e3:.0f}" for s in planned])
    stages = [f"{s * 1e3:.0f}" for s in measured]
    print("measured ms", stages, f"balance {max(measured) / mean:.2f}", f"(median of runs' {balance:.2f})")


if __name__ == "__main__":
    main()
