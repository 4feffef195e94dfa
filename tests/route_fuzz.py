"""Generated programs reaching a split by the other routes users take: a fuzz to run by hand.

:mod:`split_fuzz` calls ``fxsplit.fxsplit`` on a real model. Here each seed's program (:mod:`random_programs`, in
float64 on ``cpu:0``..``cpu:2``, traced by torch.fx or torch.export) takes one route, chosen by the seed
(:func:`route_of`: ``ROUTES[seed % 4]`` below 61000, ``ROUTES_MORE[seed % 3]`` from 61000 on, ``ROUTES_THIRD[seed %
3]`` from 62000 on, so that the seeds run before a set of routes was added keep their scenario), and is compared with
the unsplit model:

* ``saved_plan``: ``fxsplit.plan`` (budgets at a part of the one-device total, or each segment pinned), the plan
  written and read back (``to_yaml``/``Plan.from_yaml``, or ``to_dict`` through JSON and ``Plan.from_dict``), must
  equal the plan, then ``fxsplit.apply`` to a fresh copy of the model; outputs and, in training, every gradient
  compared, and the applied code compared with ``fxsplit.fxsplit``'s own split under the same plan;
* ``checkpoint``: the model's weights (changed from ``make()``'s) saved with ``safetensors`` or ``torch.save``,
  the program built again without weights (``fxsplit.empty_weights()`` or ``torch.device("meta")``), and split
  from the file: ``fxsplit.fxsplit(meta_model, ..., checkpoint=path)``, or ``fxsplit.apply(meta_model, plan,
  checkpoint=path)`` of a plan made on the real model; outputs, gradients and the loaded state compared;
* ``offload``: inference with ``offload={"host", "disk", "dir"}`` and each device's budget about the least at
  which it plans (found by bisection, device after device), with the segments pinned or not; from the real model
  or from a checkpoint (a meta model); outputs compared (``streamed``: the bytes streamed per forward);
* ``pipeline``: ``pipeline=fxsplit.PipelineConfig(chunks=2, 3 or 4)`` (a divisor of the batch), inference
  (``.eval()``) or training (activation checkpointing or not), with ``batch_stats="error"`` so that fxsplit
  refuses a program whose micro-batches cannot give the whole batch's result (export traces with
  ``dynamic_shapes="batch"``, so that it can tell); outputs and gradients compared;
* ``spec``: a YAML spec file (specs/README.md) written to the temporary directory: ``devices`` with budgets at a
  part of the one-device total (bytes, ``KiB`` or ``kB``; one device's as ``{budget, reserve}``, or a top-level
  ``reserve``), ``trace``, ``mode`` (``optimizer: sgd`` in training), ``pin`` (each segment by its module path) or
  ``together``, ``objective``, ``contiguous``, ``replicate``, ``output_device``; split with
  ``fxsplit.fxsplit(model, spec=path, example_inputs=...)`` (or ``spec=fxsplit.load_spec(path)``); outputs and
  gradients compared, and the plan must have the spec's budgets, keep pinned segments' ops on their devices, and
  equal ``fxsplit.plan`` of a copy with the same options given as keywords;
* ``device_map``: an Accelerate-style map (module or tensor name -> device) of each segment to a device (those
  with weights on two at least), of ``""`` (the whole model) with some segments elsewhere, or of where
  ``fxsplit.plan``'s own placement at tighter budgets puts the weights (by segment, module or tensor, as
  Accelerate writes one); weights outside the segments (a ``head``) get keys too. Split by
  ``fxsplit.fxsplit(model, budgets, device_map=...)``, by a ``device_map:`` in a spec file, or by
  ``fxsplit.apply`` of ``fxsplit.from_device_map(model, map, budgets or None)`` (its values as device names, or as
  Accelerate's ints translated with ``devices=``); outputs and gradients compared, and every parameter and buffer
  a key covers must be where its longest key puts it in ``plan.param_devices`` (a tensor on a logical CPU device
  reports the plain ``cpu``, so the plan is what is checked, and the device check enforces it while the split
  runs; ``holds``: the devices holding weights, ``used``: those running ops);
* ``dtype_checkpoint``: a float32 copy of the (changed) float64 model saved (safetensors or ``torch.save``), the
  program built again on meta at float64 (``empty_weights`` or ``torch.device("meta")``) and split with
  ``fxsplit.fxsplit(meta_model, ..., checkpoint=path, dtype="float32", example_inputs=<float32 inputs>)``, or
  ``fxsplit.apply(meta_model, plan, checkpoint=path)`` of a plan of the real float64 model made with
  ``dtype="float32"``; the reference is the float32 copy run eagerly on float32 inputs; outputs, gradients and the
  loaded state compared at float32 (:func:`_close32`: the same dtype, and within ``RTOL32`` = 1e-5 of each
  element or ``ATOL32`` = 1e-6 of the tensor's largest magnitude (at least 1): some 80 float32 steps, room for a
  reduction the traced graph orders otherwise, where the splits seen so far give eager's bits exactly, and far
  below what weights not loaded (changed by about 0.05) or a model left at float64 (another dtype) give);
* from 62000 on (:mod:`route_fuzz_more`, which says more): ``resized``, split with the example inputs (export with
  ``dynamic_shapes="batch"``) and run at another batch size, smaller or larger, against eager at that size;
  ``train_steps``, three optimizer steps (SGD with momentum, Adam or AdamW; sometimes gradients accumulated over
  two backward passes, planned with ``accumulate_grads=True``; sometimes two weights tied) on the split and on an
  unsplit copy, then both ``state_dict()`` and a fourth forward compared, and ``split.parameters()`` must give
  each parameter once; ``cli``: the program written to a file with a factory, a spec file, and the command line
  (``fxsplit.cli.main``, in this process) run for ``plan -o``, ``check --plan`` and ``code --plan``, the saved plan
  equal to ``fxsplit.plan``'s, the printed code ``fxsplit.apply``'s, and the applied split compared with eager.

:func:`run_seed` says how it went:

* ``equal``: the split computed what the model computes (and, for saved plans, the plan round-tripped);
* ``refused``: fxsplit refused with one of its own errors (an ``FxsplitError``), when planning, or (a pipeline, or
  an export split called at another batch size) at its first forward; or the command line exited 1 or 2 where
  ``fxsplit.plan`` raises the same kind of error (the third routes' rows keep the error's first line: ``reason``);
* ``eager_fails``: the unsplit program itself does not run (the generator makes some that do not);
* ``wrong``: outputs, gradients, state or the saved plan differ; ``crash``: any other exception (``at``: the
  innermost fxsplit frame), or a device check (``InvariantError``) failing while the split runs.

By hand, every seed in its own process::

    python tests/route_fuzz.py 60000 60150        # seeds [60000, 60150): each row, a tally per route
    python tests/route_fuzz.py 61000 61150        # the spec, device_map and dtype_checkpoint routes
    python tests/route_fuzz.py 62000 62150        # the resized, train_steps and cli routes

It exits 1 when a seed is ``wrong`` or ``crash``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import math
import os
import random
import sys
import tempfile
import warnings
from collections import Counter
from typing import Any, Callable, NamedTuple, Sequence

import torch
from fuzzrun import differences, run_seeds, weighted_loss, where
from random_programs import generate

import fxsplit
from fxsplit.check import DeviceChecker

__all__ = ["FIRST_MORE", "FIRST_THIRD", "ROUTES", "ROUTES_MORE", "ROUTES_THIRD", "route_of", "run_seed", "scenario"]

ROUTES = ("saved_plan", "checkpoint", "offload", "pipeline")  # seeds below FIRST_MORE: seed % 4
ROUTES_MORE = ("spec", "device_map", "dtype_checkpoint")  # seeds from FIRST_MORE on: seed % 3
FIRST_MORE = 61000
ROUTES_THIRD = ("resized", "train_steps", "cli")  # seeds from FIRST_THIRD on: seed % 3 (route_fuzz_more)
FIRST_THIRD = 62000


def route_of(seed: int) -> str:
    """The route ``seed`` takes: ``ROUTES[seed % 4]`` below :data:`FIRST_MORE`, ``ROUTES_MORE[seed % 3]`` from it on,
    ``ROUTES_THIRD[seed % 3]`` from :data:`FIRST_THIRD` on."""
    if seed >= FIRST_THIRD:
        return ROUTES_THIRD[seed % len(ROUTES_THIRD)]
    return ROUTES_MORE[seed % len(ROUTES_MORE)] if seed >= FIRST_MORE else ROUTES[seed % len(ROUTES)]


def scenario(seed: int) -> dict[str, Any]:
    """How ``seed``'s program reaches its split: the route and its choices."""
    draw = random.Random(seed * 104723 + 13)
    route = route_of(seed)
    how: dict[str, Any] = {"route": route, "trace": draw.choice(["fx", "export"]), "devices": draw.choice([2, 2, 3])}
    if route == "saved_plan":
        mode = draw.choice(["training", "training", "inference", "weights"])
        how.update(
            mode=mode,
            pinned=draw.random() < 0.3,
            share=round(draw.uniform(0.45, 1.0), 3),
            format=draw.choice(["yaml", "json"]),
            replicate=mode != "training" and draw.random() < 0.5,
        )
    elif route == "checkpoint":
        how.update(
            mode=draw.choice(["training", "inference"]),
            share=round(draw.uniform(0.45, 1.0), 3),
            file="safetensors" if (seed // len(ROUTES)) % 2 == 0 else "pt",
            build=draw.choice(["empty_weights", "meta_device"]),
            via=draw.choice(["fxsplit", "fxsplit", "apply"]),
        )
    elif route == "offload":
        how.update(
            mode="inference",
            slack=round(draw.uniform(0.0, 0.03), 3),
            pinned=draw.random() < 0.6,
            storage=draw.choice(["host", "disk", "both"]),
            prefetch=draw.choice([0, 1]),
            file=draw.choice([None, None, "safetensors", "pt"]),
            no_grad=draw.random() < 0.5,
        )
    elif route == "spec":
        mode = draw.choice(["training", "training", "inference", "weights"])
        how.update(
            mode=mode,
            share=round(draw.uniform(0.5, 1.2), 3),
            unit=draw.choice(["B", "KiB", "kB"]),
            reserve=draw.choice([None, None, "top", "device"]),
            pinned=draw.random() < 0.4,
            together=draw.random() < 0.3,
            objective=draw.choice(["min_transfer", "min_transfer", "balanced"]),
            contiguous=draw.random() < 0.25,
            replicate=mode == "training" or draw.random() < 0.7,
            output_device=draw.choice([None, None, None, "first"]),
            via=draw.choice(["path", "path", "load_spec"]),
        )
    elif route == "device_map":
        how.update(
            mode=draw.choice(["training", "training", "inference", "weights"]),
            share=round(draw.uniform(0.8, 1.5), 3),
            map=draw.choice(["segments", "plan", "root"]),
            via=draw.choice(["fxsplit", "from_device_map", "from_device_map_ints", "spec"]),
            sized=draw.random() < 0.3,  # from_device_map sizes the budgets (none given)
        )
    elif route == "dtype_checkpoint":
        how.update(
            mode=draw.choice(["training", "inference"]),
            share=round(draw.uniform(0.55, 1.1), 3),
            file=draw.choice(["safetensors", "safetensors", "pt"]),
            build=draw.choice(["empty_weights", "meta_device"]),
            via=draw.choice(["fxsplit", "fxsplit", "apply"]),
        )
    elif route in ROUTES_THIRD:
        import route_fuzz_more  # it imports this module's helpers

        how.update(route_fuzz_more.choices(route, draw))
    else:
        mode = draw.choice(["training", "training", "inference"])
        how.update(
            mode=mode,
            share=round(draw.uniform(0.5, 1.0), 3),
            chunk_draw=round(draw.random(), 3),
            recompute=draw.choice(["never", "never", "always", "except_last"]) if mode == "training" else "never",
        )
    return how


def _source(seed: int) -> tuple[str, list[str]]:
    return generate(seed)


def _make(source: str, seed: int, build: str | None = None) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The program's model (float64) and inputs; ``build``: ``None`` (real), ``"empty_weights"`` or
    ``"meta_device"`` (then the inputs it makes are not used)."""
    namespace: dict[str, Any] = {"__name__": "program"}
    exec(compile(source, f"<program {seed}>", "exec"), namespace)  # noqa: S102 (our own generated source)
    context: Any = contextlib.nullcontext()
    if build == "empty_weights":
        context = fxsplit.empty_weights()
    elif build == "meta_device":
        context = torch.device("meta")
    with context:
        model, args = namespace["make"]()
    model = model.double()
    args = tuple(a.double() if a.is_floating_point() else a for a in args)
    return model, args


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Give the model weights of its own (not ``make()``'s), so that a checkpoint that is not read shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.05)


def _row(result: dict[str, Any], outcome: str, error: BaseException | None = None, **more: Any) -> dict[str, Any]:
    row = {**result, "outcome": outcome, **more}
    if "warned" in row:
        row["warned"] = list(dict.fromkeys(row["warned"]))[:3]
    if error is not None:
        row["error"] = f"{type(error).__name__}: {error}"[:300]
        if outcome == "crash":
            row["at"] = where(error)
    return row


def _one_device_total(model: torch.nn.Module, options: dict[str, Any]) -> dict[str, int]:
    """The memory row of ``model`` planned alone on one device (with ``options``)."""
    alone = fxsplit.plan(copy.deepcopy(model), {"cpu:0": 1 << 34}, **options)
    if alone.memory:
        return dict(alone.memory["cpu:0"])
    return {"total": alone.device_bytes["cpu:0"], "params": alone.device_bytes["cpu:0"]}


def _least_budgets(
    model: torch.nn.Module, devices: list[str], options: dict[str, Any], offload: Any, high: int
) -> dict[str, int]:
    """About the least budgets at which ``model`` is planned with ``offload``, each device's found by bisection
    (within 1/64 of ``high``, which fits) with the others' as found before it: where the devices hold the least
    of the weights, so the most is streamed."""
    budgets = dict.fromkeys(devices, high)
    for device in devices:
        low = 0
        for _ in range(6):
            middle = (low + budgets[device]) // 2
            try:
                fxsplit.plan(model, {**budgets, device: max(1, middle)}, offload=offload, **options)
                budgets[device] = middle
            except fxsplit.FxsplitError:
                low = middle
    return {d: max(1, b) for d, b in budgets.items()}


def _pins(seed: int, segments: list[str], devices: list[str]) -> dict[str, str]:
    """The first segment on the first device, the last on the last, the others anywhere between (sorted)."""
    draw = random.Random(seed)
    homes = sorted([0, len(devices) - 1, *(draw.randrange(len(devices)) for _ in segments[2:])])
    return {segment: devices[k] for segment, k in zip(segments, homes, strict=True)}


def _save(model: torch.nn.Module, directory: str, kind: str) -> str:
    state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    if kind == "safetensors":
        from safetensors.torch import save_file

        path = os.path.join(directory, "model.safetensors")
        save_file(state, path)
    else:
        path = os.path.join(directory, "model.pt")
        torch.save(state, path)
    return path


def _run(
    gm: Any,
    model: torch.nn.Module,
    args: tuple[Any, ...],
    seed: int,
    train: bool,
    said: list[str],
    no_grad: bool = False,
) -> Any:
    """``gm`` on a copy of ``args`` under a device check (and its loss backward when ``train``); the warnings it
    gives are added to ``said``."""
    run_args = tuple(a.clone() for a in args)
    plan = gm.meta["fxsplit_plan"]
    target = gm.split if isinstance(gm, fxsplit.Pipeline) else gm
    torch.manual_seed(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with DeviceChecker(plan, target, model, host_anywhere=True):  # host_anywhere: attention's causal mask
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                out = gm(*run_args)
    said.extend(str(w.message)[:200] for w in caught if issubclass(w.category, fxsplit.FxsplitWarning))
    if train:
        loss = weighted_loss(out)
        if loss.requires_grad:
            loss.backward()
    return out, run_args


def _compared(
    case: Case,
    gm: Any,
    target: torch.nn.Module,
    said: list[str],
    differ: Sequence[str] = (),
    *,
    no_grad: bool = False,
    refused_when_run: bool = False,
    compare: Callable[..., list[str]] = differences,
) -> dict[str, Any]:
    """The seed's row: ``gm`` (split from ``target``) run on the inputs, its loss backward in training, compared
    with eager (``differ``: what was found to differ before it ran). ``refused_when_run``: an ``FxsplitError`` from
    the run is fxsplit's refusal (a pipeline's at its first forward, ``batch_stats="error"``), not a crash.
    ``compare``: :func:`fuzzrun.differences` (float64), or :func:`_differences32`."""
    result = case.result
    try:
        out, run_args = _run(gm, target, case.args, case.seed, case.how["mode"] == "training", said, no_grad)
    except fxsplit.InvariantError as error:  # the device check: a finding
        return _row(result, "crash", error, phase="run")
    except fxsplit.FxsplitError as error:
        return _row(result, "refused" if refused_when_run else "crash", error, phase="run")
    except Exception as error:  # noqa: BLE001 - any other error is a finding
        return _row(result, "crash", error, phase="run")
    found = [*differ, *compare(out, case.expected, target, case.reference)]
    found += [f"input {i}" for i, (a, e) in enumerate(zip(run_args, case.args, strict=True)) if not torch.equal(a, e)]
    used = sorted(set(gm.meta["fxsplit_plan"].placement.values()))
    return _row(result, "wrong" if found else "equal", differ=found[:5], used=used)


def _split(result: dict[str, Any], build: Callable[[], Any]) -> tuple[Any, dict[str, Any] | None, list[str]]:
    """``build()`` with its warnings caught: (what it made, None) or (None, the row of its refusal or crash)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            made = build()
        except fxsplit.FxsplitError as error:
            return None, _row(result, "refused", error), []
        except Exception as error:  # noqa: BLE001 - any other error is a finding
            return None, _row(result, "crash", error, phase="plan"), []
    said = [str(w.message)[:200] for w in caught if issubclass(w.category, fxsplit.FxsplitWarning)]
    return made, None, said


