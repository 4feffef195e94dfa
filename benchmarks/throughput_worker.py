"""torchrun worker for benchmarks/pipeline_throughput.py: one model's baselines and pipelines, two gloo ranks.

    torchrun --nproc-per-node 2 benchmarks/throughput_worker.py SETTINGS.json OUT_DIR

Each rank runs with one torch thread and writes ``OUT_DIR/rank<r>.json``. It
plans every pipeline variant first (``fxsplit.pipeline_stages`` under the
variant's options; ``Schedule1F1B``, or ``ScheduleGPipe`` where ``schedule`` is ``"gpipe"``,
with ``chunks`` micro-batches, rank i
running stage i; a one-stage plan runs on rank 0 alone, accumulating the
micro-batches' gradients as GPipe does, while rank 1 waits), then times these
phases, each ``warmup`` untimed steps first, then ``rounds`` rounds of
``steps`` steps of every phase in turn (interleaved, so that other work's load
falls on all of them alike):

* ``single``: rank 0 trains the whole model alone (forward, backward and SGD on
  the whole batch) while rank 1 waits: one process, one thread;
* ``microbatched``: rank 0 trains the whole model alone on the same
  micro-batches as the pipelines, one after another, accumulating their
  gradients: the work a two-stage pipeline shares between the ranks;
* ``ceiling``: both ranks train their own whole copy at once, independently:
  what two processes on this machine get;
* one phase per pipeline variant.

A timed run of steps starts at a barrier; its wall time runs to the end of the
rank's last step, and its CPU time is the process's over the same steps (all
its threads: CPU / wall below 1 says the rank waited, for a core or for its
neighbour). Then rank 0 times every stage's forward and backward per
micro-batch by itself (:func:`stage_times`), and, when ``four_stages`` is set,
plans each variant over four devices and times those stages the same way (two
cores cannot run four stages at once, so they get no pipeline run), while rank
1 waits.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script by torchrun
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.throughput_models import ModelSpec, batched, hand_pins, model_spec  # noqa: E402

__all__ = ["loss_fn", "main", "stage_times", "variant_options"]

LR = 1e-3
DEVICES = ("cpu:0", "cpu:1")


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over classes (ResNet) or over every position's vocabulary (GPT-2)."""
    return nn.functional.cross_entropy(output.flatten(0, -2), target.flatten())


def _load() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def _timed(steps: int, first: int, step: Callable[[int], None]) -> dict[str, Any]:
    """``steps`` calls of ``step`` (inputs ``first``, ``first + 1``, ...) after a barrier: wall and CPU seconds."""
    dist.barrier()
    load, start, cpu = _load()[0], time.perf_counter(), time.process_time()
    times = []
    for i in range(steps):
        began = time.perf_counter()
        step(first + i)
        times.append(time.perf_counter() - began)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "steps": steps, "step_s": times, "load_1min": load}


def _plain_step(model: nn.Module, spec: ModelSpec, chunks: int = 1) -> Callable[[int], None]:
    """A training step of ``model`` on the whole batch, in ``chunks`` micro-batches one after another."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(i: int) -> None:
        x, y = spec.inputs(i)
        optimizer.zero_grad()
        for mx, my in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
            loss_fn(model(mx), my).backward()
        optimizer.step()

    return step


def variant_options(name: str, spec: ModelSpec, devices: tuple[str, ...] = DEVICES) -> dict[str, Any]:
    """fxsplit options of a pipeline variant: ``default`` (no objective), ``hand`` (pins), or an objective."""
    if name == "default":
        return {}
    if name == "hand":
        return {"pins": hand_pins(spec, devices)}
    if name == "profiled":
        return {"profile": True}
    return {"objective": name}


def _one_device_budget(spec: ModelSpec, model: nn.Module, chunks: int) -> int:
    """What the whole model needs on one device for training (fxsplit's own estimate)."""
    import fxsplit

    x, _ = spec.inputs(0)
    plan = fxsplit.plan(
        model, {DEVICES[0]: "1TiB"}, example_inputs=(x,), trace=spec.trace, mode="training", pipeline={"chunks": chunks}
    )
    return int(plan.memory[DEVICES[0]]["total"])


def _stage_blocks(spec: ModelSpec, model: nn.Module, modules: tuple[nn.Module, ...]) -> list[dict[str, Any]]:
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    rows = []
    for module in modules:
        held = {names.get(id(p), "?") for p in module.parameters()}
        blocks = [b for b in spec.blocks if any(n.startswith(b + ".") for n in held)]
        rows.append(
            {
                "parameters": sum(p.numel() for p in module.parameters()),
                "blocks": [blocks[0], blocks[-1]] if blocks else [],
                "block_count": len(blocks),
            }
        )
    return rows


def stage_times(modules: tuple[nn.Module, ...], spec: ModelSpec, chunks: int, repeats: int) -> list[dict[str, float]]:
    """Median forward and backward seconds per micro-batch of each stage, each run by itself in this process.

    Stage 0 takes a micro-batch; stage i > 0 takes stage i-1's outputs (detached, requiring grad when
    floating). The last stage's backward starts from the loss; the others' from ones of their outputs' shapes.
    """
    x, y = spec.inputs(0)
    micro = list(zip(x.chunk(chunks), y.chunk(chunks), strict=True))
    forward: list[list[float]] = [[] for _ in modules]
    backward: list[list[float]] = [[] for _ in modules]
    for _ in range(repeats):
        for inputs, target in micro:
            args: tuple[torch.Tensor, ...] = (inputs,)
            kept = []
            for index, module in enumerate(modules):
                began = time.perf_counter()
                out = module(*args)
                forward[index].append(time.perf_counter() - began)
                kept.append((args, out))
                outs = out if isinstance(out, tuple) else (out,)
                args = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outs)
            for index in reversed(range(len(modules))):
                args, out = kept[index]
                began = time.perf_counter()
                if index == len(modules) - 1:
                    loss_fn(out, target).backward()
                else:
                    grads = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
                    torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
                backward[index].append(time.perf_counter() - began)
            for module in modules:
                module.zero_grad(set_to_none=True)
    skip = len(micro)  # the first repeat warms up
    rows = []
    for f, b in zip(forward, backward, strict=True):
        f, b = (f[skip:] or f), (b[skip:] or b)
        rows.append({"forward_s": float(torch.tensor(f).median()), "backward_s": float(torch.tensor(b).median())})
    return rows


