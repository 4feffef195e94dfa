"""Generated programs reaching a split by the other routes users take: a fuzz to run by hand.

:mod:`split_fuzz` calls ``fxsplit.fxsplit`` on a real model. Here each seed's program (:mod:`random_programs`, in
float64 on ``cpu:0``..``cpu:2``, traced by torch.fx or torch.export) takes one route, chosen by the seed
(``seed % 4``), and is compared with the unsplit model:

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
  ``dynamic_shapes="batch"``, so that it can tell); outputs and gradients compared.

:func:`run_seed` says how it went:

* ``equal``: the split computed what the model computes (and, for saved plans, the plan round-tripped);
* ``refused``: fxsplit refused with one of its own errors (an ``FxsplitError``), when planning, or (a pipeline)
  at its first forward;
* ``eager_fails``: the unsplit program itself does not run (the generator makes some that do not);
* ``wrong``: outputs, gradients, state or the saved plan differ; ``crash``: any other exception (``at``: the
  innermost fxsplit frame), or a device check (``InvariantError``) failing while the split runs.

By hand, every seed in its own process::

    python tests/route_fuzz.py 60000 60150        # seeds [60000, 60150): each row, a tally per route

It exits 1 when a seed is ``wrong`` or ``crash``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
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

__all__ = ["ROUTES", "run_seed", "scenario"]

ROUTES = ("saved_plan", "checkpoint", "offload", "pipeline")


def scenario(seed: int) -> dict[str, Any]:
    """How ``seed``'s program reaches its split: the route and its choices."""
    draw = random.Random(seed * 104723 + 13)
    route = ROUTES[seed % len(ROUTES)]
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
) -> dict[str, Any]:
    """The seed's row: ``gm`` (split from ``target``) run on the inputs, its loss backward in training, compared
    with eager (``differ``: what was found to differ before it ran). ``refused_when_run``: an ``FxsplitError`` from
    the run is fxsplit's refusal (a pipeline's at its first forward, ``batch_stats="error"``), not a crash."""
    result = case.result
    try:
        out, run_args = _run(gm, target, case.args, case.seed, case.how["mode"] == "training", said, no_grad)
    except fxsplit.InvariantError as error:  # the device check: a finding
        return _row(result, "crash", error, phase="run")
    except fxsplit.FxsplitError as error:
        return _row(result, "refused" if refused_when_run else "crash", error, phase="run")
    except Exception as error:  # noqa: BLE001 - any other error is a finding
        return _row(result, "crash", error, phase="run")
    found = [*differ, *differences(out, case.expected, target, case.reference)]
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
    if how["route"] in ("checkpoint", "offload"):
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
        route = {"saved_plan": _saved_plan, "checkpoint": _checkpoint, "offload": _offload, "pipeline": _pipeline}
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


class _Tally(io.TextIOBase):
    """Echo what :func:`fuzzrun.run_seeds` prints and count its rows per route."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.counts: dict[str, Counter[str]] = {route: Counter() for route in ROUTES}

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.startswith('{"seed"'):
                row = json.loads(line)
                self.counts[ROUTES[row["seed"] % len(ROUTES)]][row["outcome"]] += 1
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
