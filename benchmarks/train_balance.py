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
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import fxsplit
from benchmarks.throughput_models import batched, model_spec
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(BATCHES))
    parser.add_argument("stages", type=int)
    parser.add_argument("profile", type=int, nargs="?", default=0)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = batched(model_spec(args.model, False), BATCHES[args.model])
    model = spec.build()
    batch, _ = spec.inputs(0)
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
        pipeline=CHUNKS,
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