class Case(NamedTuple):
    """One seed on its way down its route: the program, its eager result, and where and how it is split."""

    seed: int
    how: dict[str, Any]  # scenario()
    result: dict[str, Any]  # the row so far
    source: str
    segments: list[str]
    model: torch.nn.Module
    reference: torch.nn.Module  # the unsplit copy eager ran (with its gradients)
    args: tuple[Any, ...]
    expected: Any  # eager's outputs
    devices: list[str]
    options: dict[str, Any]  # for fxsplit.plan / fxsplit.fxsplit
    directory: str  # for files (checkpoints, offload)


def run_seed(seed: int) -> dict[str, Any]:
    """Take ``seed``'s program down the route :func:`scenario` chooses and compare: ``{"seed", "outcome", ...}``."""
    how = scenario(seed)
    result: dict[str, Any] = {"seed": seed, **how}
    source, segments = _source(seed)
    model, args = _make(source, seed)
    if how["route"] in ("checkpoint", "offload", "dtype_checkpoint"):
        _perturb(model, seed)
    if how["route"] == "pipeline":
        batch = args[0].shape[0]
        chunks = [c for c in (2, 3, 4) if batch % c == 0]
        result["chunks"] = chunks[int(how["chunk_draw"] * len(chunks))]
        if how["mode"] == "inference":
            model.eval()
    train = how["mode"] == "training"
    reference = copy.deepcopy(model)
    eager_args = tuple(a.clone() for a in args)  # each run its own inputs: a program may write one in place
    try:
        torch.manual_seed(seed)  # the same random numbers (dropout) for both
        with torch.no_grad() if how.get("no_grad") else contextlib.nullcontext():
            expected = reference(*eager_args)
        eager_loss = weighted_loss(expected)
        if eager_loss.requires_grad and train:
            eager_loss.backward()
    except Exception as error:  # noqa: BLE001 - the generator makes programs that do not run
        return _row(result, "eager_fails", error)
    devices = [f"cpu:{k}" for k in range(how["devices"])]
    options: dict[str, Any] = {"mode": how["mode"], "trace": how["trace"], "example_inputs": args}
    if train:
        options["optimizer"] = "sgd"
    with tempfile.TemporaryDirectory(prefix="route_fuzz_") as directory:
        route = {
            "saved_plan": _saved_plan,
            "checkpoint": _checkpoint,
            "offload": _offload,
            "pipeline": _pipeline,
            "spec": _spec,
            "device_map": _device_map,
            "dtype_checkpoint": _dtype_checkpoint,
        }
        if how["route"] in ROUTES_THIRD:
            import route_fuzz_more

            route.update(dict.fromkeys(ROUTES_THIRD, route_fuzz_more.run))
        case = Case(seed, how, result, source, segments, model, reference, args, expected, devices, options, directory)
        return route[how["route"]](case)