def _pipeline(spec: ModelSpec, settings: dict[str, Any], variant: str, rank: int, budget: int) -> dict[str, Any]:
    """The variant's stages on this rank: what the plan holds, and a training step (``"step"``, not saved)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    import fxsplit

    chunks, world = settings["chunks"], dist.get_world_size()
    model = spec.build()
    x, _ = spec.inputs(0)
    began = time.perf_counter()
    budgets = {d: budget for d in DEVICES}
    planned: Any = budgets
    if variant == "profiled":  # measured times differ per process: rank 0 plans, every rank applies its plan
        planned = _rank0_plan(model, budgets, x, chunks, spec, rank)
    stages = fxsplit.pipeline_stages(
        model,
        planned,
        example_inputs=(x,),
        chunks=chunks,
        trace=spec.trace,
        **({} if variant == "profiled" else {"mode": "training", **variant_options(variant, spec)}),
    )
    result: dict[str, Any] = {
        "plan_s": time.perf_counter() - began,
        "stages": len(stages),
        "devices": [s.device for s in stages.specs],
        "transfer_bytes": stages.plan.transfer_bytes,
        "tied": {k: list(v) for k, v in stages.tied.items()},
        "per_stage": _stage_blocks(spec, model, stages.modules),
        "modules": stages.modules,
    }
    if len(stages) == world:
        stage = stages.build_stage(rank)
        kind = ScheduleGPipe if settings.get("schedule") == "gpipe" else Schedule1F1B
        schedule = kind(stage, n_microbatches=chunks, loss_fn=loss_fn)
        optimizer = torch.optim.SGD(stage.submod.parameters(), lr=LR)

        def step(i: int) -> None:
            inputs, target = spec.inputs(i)
            optimizer.zero_grad()
            if rank == 0:
                schedule.step(inputs)
            elif rank == world - 1:
                schedule.step(target=target, losses=[])
            else:
                schedule.step()
            stages.reduce_tied_grads(rank)
            optimizer.step()

        return {**result, "step": step}
    if len(stages) == 1:  # the whole model on rank 0, micro-batches accumulated; the other rank idles
        module = stages.modules[0]
        alone_optimizer = torch.optim.SGD(module.parameters(), lr=LR)

        def alone(i: int) -> None:
            if rank != 0:
                return
            inputs, target = spec.inputs(i)
            alone_optimizer.zero_grad()
            for mx, my in zip(inputs.chunk(chunks), target.chunk(chunks), strict=True):
                loss_fn(module(mx), my).backward()
            alone_optimizer.step()

        return {**result, "step": alone}
    raise RuntimeError(f"{len(stages)} stages for {world} ranks")


def _rank0_plan(
    model: nn.Module, budgets: dict[str, int], x: torch.Tensor, chunks: int, spec: ModelSpec, rank: int
) -> Any:
    """The profiled plan, made on rank 0 (its ops timed there, the other rank waiting) and sent to every rank."""
    import fxsplit

    message: list[Any] = [None]
    if rank == 0:
        try:
            made = fxsplit.plan(
                model,
                budgets,
                example_inputs=(x,),
                pipeline=fxsplit.PipelineConfig(chunks, processes=True),  # for pipeline_stages: one process per stage
                trace=spec.trace,
                mode="training",
                profile=True,
            )
            message = [made.to_yaml()]
        except Exception as error:  # noqa: BLE001 - sent on, so every rank fails alike
            message = [error]
    dist.broadcast_object_list(message, src=0)
    if isinstance(message[0], Exception):
        raise message[0]
    return fxsplit.Plan.from_yaml(message[0])


def _four_stages(spec: ModelSpec, settings: dict[str, Any], variant: str, budget: int) -> dict[str, Any]:
    """The variant's plan over four devices, its stages timed one by one in this process (no pipeline run)."""
    import fxsplit

    devices = tuple(f"cpu:{i}" for i in range(4))
    model = spec.build()
    x, _ = spec.inputs(0)
    chunks, budgets = settings["chunks"], {d: budget for d in devices}
    planned: Any = budgets
    options: dict[str, Any] = {"mode": "training", **variant_options(variant, spec, devices)}
    if variant == "profiled":  # planned here, in this process alone (pipeline_stages refuses to across ranks)
        pipeline = fxsplit.PipelineConfig(chunks, processes=True)
        planned = fxsplit.plan(model, budgets, example_inputs=(x,), pipeline=pipeline, trace=spec.trace, **options)
        options = {}
    stages = fxsplit.pipeline_stages(model, planned, example_inputs=(x,), chunks=chunks, trace=spec.trace, **options)
    return {
        "stages": len(stages),
        "devices": [s.device for s in stages.specs],
        "transfer_bytes": stages.plan.transfer_bytes,
        "per_stage": _stage_blocks(spec, model, stages.modules),
        "stage_times": stage_times(stages.modules, spec, settings["chunks"], settings["stage_repeats"]),
    }


