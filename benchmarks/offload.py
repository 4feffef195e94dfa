"""Offload: fxsplit vs Accelerate when the devices hold only part of the weights.

For each model and device fraction ``f`` (the devices together hold ``f`` of
the weights: ``N`` logical devices ``cpu:0..N-1`` of ``f * total / N`` each),
host storage of ``HOST_FRACTION * total`` and disk storage of ``total``:

* Accelerate: ``infer_auto_device_map(model, max_memory={0: b, 1: b, "cpu":
  host}, no_split_module_classes=<block classes>)`` (what fits neither goes to
  ``"disk"``), then ``dispatch_model(model, device_map, offload_dir=...,
  main_device="cpu:0")`` (:mod:`benchmarks.accelerate_maps`; ``cpu:0`` is the
  device ``infer_auto_device_map`` keeps room on for offloaded layers). Its
  ``AlignDevicesHook`` loads every offloaded module's weights onto the main
  device before the module runs and drops them after, on every forward.
* fxsplit: ``fxsplit.fxsplit(model, {"cpu:0": b, ...}, example_inputs=...,
  mode="weights", offload={"host": host, "disk": total, "dir": ...})`` (default
  prefetch 1). ``mode="weights"``, as in :mod:`benchmarks.quality`: a budget
  then means what Accelerate's ``max_memory`` means (weights; fxsplit still
  charges each device its streaming buffers).

Per case: bytes streamed from storage per forward (fxsplit's plan, and both
tools counted while a forward runs: fxsplit's ``runtime.prefetch`` calls in the
generated code, Accelerate's ``set_module_tensor_to_device`` calls from its
hooks), bytes copied between devices per forward (fxsplit's plan; Accelerate's
device map scored on the same graph by :mod:`benchmarks.placements`), outputs
against the unsplit model, and forward times side by side (interleaved, same
input; an identical second fxsplit split is the A/A control). Also, for the
record: fxsplit with its default ``mode="inference"`` (activations charged too)
and with ``prefetch=0`` (one streaming buffer per device, as Accelerate has).

On logical CPU devices every ``tensor.to("cpu:k")`` copies, so fxsplit copies
each streamed weight (host or disk) into the device's memory, as it would to a
GPU; Accelerate's hooks run under :func:`~benchmarks.accelerate_maps.
logical_cpu_devices` (they fail without it), where a weight it offloaded to
``"cpu"`` is used in place (no copy, unlike on a GPU) and a weight on
``"disk"`` is read from its ``.dat`` file into new memory. The timing
therefore favours Accelerate on weights stored in host memory.

    python -m benchmarks.offload [--quick] [--models mlp,gpt2,llama] [--fractions 0.5,0.6] [--out benchmarks/]

Writes ``OFFLOAD_RESULTS.md`` and ``offload_results.json`` under ``--out``;
exits 1 when a bar fails. Also a part of ``benchmarks/run.py`` (``--parts offload``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fxsplit.errors import FxsplitWarning  # noqa: E402

__all__ = [
    "DEVICE_FRACTIONS",
    "OFFLOAD_CASES",
    "OffloadCase",
    "main",
    "offload_bars",
    "offload_case",
    "run_offload",
    "write_results",
]

N_DEVICES = 2
DEVICE_FRACTIONS = (0.5, 0.6)
HOST_FRACTION = 0.25
RESULTS_MD, RESULTS_JSON = "OFFLOAD_RESULTS.md", "offload_results.json"
ATOL, RTOL = 1e-4, 1e-4


@dataclass(frozen=True)
class OffloadCase:
    """A model for the offload benchmark.

    Attributes:
        name: short name (``--models``).
        build: a fresh model, the same weights every call.
        inputs: the positional inputs.
        block_classes: Accelerate's ``no_split_module_classes``.
        fx: whether ``torch.fx`` can trace it (an extra ``trace="fx"`` split is timed, for the record).
        default: run unless named (the tiny case is for the tests).
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[Any, ...]]
    block_classes: tuple[str, ...]
    fx: bool = False
    default: bool = True


def _mlp(dim: int, depth: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from benchmarks.models import MLP

        torch.manual_seed(0)
        return MLP(dim, depth).eval()

    return build


def _hf(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from benchmarks.models import case_by_name

        return case_by_name(name).build()

    return build


def _randn(*shape: int) -> Callable[[], tuple[torch.Tensor]]:
    return lambda: (torch.randn(*shape, generator=torch.Generator().manual_seed(1)),)


def _ids(batch: int, length: int) -> Callable[[], tuple[torch.Tensor]]:
    from benchmarks.models import VOCAB

    return lambda: (torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1)),)