def _saved_plan(case: Case) -> dict[str, Any]:
    seed, how, result, segments = case.seed, case.how, case.result, case.segments
    model, args, devices, options = case.model, case.args, case.devices, case.options
    if how["replicate"]:
        options["replicate"] = True
    fresh, direct_model = copy.deepcopy(model), copy.deepcopy(model)

    def planned() -> tuple[Any, ...]:
        if how["pinned"] and len(segments) > 1:
            options["pins"] = _pins(seed, segments, devices)
            budgets = dict.fromkeys(devices, 1 << 34)
        else:
            total = _one_device_total(model, options)["total"]
            budgets = {d: max(1, int(total * how["share"])) for d in devices}
        plan = fxsplit.plan(model, budgets, **options)
        if how["format"] == "yaml":
            loaded = fxsplit.Plan.from_yaml(plan.to_yaml())
        else:
            loaded = fxsplit.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
        applied = fxsplit.apply(fresh, loaded, example_inputs=args)
        return budgets, plan, loaded, applied

    made, refused, said = _split(result, planned)
    if made is None:
        return refused  # type: ignore[return-value]
    budgets, plan, loaded, applied = made
    result["warned"] = said
    differ = []
    if loaded != plan:
        differ.append(f"the plan read back differs ({how['format']})")
    if applied.meta["fxsplit_plan"] != loaded:
        differ.append("apply's plan is not the plan it was given")
    try:
        direct = fxsplit.fxsplit(direct_model, budgets, **options)
        if direct.meta["fxsplit_plan"] == plan and direct.code != applied.code:
            differ.append("apply's code differs from fxsplit's with the same plan")
    except Exception as error:  # noqa: BLE001 - plan() made it, fxsplit() must too
        return _row(result, "crash", error, phase="fxsplit after plan")
    return _compared(case, applied, fresh, said, differ)