def _guarded(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run(*args)``, or the error it raised (every rank plans the same, so every rank fails alike)."""
    try:
        return run(*args)
    except Exception as error:  # noqa: BLE001 - reported in the results, exactly
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}


def _rounds(phases: dict[str, Callable[[int], None]], settings: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Every phase's warm-up steps, then ``rounds`` rounds of ``steps`` steps of each phase in turn.

    Interleaved so that the load other work puts on the machine falls on every phase alike.
    """
    for step in phases.values():
        _timed(settings["warmup"], 0, step)
    timings: dict[str, list[dict[str, Any]]] = {name: [] for name in phases}
    for index in range(settings["rounds"]):
        for name, step in phases.items():
            timings[name].append(_timed(settings["steps"], settings["warmup"] + index * settings["steps"], step))
    return timings


def main() -> None:
    settings = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = batched(model_spec(settings["model"], settings["tiny"]), settings["batch"])
    record: dict[str, Any] = {"rank": rank, "load_start": list(_load())}

    model = spec.build()
    record["parameters"] = sum(p.numel() for p in model.parameters())
    budget = _one_device_budget(spec, spec.build(), settings["chunks"])
    record["one_device_bytes"] = budget
    record["budget_bytes"] = int(budget * settings["budget_factor"])
    pipelines = {}
    for variant in settings["variants"]:
        pipelines[variant] = _guarded(_pipeline, spec, settings, variant, rank, record["budget_bytes"])
        dist.barrier()
    single = _plain_step(model, spec)
    microbatched = _plain_step(model, spec, settings["chunks"])
    idle: Callable[[int], None] = lambda i: None  # noqa: E731
    phases = {"single": single if rank == 0 else idle, "microbatched": microbatched if rank == 0 else idle}
    phases["ceiling"] = single
    phases.update({variant: p["step"] for variant, p in pipelines.items() if "step" in p})
    timings = _rounds(phases, settings)
    record["single"], record["ceiling"] = timings.pop("single"), timings.pop("ceiling")
    record["microbatched"] = timings.pop("microbatched")
    record["variants"] = {}
    for variant, pipeline in pipelines.items():
        modules = pipeline.pop("modules", None)
        pipeline.pop("step", None)
        if variant in timings:
            pipeline["timing"] = timings[variant]
            if rank == 0:
                pipeline["stage_times"] = stage_times(modules, spec, settings["chunks"], settings["stage_repeats"])
            dist.barrier()
        record["variants"][variant] = pipeline
    del pipelines, phases, timings
    if settings.get("four_stages"):
        record["four_stages"] = {}
        for variant in settings["variants"]:
            if rank == 0:
                record["four_stages"][variant] = _guarded(_four_stages, spec, settings, variant, record["budget_bytes"])
            dist.barrier()
    record["load_end"] = list(_load())
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