OFFLOAD_CASES: tuple[OffloadCase, ...] = (
    # 32 x Linear(512, 512) + ReLU: 32 MiB in 32 equal blocks
    OffloadCase("mlp", _mlp(512, 32), _randn(16, 512), ("MLPBlock",), fx=True),
    # benchmarks.models' configs: 8 layers, hidden 256, vocabulary 8192 (tied head: 32 MiB; Llama: 38 MiB)
    OffloadCase("gpt2", _hf("gpt2"), _ids(1, 64), ("GPT2Block",)),
    OffloadCase("llama", _hf("llama"), _ids(1, 64), ("LlamaDecoderLayer",)),
    # for the tests: 8 x Linear(128, 128), 0.5 MiB
    OffloadCase("mlp-tiny", _mlp(128, 8), _randn(4, 128), ("MLPBlock",), fx=True, default=False),
)


def case_named(name: str) -> OffloadCase:
    for case in OFFLOAD_CASES:
        if case.name == name:
            return case
    raise SystemExit(f"unknown offload model {name!r}; models are {', '.join(c.name for c in OFFLOAD_CASES)}")


def _first(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return next(iter(out.values()))
    if hasattr(out, "logits"):
        return out.logits  # type: ignore[no-any-return]
    return _first(out[0])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each tensor once."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(_nbytes(t) for t in tensors.values())


# ---------------------------------------------------------------- counting what is streamed


@dataclass
class Streamed:
    """Bytes and copies streamed in during one forward, and the most held at once (Accelerate's hooks)."""

    nbytes: int = 0
    copies: int = 0
    peak_in_flight: int = 0


@contextmanager
def count_accelerate_streaming() -> Iterator[Streamed]:
    """Count the offloaded weights Accelerate's hooks bring to the execution device (enter it *outside*
    :func:`~benchmarks.accelerate_maps.logical_cpu_devices`, which then wraps the counter)."""
    import accelerate.hooks as hooks

    original = hooks.set_module_tensor_to_device
    seen = Streamed()
    held: dict[tuple[int, str], int] = {}

    def counting(module: nn.Module, name: str, device: Any, *args: Any, **kwargs: Any) -> Any:
        value = kwargs.get("value", args[0] if args else None)
        if str(device) == "meta":
            held.pop((id(module), name), None)
        elif value is not None:
            tied = kwargs.get("tied_params_map")
            reused = tied is not None and value.data_ptr() in tied and device in tied[value.data_ptr()]
            if not reused:
                seen.nbytes += _nbytes(value)
                seen.copies += 1
                held[(id(module), name)] = _nbytes(value)
                seen.peak_in_flight = max(seen.peak_in_flight, sum(held.values()))
        return original(module, name, device, *args, **kwargs)

    hooks.set_module_tensor_to_device = counting
    try:
        yield seen
    finally:
        hooks.set_module_tensor_to_device = original


@contextmanager
def count_fxsplit_streaming(split: nn.Module) -> Iterator[Streamed]:
    """Count the weights the generated code prefetches (``fxsplit.runtime.prefetch``) during a forward."""
    from fxsplit import runtime

    seen = Streamed()

    def counting(weight: torch.Tensor, device: str) -> Any:
        seen.nbytes += _nbytes(weight)
        seen.copies += 1
        return runtime.prefetch(weight, device)

    patched = []
    for module in split.modules():
        if isinstance(module, torch.fx.GraphModule):
            scope = type(module).forward.__globals__
            for key, value in list(scope.items()):
                if value is runtime.prefetch:
                    patched.append((scope, key))
                    scope[key] = counting
    try:
        yield seen
    finally:
        for scope, key in patched:
            scope[key] = runtime.prefetch


# ---------------------------------------------------------------- one case


def _accelerate(
    case: OffloadCase, model: nn.Module, budgets: list[int], host: int, offload_dir: Path
) -> tuple[dict[str, Any], nn.Module | None]:
    """Accelerate's map, where it puts the weights, and the dispatched model (None when it failed)."""
    from benchmarks.accelerate_maps import dispatch, offload_map
    from benchmarks.placements import lookup

    try:
        device_map = offload_map(model, budgets, host, case.block_classes)
    except Exception as error:  # noqa: BLE001 - report whatever Accelerate raises
        return {"placed": False, "error": f"{type(error).__name__}: {error}"}, None
    where: dict[str, int] = {}
    tensors = {id(t): (n, t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    for name, tensor in tensors.values():
        key = str(lookup(device_map, name))
        where[key] = where.get(key, 0) + _nbytes(tensor)
    row: dict[str, Any] = {
        "placed": True,
        "device_map": {k: str(v) for k, v in device_map.items()},
        "device_bytes": [where.get(str(k), 0) for k in range(len(budgets))],
        "host_bytes": where.get("cpu", 0),
        "disk_bytes": where.get("disk", 0),
    }
    row["offloads"] = bool(row["host_bytes"] or row["disk_bytes"])
    try:
        dispatched = dispatch(case.build(), device_map, offload_dir=str(offload_dir), main_device="cpu:0")
    except Exception as error:  # noqa: BLE001
        row.update(placed=False, error=f"dispatch_model: {type(error).__name__}: {error}")
        return row, None
    return row, dispatched


def _fxsplit(
    case: OffloadCase, budgets: dict[str, int], offload: dict[str, Any], **options: Any
) -> tuple[dict[str, Any], nn.Module | None]:
    import fxsplit
    from fxsplit.errors import BudgetError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FxsplitWarning)
        try:
            split = fxsplit.fxsplit(case.build(), budgets, example_inputs=case.inputs(), offload=offload, **options)
        except BudgetError as error:
            return {"placed": False, "error": str(error)}, None
    said = _offload_warnings(caught)
    return {"placed": True, **_plan_numbers(split.meta["fxsplit_plan"]), "warnings": said}, split


def _offload_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """fxsplit's offload warnings (a lowered prefetch); any other warning is shown as usual."""
    mine = [str(w.message) for w in caught if issubclass(w.category, FxsplitWarning) and "offload" in str(w.message)]
    for w in caught:
        if not (issubclass(w.category, FxsplitWarning) and "offload" in str(w.message)):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return mine


def _plan_numbers(plan: Any) -> dict[str, Any]:
    return {
        "stream_bytes": plan.stream_bytes,
        "transfer_bytes": plan.transfer_bytes,
        "device_bytes": [plan.device_bytes.get(d, 0) for d in plan.devices],
        "host_bytes": plan.stored_bytes.get("host", 0),
        "disk_bytes": plan.stored_bytes.get("disk", 0),
        "streaming_buffer": [plan.memory.get(d, {}).get("streaming", 0) for d in plan.devices],
        "streamed_weights": len({c.producer for c in plan.cuts if c.kind == "stream"}),
        "prefetch": plan.offload.get("prefetch"),
    }


def _plan_only(
    case: OffloadCase, model: nn.Module, budgets: dict[str, int], offload: dict[str, Any], **options: Any
) -> dict[str, Any]:
    """An fxsplit plan for the record (no split made): placed or not, and what it streams."""
    import fxsplit
    from fxsplit.errors import BudgetError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FxsplitWarning)
        try:
            plan = fxsplit.plan(model, budgets, example_inputs=case.inputs(), offload=offload, **options)
        except BudgetError as error:
            return {"placed": False, "error": str(error)}
    return {
        "placed": True,
        "stream_bytes": plan.stream_bytes,
        "transfer_bytes": plan.transfer_bytes,
        "prefetch": plan.offload.get("prefetch"),
        "warnings": _offload_warnings(caught),
    }


def _between_bytes(
    case: OffloadCase, model: nn.Module, device_map: dict[str, Any], budgets: list[int]
) -> dict[str, int]:
    """Accelerate's map scored on fxsplit's graph: bytes between devices, and offloaded bytes it implies."""
    from benchmarks.placements import from_device_map, score
    from fxsplit.cost.build import build_problem
    from fxsplit.tracing.capture import trace

    traced = trace(model, example_inputs=case.inputs())
    costs = build_problem(traced.graph_module, model, device_index={})
    mapped = {k: (int(v) if str(v).isdigit() else v) for k, v in device_map.items()}
    result = score(costs, from_device_map(costs, mapped, len(budgets)), budgets)
    return {"bytes_between": result.bytes_between, "stream_bytes_scored": result.offload_bytes}


def offload_case(case: OffloadCase, fraction: float, *, rounds: int, calls: int) -> dict[str, Any]:
    """Everything measured for one model at one device fraction."""
    from benchmarks.accelerate_maps import logical_cpu_devices
    from benchmarks.runtime_overhead import _time_rounds

    model = case.build()
    inputs = case.inputs()
    total = weight_bytes(model)
    each = int(fraction * total / N_DEVICES)
    budgets = [each] * N_DEVICES
    named = {f"cpu:{k}": each for k in range(N_DEVICES)}
    host = int(HOST_FRACTION * total)
    with torch.no_grad():
        reference = _first(model(*inputs))
    row: dict[str, Any] = {
        "model": case.name,
        "n_devices": N_DEVICES,
        "fraction": fraction,
        "total_bytes": total,
        "device_budget": each,
        "host_budget": host,
        "disk_budget": total,
    }
    scratch = Path(tempfile.mkdtemp(prefix="fxsplit-offload-bench-"))
    try:
        acc, dispatched = _accelerate(case, model, budgets, host, scratch / "accelerate")
        offload = {"host": host, "disk": total, "dir": str(scratch / "fxsplit")}
        (scratch / "fxsplit").mkdir()
        fx, split = _fxsplit(case, named, offload, mode="weights")
        again = _fxsplit(case, named, offload, mode="weights")[1] if split is not None else None
        fx_traced = _fxsplit(case, named, offload, mode="weights", trace="fx")[1] if case.fx and split else None
        row["accelerate"], row["fxsplit"] = acc, fx
        row["record"] = {
            "inference_mode": _plan_only(case, model, named, offload),
            "prefetch_0": _plan_only(case, model, named, {**offload, "prefetch": 0}, mode="weights"),
        }
        if acc["placed"]:
            acc.update(_between_bytes(case, model, acc["device_map"], budgets))

        def caller(module: nn.Module, accelerate: bool = False) -> Callable[[], torch.Tensor]:
            def call() -> torch.Tensor:
                if accelerate:
                    with torch.no_grad(), logical_cpu_devices():
                        return _first(module(*inputs))
                with torch.no_grad():
                    return _first(module(*inputs))

            return call

        variants: dict[str, Callable[[], torch.Tensor]] = {"eager": caller(model)}
        if dispatched is not None:
            variants["accelerate"] = caller(dispatched, accelerate=True)
            with count_accelerate_streaming() as seen:
                variants["accelerate"]()
            acc.update(stream_bytes=seen.nbytes, stream_copies=seen.copies, peak_in_flight=seen.peak_in_flight)
        if split is not None:
            variants["fxsplit"] = caller(split)
            with count_fxsplit_streaming(split) as seen:
                variants["fxsplit"]()
            fx.update(stream_bytes_measured=seen.nbytes, stream_copies=seen.copies)
        if again is not None:
            variants["fxsplit-again"] = caller(again)
        if fx_traced is not None:
            variants["fxsplit-fx"] = caller(fx_traced)
        outputs = {name: call() for name, call in variants.items()}
        row["outputs_match"] = {
            name: bool(torch.allclose(out, reference, atol=ATOL, rtol=RTOL)) for name, out in outputs.items()
        }
        row["max_abs_diff"] = {name: float((out - reference).abs().max()) for name, out in outputs.items()}
        if "accelerate" in variants and "fxsplit" in variants:
            seconds = _time_rounds(variants, rounds, calls)
            base = seconds["accelerate"]
            row["rounds"], row["calls_per_round"] = rounds, calls
            row["median_ms"] = {k: 1000 * _median(v) for k, v in seconds.items()}
            row["ratio_to_accelerate"] = {
                k: _median([a / b for a, b in zip(v, base, strict=True)]) for k, v in seconds.items()
            }
            if "fxsplit-again" in seconds:
                row["aa_ratio"] = _median(
                    [a / b for a, b in zip(seconds["fxsplit-again"], seconds["fxsplit"], strict=True)]
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return row


def _median(values: Sequence[float]) -> float:
    from benchmarks.measure import median

    return median(values)


# ---------------------------------------------------------------- bars and headlines


def _size(nbytes: int) -> str:
    from fxsplit.units import format_size

    return format_size(int(nbytes))


def case_label(row: dict[str, Any]) -> str:
    return f"{row['model']}/{round(100 * row['fraction'])}%"


def time_tolerance(row: dict[str, Any]) -> float:
    """The noise allowed on the time ratio: the A/A control's distance from 1 in the same case."""
    return abs(row.get("aa_ratio", 1.0) - 1.0)


def offload_bars(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pass/fail of each offload bar, with the failing cases named."""
    compared = [r for r in rows if r["accelerate"]["placed"] and r["accelerate"].get("offloads")]
    unplaced = [f"{case_label(r)}: {r['fxsplit']['error'][-160:]}" for r in compared if not r["fxsplit"]["placed"]]
    both = [r for r in compared if r["fxsplit"]["placed"] and "stream_bytes" in r["accelerate"]]
    more = [
        f"{case_label(r)}: {_size(r['fxsplit']['stream_bytes'])} > {_size(r['accelerate']['stream_bytes'])}"
        for r in both
        if r["fxsplit"]["stream_bytes"] > r["accelerate"]["stream_bytes"]
    ]
    measured_differs = [
        f"{case_label(r)}: plan {r['fxsplit']['stream_bytes']} B, forward {r['fxsplit'].get('stream_bytes_measured')} B"
        for r in both
        if r["fxsplit"].get("stream_bytes_measured") != r["fxsplit"]["stream_bytes"]
    ]
    timed = [r for r in both if "ratio_to_accelerate" in r]
    slower = [
        f"{case_label(r)}: {r['ratio_to_accelerate']['fxsplit']:.3f} (A/A {r.get('aa_ratio', float('nan')):.3f})"
        for r in timed
        if r["ratio_to_accelerate"]["fxsplit"] > 1.0 + time_tolerance(r)
    ]
    wrong = [
        f"{case_label(r)}: {name}"
        for r in rows
        for name, ok in r.get("outputs_match", {}).items()
        if not ok and name.startswith("fxsplit")
    ]
    acc_wrong = [f"{case_label(r)}" for r in rows if r.get("outputs_match", {}).get("accelerate") is False]
    between = [
        f"{case_label(r)}: {_size(r['fxsplit']['transfer_bytes'])} > {_size(r['accelerate']['bytes_between'])}"
        for r in both
        if r["fxsplit"]["transfer_bytes"] > r["accelerate"].get("bytes_between", 0)
    ]
    ratios = sorted(r["ratio_to_accelerate"]["fxsplit"] for r in timed)
    inference = [r for r in compared if not r["record"]["inference_mode"]["placed"]]
    prefetch0 = [r for r in compared if not r["record"]["prefetch_0"]["placed"]]
    p0_more = [
        f"{case_label(r)}: {_size(r['record']['prefetch_0']['stream_bytes'])} > "
        f"{_size(r['accelerate']['stream_bytes'])}"
        for r in compared
        if r["record"]["prefetch_0"]["placed"]
        and "stream_bytes" in r["accelerate"]
        and r["record"]["prefetch_0"]["stream_bytes"] > r["accelerate"]["stream_bytes"]
    ]
    return {
        "offload: fxsplit places every case Accelerate places with offload": {
            "pass": not unplaced,
            "value": f"{len(compared) - len(unplaced)} of {len(compared)}",
            "failures": unplaced,
        },
        "offload: fxsplit streams <= Accelerate's bytes per forward": {
            "pass": not more,
            "value": f"{len(both) - len(more)} of {len(both)} cases both placed",
            "failures": more,
        },
        "offload: fxsplit forward time <= Accelerate's (tolerance: the case's A/A distance from 1)": {
            "pass": not slower,
            "value": f"fxsplit / Accelerate {ratios[0]:.2f}x to {ratios[-1]:.2f}x ({len(ratios)} cases)"
            if ratios
            else "no case timed",
            "failures": slower,
        },
        "offload: fxsplit's outputs equal the unsplit model's": {"pass": not wrong, "failures": wrong},
        "offload: fxsplit streams in a forward what its plan says": {
            "pass": not measured_differs,
            "failures": measured_differs,
        },
        "info: offload: Accelerate's outputs equal the unsplit model's": {
            "pass": not acc_wrong,
            "failures": acc_wrong,
            "info": True,
        },
        "info: offload: bytes between devices <= Accelerate's": {
            "pass": not between,
            "failures": between,
            "info": True,
        },
        "info: offload: the default mode='inference' places every case Accelerate places": {
            "pass": not inference,
            "failures": [case_label(r) for r in inference],
            "info": True,
        },
        "info: offload: prefetch=0 places every case and streams <= Accelerate's bytes": {
            "pass": not prefetch0 and not p0_more,
            "failures": [f"{case_label(r)}: not placed" for r in prefetch0] + p0_more,
            "info": True,
        },
    }


def offload_headlines(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and ratios that sum the table up."""
    compared = [r for r in rows if r["accelerate"]["placed"] and r["accelerate"].get("offloads")]
    both = [r for r in compared if r["fxsplit"]["placed"] and "stream_bytes" in r["accelerate"]]
    stream = sorted(r["fxsplit"]["stream_bytes"] / max(1, r["accelerate"]["stream_bytes"]) for r in both)
    times = sorted(r["ratio_to_accelerate"]["fxsplit"] for r in both if "ratio_to_accelerate" in r)
    aa = sorted(r["aa_ratio"] for r in both if "aa_ratio" in r)

    def spread(values: list[float]) -> dict[str, float] | None:
        return {"min": values[0], "median": _median(values), "max": values[-1]} if values else None

    return {
        "cases": len(rows),
        "accelerate_offloads": len(compared),
        "fxsplit_placed": sum(1 for r in compared if r["fxsplit"]["placed"]),
        "stream_ratio": spread(stream),
        "time_ratio": spread(times),
        "aa_ratio": spread(aa),
    }


def run_offload(names: Sequence[str], fractions: Sequence[float], *, quick: bool) -> dict[str, Any]:
    """Every case and the bars."""
    rounds, calls = (3, 3) if quick else (10, 5)
    rows = []
    for name in names:
        for fraction in fractions:
            print(f"[fxsplit-bench] offload {name} at {round(100 * fraction)}% ...", flush=True)
            rows.append(offload_case(case_named(name), fraction, rounds=rounds, calls=calls))
    return {
        "settings": {
            "models": list(names),
            "fractions": list(fractions),
            "n_devices": N_DEVICES,
            "host_fraction": HOST_FRACTION,
            "rounds": rounds,
            "calls_per_round": calls,
        },
        "rows": rows,
        "bars": offload_bars(rows),
        "headlines": offload_headlines(rows),
    }


# ---------------------------------------------------------------- report

NOTE = """\
Each case: the model's weights (parameters and buffers, each tensor once) = *total*; N = 2 logical devices
`cpu:0`, `cpu:1` with *fraction* x total / 2 each (the devices together hold *fraction* of the weights);
host storage 0.25 x total, disk storage = total. **Accelerate**: `infer_auto_device_map(model,
max_memory={0: b, 1: b, "cpu": host}, no_split_module_classes=<block classes>)` (the rest on "disk"), then
`dispatch_model(model, device_map, offload_dir=..., main_device="cpu:0")`; its hooks load each offloaded
module's weights onto `cpu:0` before the module runs and drop them after, every forward. **fxsplit**:
`fxsplit.fxsplit(model, {"cpu:0": b, "cpu:1": b}, example_inputs=..., mode="weights", offload={"host": host,
"disk": total, "dir": ...})` (prefetch 1, the default); `mode="weights"` so that a budget means what
`max_memory` means (weights; fxsplit also charges each device its streaming buffers, Accelerate reserves room
for its largest layer on device 0). *streamed / forward*: bytes of stored weights copied to a device per
forward: fxsplit's plan (`plan.stream_bytes`), checked by counting the generated code's `prefetch` calls in
a forward; Accelerate's counted from its hooks' `set_module_tensor_to_device` calls in a forward.
*between devices*: bytes copied between the devices per forward: fxsplit's plan; Accelerate's device map
scored on the same graph (`benchmarks/placements.py`, a lower bound for its hooks). Times: medians of
interleaved forwards (random order each turn), same input, `torch.no_grad()`; *fxsplit / Acc.* is the median
over rounds of the per-round ratio; *A/A* is an identical second fxsplit split against the first (the
resolution of the measurement, and the noise the time bar allows). On logical CPU devices every
`tensor.to("cpu:k")` copies, so fxsplit copies every streamed weight as it would to a GPU, while
Accelerate's hooks (which need `benchmarks.accelerate_maps.logical_cpu_devices` to run here) use weights
offloaded to "cpu" in place and copy only those read from its disk files: the timing favours Accelerate."""

RECORD_NOTE = """\
For the record (not bars): fxsplit with its default `mode="inference"` (activations charged to the devices
as well, which `max_memory` does not count) and with `prefetch=0` (one streaming buffer per device, where
the default keeps two), planned only; `fxsplit-fx`: the same split traced with `trace="fx"` (call_module
ops whose weights are streamed run through `fxsplit.runtime.call_with_weights`), timed with the others."""


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _lowered(numbers: dict[str, Any]) -> str:
    """' (prefetch lowered to N)' where fxsplit warned that it lowered the prefetch asked for."""
    return f" (prefetch lowered to {numbers['prefetch']})" if numbers.get("warnings") else ""


def _where(numbers: dict[str, Any]) -> str:
    devices = " + ".join(_mib(b) for b in numbers["device_bytes"])
    return f"{devices} / {_mib(numbers['host_bytes'])} / {_mib(numbers['disk_bytes'])}"


def _buffers(row: dict[str, Any]) -> str:
    fx = " + ".join(_mib(b) for b in row["fxsplit"].get("streaming_buffer", [])) or "-"
    return f"{_mib(row['accelerate'].get('peak_in_flight'))} / {fx}"


def results_table(rows: list[dict[str, Any]]) -> str:
    """One line per case: where each tool keeps the weights, what it streams and copies, forward times."""
    lines = []
    for r in rows:
        acc, fx = r["accelerate"], r["fxsplit"]
        ms, ratio = r.get("median_ms", {}), r.get("ratio_to_accelerate", {})
        acc_where = _where(acc) if acc["placed"] else "error"
        fx_where = _where(fx) if fx["placed"] else "**not placed**"
        streamed = (
            f"{fx['stream_bytes'] / acc['stream_bytes']:.2f}"
            if fx.get("stream_bytes") is not None and acc.get("stream_bytes")
            else "-"
        )
        lines.append(
            [
                r["model"],
                f"{round(100 * r['fraction'])}%",
                f"{_mib(r['total_bytes'])}",
                f"{_mib(r['device_budget'])} / {_mib(r['host_budget'])} / {_mib(r['disk_budget'])}",
                acc_where,
                fx_where,
                _mib(acc.get("stream_bytes")),
                _mib(fx.get("stream_bytes")) + (_lowered(fx) if fx["placed"] else ""),
                streamed,
                f"{_mib(acc.get('bytes_between'))} / {_mib(fx.get('transfer_bytes'))}",
                f"{ms['eager']:.2f}" if "eager" in ms else "-",
                f"{ms['accelerate']:.2f}" if "accelerate" in ms else "-",
                f"{ms['fxsplit']:.2f}" if "fxsplit" in ms else "-",
                f"**{ratio['fxsplit']:.3f}**" if "fxsplit" in ratio else "-",
                f"{r['aa_ratio']:.3f}" if "aa_ratio" in r else "-",
                "yes" if all(r.get("outputs_match", {}).values()) else f"NO {r.get('outputs_match')}",
            ]
        )
    header = [
        "model",
        "devices hold",
        "weights MiB",
        "budgets MiB: each device / host / disk",
        "Accelerate keeps MiB: devices / host / disk",
        "fxsplit keeps MiB: devices / host / disk",
        "Acc. streamed / fwd MiB",
        "fxsplit streamed / fwd MiB",
        "fxsplit / Acc. streamed",
        "between devices MiB: Acc. / fxsplit",
        "eager ms",
        "Accelerate ms",
        "fxsplit ms",
        "fxsplit / Acc. time",
        "A/A",
        "outputs match",
    ]
    return _table(header, lines)


def record_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        rec, ms, ratio = r["record"], r.get("median_ms", {}), r.get("ratio_to_accelerate", {})

        def cell(p: dict[str, Any]) -> str:
            return f"{_mib(p['stream_bytes'])} MiB{_lowered(p)}" if p["placed"] else "not placed"

        lines.append(
            [
                r["model"],
                f"{round(100 * r['fraction'])}%",
                cell(rec["inference_mode"]),
                cell(rec["prefetch_0"]),
                _buffers(r),
                f"{ms['fxsplit-fx']:.2f} ({ratio['fxsplit-fx']:.3f})" if "fxsplit-fx" in ms else "-",
            ]
        )
    header = [
        "model",
        "devices hold",
        "fxsplit mode='inference': streamed / fwd",
        "fxsplit prefetch=0: streamed / fwd",
        "streaming buffers MiB: Acc. peak held / fxsplit per device",
        "fxsplit-fx ms (/ Acc.)",
    ]
    return _table(header, lines)


def headline_lines(offload: dict[str, Any], *, link: bool = False) -> list[str]:
    """Headline bullets; ``link``: name OFFLOAD_RESULTS.md (in RESULTS.md)."""
    h = offload["headlines"]
    line = (
        "- Offload" + (f" ([{RESULTS_MD}]({RESULTS_MD}))" if link else "") + ": Accelerate offloaded weights in "
        f"{h['accelerate_offloads']} of {h['cases']} cases; fxsplit placed {h['fxsplit_placed']} of them with the "
        "same budgets."
    )
    if h["stream_ratio"]:
        s = h["stream_ratio"]
        line += (
            f" Bytes streamed per forward, fxsplit / Accelerate: median {s['median']:.2f}x "
            f"({s['min']:.2f}x to {s['max']:.2f}x)."
        )
    if h["time_ratio"]:
        t, aa = h["time_ratio"], h["aa_ratio"]
        line += (
            f" Forward time, fxsplit / Accelerate: median {t['median']:.2f}x ({t['min']:.2f}x to {t['max']:.2f}x)"
            + (f"; A/A control {aa['min']:.3f} to {aa['max']:.3f}." if aa else ".")
        )
    return [line]


def markdown(offload: dict[str, Any], context: dict[str, Any]) -> str:
    """OFFLOAD_RESULTS.md: how it was run, the machine, the bars and the tables."""
    from benchmarks.report import _at_commit, _bars_md
    from benchmarks.run import _caveat

    m = context["machine"]
    parts = [
        f"# Offload: fxsplit vs Accelerate when the devices hold part of the weights\n\n"
        f"Written by `{context['command']}` {_at_commit(context.get('commit'))}on {context['started']} "
        f"in {context['duration_s']:.0f} s" + (" (**--quick**: fewer repeats)" if context.get("quick") else "") + ". "
        "Numbers: medians; ratios measured side by side in the same process.",
        _table(["machine", ""], [[k, v] for k, v in m.items()]),
        f"1-minute load average at the start and the end: "
        f"{', '.join(f'{x:.2f}' for x in context['load_samples'])} ({m['cores']} cores). "
        + _caveat(context["load_samples"], m["torch_threads"], m["cores"] or 1),
        "## Headlines\n\n" + "\n".join(headline_lines(offload)),
        "## Bars\n\n" + _bars_md(offload["bars"]),
        "## Cases\n\n" + NOTE + "\n\n" + results_table(offload["rows"]),
        "## For the record\n\n" + RECORD_NOTE + "\n\n" + record_table(offload["rows"]),
    ]
    unplaced = [r for r in offload["rows"] if not r["fxsplit"]["placed"]]
    if unplaced:
        parts.append(
            "Why fxsplit refused (its BudgetError, end):\n\n"
            + "\n".join(f"- {case_label(r)}: ...{r['fxsplit']['error'][-300:]}" for r in unplaced)
        )
    return "\n\n".join(parts) + "\n"


def write_results(offload: dict[str, Any], context: dict[str, Any], out: Path) -> list[Path]:
    """Write OFFLOAD_RESULTS.md and offload_results.json under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / RESULTS_MD, out / RESULTS_JSON
    js.write_text(json.dumps({**context, "offload": offload}, indent=1) + "\n")
    md.write_text(markdown(offload, context))
    return [md, js]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats")
    parser.add_argument("--models", default="", help="comma-separated subset of the offload models")
    parser.add_argument("--fractions", default=",".join(str(f) for f in DEVICE_FRACTIONS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from benchmarks.measure import run_alone
    from benchmarks.run import announce

    names = [n for n in args.models.split(",") if n] or [c.name for c in OFFLOAD_CASES if c.default]
    for name in names:
        case_named(name)
    fractions = [float(f) for f in args.fractions.split(",") if f]
    command = " ".join(["python -m benchmarks.offload", *(argv if argv is not None else sys.argv[1:])])
    offload, context = run_alone(
        command, args.threads, args.quick, lambda: run_offload(names, fractions, quick=args.quick)
    )
    written = write_results(offload, context, args.out)
    print(results_table(offload["rows"]))
    return announce(offload["bars"], written)


if __name__ == "__main__":
    sys.exit(main())