def _checkpoint(case: Case) -> dict[str, Any]:
    seed, how, result, source = case.seed, case.how, case.result, case.source
    model, args, devices, options, directory = case.model, case.args, case.devices, case.options, case.directory
    path = _save(model, directory, how["file"])
    empty, _ = _make(source, seed, how["build"])

    def split() -> Any:
        total = _one_device_total(model, options)["total"]
        budgets = {d: max(1, int(total * how["share"])) for d in devices}
        if how["via"] == "apply":
            plan = fxsplit.plan(model, budgets, **options)
            return fxsplit.apply(empty, plan, example_inputs=args, checkpoint=path)
        return fxsplit.fxsplit(empty, budgets, checkpoint=path, **options)

    gm, refused, said = _split(result, split)
    if gm is None:
        return refused  # type: ignore[return-value]
    result["warned"] = said
    return _compared(case, gm, empty, said)


def _offload(case: Case) -> dict[str, Any]:
    seed, how, result, source, segments = case.seed, case.how, case.result, case.source, case.segments
    model, devices, options, directory = case.model, case.devices, case.options, case.directory
    target = model
    path = None
    if how["file"] is not None:
        path = _save(model, directory, how["file"])
        target, _ = _make(source, seed, "empty_weights")

    def split() -> Any:
        alone = _one_device_total(model, options)
        params = alone["params"]
        storage = {
            "host": {"host": 2 * params},
            "disk": {"disk": 2 * params, "dir": os.path.join(directory, "offload")},
            "both": {"host": params // 3, "disk": 2 * params, "dir": os.path.join(directory, "offload")},
        }[how["storage"]]
        offload = {**storage, "prefetch": how["prefetch"]}
        if how["pinned"]:  # each segment's weights on its device: streamed when they do not fit beside its ops
            options["pins"] = _pins(seed, segments, devices)
        least = _least_budgets(model, devices, options, offload, 2 * alone["total"])
        budgets = {d: int(b * (1 + how["slack"])) for d, b in least.items()}
        result["budgets"] = list(budgets.values())
        if path is not None:
            return fxsplit.fxsplit(target, budgets, offload=offload, checkpoint=path, **options)
        return fxsplit.fxsplit(target, budgets, offload=offload, **options)

    gm, refused, said = _split(result, split)
    if gm is None:
        return refused  # type: ignore[return-value]
    result["warned"] = said
    result["streamed"] = gm.meta["fxsplit_plan"].stream_bytes
    return _compared(case, gm, target, said, no_grad=how["no_grad"])


def _pipeline(case: Case) -> dict[str, Any]:
    how, result = case.how, case.result
    model, devices, options = case.model, case.devices, case.options
    if how["trace"] == "export":
        options["dynamic_shapes"] = "batch"  # so that fxsplit can find the ops that mix the batch's rows
    config = fxsplit.PipelineConfig(chunks=result["chunks"], checkpoint=how["recompute"], batch_stats="error")

    def split() -> Any:
        total = _one_device_total(model, options)["total"]
        budgets = {d: max(1, int(total * how["share"])) for d in devices}
        return fxsplit.fxsplit(model, budgets, pipeline=config, **options)

    pipe, refused, said = _split(result, split)
    if pipe is None:
        return refused  # type: ignore[return-value]
    result["warned"] = said
    return _compared(case, pipe, model, said, refused_when_run=True)


def _size_text(nbytes: int, unit: str) -> str:
    """``nbytes`` as a spec writes a budget: a plain byte count, or binary or decimal kilobytes (to 3 places)."""
    if unit == "B":
        return str(nbytes)
    return f"{nbytes / (1024 if unit == 'KiB' else 1000):.3f}{unit}"


def _spec(case: Case) -> dict[str, Any]:
    seed, how, result, segments = case.seed, case.how, case.result, case.segments
    model, args, devices, options, directory = case.model, case.args, case.devices, case.options, case.directory
    fresh = copy.deepcopy(model)  # planned again with the spec's options given as keywords

    def split() -> tuple[Any, dict[str, str], dict[str, Any]]:
        total = _one_device_total(model, options)["total"]
        sizes = {d: _size_text(max(1, int(total * how["share"])), how["unit"]) for d in devices}
        keywords: dict[str, Any] = {"mode": how["mode"], "trace": how["trace"]}
        lines = [f"# route_fuzz seed {seed}", "devices:"]
        for d in devices:
            if how["reserve"] == "device" and d == devices[0]:
                lines.append(f"  {d}: {{budget: {sizes[d]}, reserve: 1%}}")
                keywords["reserve"] = {d: "1%"}
            else:
                lines.append(f"  {d}: {sizes[d]}")
        if how["reserve"] == "top":
            lines.append("reserve: 2%")
            keywords["reserve"] = "2%"
        lines += [f"trace: {how['trace']}", f"mode: {how['mode']}"]
        if how["mode"] == "training":
            lines.append("optimizer: sgd")
            keywords["optimizer"] = "sgd"
        if how["pinned"] and len(segments) > 1:
            keywords["pins"] = _pins(seed, segments, devices)
            lines += ["pin:", *(f'  "{s}": {d}' for s, d in keywords["pins"].items())]
        elif how["together"] and len(segments) > 1:
            keywords["together"] = [segments[-2:]]
            lines += ["together:", "  - [" + ", ".join(f'"{s}"' for s in segments[-2:]) + "]"]
        if how["objective"] != "min_transfer":
            lines.append(f"objective: {how['objective']}")
            keywords["objective"] = how["objective"]
        if how["contiguous"]:
            lines.append("contiguous: true")
            keywords["contiguous"] = True
        if not how["replicate"]:
            lines.append("replicate: false")
            keywords["replicate"] = False
        if how["output_device"] == "first":
            lines.append(f"output_device: {devices[0]}")
            keywords["output_device"] = devices[0]
        path = os.path.join(directory, "split.yaml")
        with open(path, "w") as file:
            file.write("\n".join(lines) + "\n")
        spec = fxsplit.load_spec(path) if how["via"] == "load_spec" else path
        return fxsplit.fxsplit(model, spec=spec, example_inputs=args), sizes, keywords

    made, refused, said = _split(result, split)
    if made is None:
        return refused  # type: ignore[return-value]
    gm, sizes, keywords = made
    result["warned"] = said
    plan = gm.meta["fxsplit_plan"]
    differ = []
    if plan.budgets != {d: fxsplit.parse_size(size) for d, size in sizes.items()}:
        differ.append(f"budgets {plan.budgets}, the spec's {sizes}")
    for device, modules in plan.modules.items():
        for module in modules:
            home = keywords.get("pins", {}).get(module.split(".")[0])
            if home is not None and home != device:
                differ.append(f"module {module!r} has ops on {device}, pinned to {home}")
    try:
        by_keywords = fxsplit.plan(fresh, sizes, example_inputs=args, **keywords)
    except Exception as error:  # noqa: BLE001 - the spec planned it, its options as keywords must too
        return _row(result, "crash", error, phase="plan by keywords")
    if by_keywords != plan:
        differ.append("the spec's plan differs from the plan of its options given as keywords")
    return _compared(case, gm, model, said, differ)


def _mapped(device_map: dict[str, str], name: str) -> str | None:
    """Where ``device_map`` puts the tensor ``name``: its longest key that is the name or a module holding it."""
    keys = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
    return device_map[max(keys, key=len)] if keys else None


def _map_of_placement(model: torch.nn.Module, segments: list[str], placed: dict[str, str]) -> dict[str, str]:
    """``placed`` (tensor -> device) written as Accelerate writes a map: a segment whose weights share a device by
    its name, else each module holding weights of one device, else each weight by its own name."""
    names = [name for name, _ in model.named_parameters()]
    device_map: dict[str, str] = {}
    for segment in segments:
        under = [n for n in names if n.startswith(segment + ".")]
        if len({placed[n] for n in under}) <= 1:
            device_map[segment] = placed[under[0]] if under else placed[names[0]] if names else "cpu:0"
            continue
        for module_name, module in model.get_submodule(segment).named_modules(prefix=segment):
            own = [f"{module_name}.{n}" for n, _ in module.named_parameters(recurse=False)]
            if len({placed[n] for n in own}) == 1:
                device_map[module_name] = placed[own[0]]
            else:
                device_map.update({n: placed[n] for n in own})
    return _covered(model, device_map, placed.__getitem__)


def _covered(model: torch.nn.Module, device_map: dict[str, str], home: Callable[[str], str]) -> dict[str, str]:
    """``device_map`` with a key for every weight no key covers (the model's own modules beside its segments, as a
    head): the module holding it, when ``home`` puts all such weights of the module on one device, else the
    weight's own name."""
    left: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        if _mapped(device_map, name) is None:
            left.setdefault(name.rpartition(".")[0], []).append(name)
    for module, names in left.items():
        if module and len({home(n) for n in names}) == 1:
            device_map[module] = home(names[0])
        else:
            device_map.update({n: home(n) for n in names})
    return device_map


def _device_map(case: Case) -> dict[str, Any]:
    seed, how, result, segments = case.seed, case.how, case.result, case.segments
    model, args, devices, options, directory = case.model, case.args, case.devices, case.options, case.directory
    draw = random.Random(seed * 7919 + 1)
    result["via"] = how["via"]

    def split() -> tuple[Any, dict[str, str]]:
        total = _one_device_total(model, options)["total"]
        budgets = {d: max(1, int(total * how["share"])) for d in devices}
        weighty = [s for s in segments if any(True for _ in model.get_submodule(s).parameters())] or segments
        if how["map"] == "segments":  # each segment on a device, in any order; those with weights on two at least
            homes = {s: draw.randrange(len(devices)) for s in segments}
            if len(weighty) > 1 and len({homes[s] for s in weighty}) == 1:
                homes[weighty[-1]] = (homes[weighty[-1]] + 1) % len(devices)
            device_map = {s: devices[k] for s, k in homes.items()}
            last = devices[homes[segments[-1]]]
            device_map = _covered(model, device_map, lambda name: last)
        elif how["map"] == "root":  # the whole model on the first device, some segments with weights elsewhere
            moved = draw.sample(weighty, max(1, len(weighty) // 2))
            device_map = {"": devices[0], **{s: devices[draw.randrange(1, len(devices))] for s in moved}}
        else:  # where fxsplit's own plan at tighter budgets puts the weights
            try:
                tight = {d: max(1, int(total * 0.6)) for d in devices}
                placed = fxsplit.plan(copy.deepcopy(model), tight, **options).param_devices
            except fxsplit.FxsplitError:  # then the budgets say whether the map (all but on one device) fits
                placed = fxsplit.plan(copy.deepcopy(model), dict.fromkeys(devices, 1 << 34), **options).param_devices
            device_map = _map_of_placement(model, segments, placed)
        result["device_map"] = device_map
        if how["via"] == "fxsplit":
            return fxsplit.fxsplit(model, budgets, device_map=device_map, **options), device_map
        if how["via"] == "spec":
            lines = ["devices:", *(f"  {d}: {b}" for d, b in budgets.items()), "device_map:"]
            lines += [f'  "{k}": {d}' for k, d in device_map.items()]
            lines += [f"trace: {how['trace']}", f"mode: {how['mode']}"]
            lines += ["optimizer: sgd"] if how["mode"] == "training" else []
            path = os.path.join(directory, "map.yaml")
            with open(path, "w") as file:
                file.write("\n".join(lines) + "\n")
            return fxsplit.fxsplit(model, spec=path, example_inputs=args), device_map
        given: Any = dict(budgets)
        if how["sized"]:
            given = None  # each device of the map: what the plan needs there and a quarter
        if how["via"] == "from_device_map_ints":  # Accelerate's values (cuda:N), translated with devices=
            number = {d: k for k, d in enumerate(devices)}
            plan = fxsplit.from_device_map(
                model,
                {k: number[d] for k, d in device_map.items()},
                given,
                devices={k: d for d, k in number.items()},
                **options,
            )
        else:
            plan = fxsplit.from_device_map(model, device_map, given, **options)
        return fxsplit.apply(model, plan, example_inputs=args), device_map

    made, refused, said = _split(result, split)
    if made is None:
        return refused  # type: ignore[return-value]
    gm, device_map = made
    result["warned"] = said
    plan = gm.meta["fxsplit_plan"]
    result["holds"] = sorted(set(plan.param_devices.values()))  # the devices holding weights ("used": ops)
    differ = []
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, _ in tensors:
        home = _mapped(device_map, name)
        if home is not None and plan.param_devices.get(name) != home:
            differ.append(f"{name} on {plan.param_devices.get(name)}, mapped to {home}")
    return _compared(case, gm, model, said, differ)


RTOL32, ATOL32 = 1e-5, 1e-6


def _close32(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal at float32: within ``RTOL32`` of each element, or ``ATOL32`` of the tensor's largest magnitude."""
    scale = max(1.0, want.abs().max().item()) if want.numel() and want.is_floating_point() else 1.0
    return got.dtype == want.dtype and torch.allclose(got, want, rtol=RTOL32, atol=ATOL32 * scale, equal_nan=True)


def _same32(got: Any, want: Any) -> bool:
    """Non-tensor outputs equal at float32: floats within ``RTOL32``/``ATOL32``, anything else exactly."""
    if isinstance(got, float) and isinstance(want, float):
        return math.isclose(got, want, rel_tol=RTOL32, abs_tol=ATOL32)
    return bool(got == want)


_differences32 = functools.partial(differences, close=_close32, state_close=_close32, same=_same32)
"""`fuzzrun.differences` at float32 (:func:`_close32`, dtypes too): outputs, gradients and state."""


def _dtype_checkpoint(case: Case) -> dict[str, Any]:
    seed, how, result, source = case.seed, case.how, case.result, case.source
    model, devices, directory = case.model, case.devices, case.directory
    model32 = copy.deepcopy(model).float()  # the float32 model the checkpoint holds, eager's reference
    args32 = tuple(a.float() if a.is_floating_point() else a for a in case.args)
    reference32 = copy.deepcopy(model32)
    try:
        torch.manual_seed(seed)
        expected32 = reference32(*(a.clone() for a in args32))
        loss = weighted_loss(expected32)
        if how["mode"] == "training" and loss.requires_grad:
            loss.backward()
    except Exception as error:  # noqa: BLE001 - at float32 the program may not run
        return _row(result, "eager_fails", error, phase="float32")
    path = _save(model32, directory, how["file"])
    empty, _ = _make(source, seed, how["build"])  # float64, its weights on meta: cast to float32 when loaded
    options = {**case.options, "example_inputs": args32, "dtype": "float32"}

    def split() -> Any:
        total = _one_device_total(model, options)["total"]
        budgets = {d: max(1, int(total * how["share"])) for d in devices}
        if how["via"] == "apply":  # a plan of the real float64 model at float32 (stand-ins), applied to the meta one
            plan = fxsplit.plan(model, budgets, **options)
            return fxsplit.apply(empty, plan, example_inputs=args32, checkpoint=path)
        return fxsplit.fxsplit(empty, budgets, checkpoint=path, **options)

    gm, refused, said = _split(result, split)
    if gm is None:
        return refused  # type: ignore[return-value]
    result["warned"] = said
    differ = [] if gm.meta["fxsplit_plan"].dtype == "float32" else [f"plan dtype {gm.meta['fxsplit_plan'].dtype}"]
    case32 = case._replace(args=args32, expected=expected32, reference=reference32, options=options)
    return _compared(case32, gm, empty, said, differ, compare=_differences32)


class _Tally(io.TextIOBase):
    """Echo what :func:`fuzzrun.run_seeds` prints and count its rows per route."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.counts: dict[str, Counter[str]] = {route: Counter() for route in (*ROUTES, *ROUTES_MORE, *ROUTES_THIRD)}

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.startswith('{"seed"'):
                row = json.loads(line)
                self.counts[route_of(row["seed"])][row["outcome"]] += 1
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def main(first: int, last: int) -> int:
    """Run seeds ``[first, last)``, each in its own process; print every row, the tally and a tally per route."""
    tally = _Tally(sys.stdout)
    with contextlib.redirect_stdout(tally):
        status = run_seeds("route_fuzz", first, last, shown=("equal", "refused", "eager_fails"))
    for route, counts in tally.counts.items():
        print(f"{route}: {dict(counts)}")
    return status


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
