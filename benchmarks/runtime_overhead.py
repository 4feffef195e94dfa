"""Runtime overhead: the generated module vs the same placement by hand vs Accelerate's hooks.

For a model and N logical devices (``cpu:0`` ... ``cpu:N-1``, tight budgets so
every device is used), fxsplit makes a plan and a GraphModule; then, on fresh
copies of the model with the same weights:

* ``hand``: the plan written by hand in eager PyTorch (:mod:`benchmarks.hand_placed`);
* ``accelerate``: ``dispatch_model`` with the same device map (each module on
  the device fxsplit gave its parameters); on logical devices its hooks copy
  every module's inputs on every call (``tensor.to("cpu:k")`` always copies);
* ``accelerate-hooks``: the same hooks, all on ``"cpu"`` (``force_hooks=True``),
  where ``.to`` is a no-op: the hooks' own cost with no copies at all, a lower
  bound of Accelerate's cost on real devices;
* ``eager``: the unsplit model on one device, for scale;
* ``hand-again``: a second, identical hand-written module: its ratio to ``hand``
  shows how finely this machine can resolve a difference (an A/A test);
* ``fxsplit-fx``: fxsplit with ``trace="fx"`` where ``torch.fx`` can trace the
  model (not Hugging Face models), to show what the export graph costs.

Every variant's output is checked against the unsplit model. Timing is
interleaved call by call (one forward of each variant in turn, in a random
order each turn, ``calls`` turns per round), so load on a shared machine hits
all alike and no variant always follows the same one; a round's time for a variant is the median of its calls, and its
ratio is the median over rounds of (its time / hand's time in that round).
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Sequence

import torch
from accelerate.utils.modeling import clean_device_map

import fxsplit
from benchmarks.accelerate_maps import dispatch
from benchmarks.hand_placed import hand_placed
from benchmarks.measure import median
from benchmarks.models import Case, case_by_name
from fxsplit.errors import FxsplitError
from fxsplit.planning.plan import Plan

__all__ = ["RUNTIME_MODELS", "VARIANT_NAMES", "run_runtime"]

RUNTIME_MODELS = ("mlp48", "gpt2")
VARIANT_NAMES = ("fxsplit", "hand", "accelerate", "accelerate-hooks", "eager", "hand-again", "fxsplit-fx")


def _first(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return next(iter(out.values()))
    return _first(out[0])


def plan_device_map(plan: Plan) -> dict[str, Any]:
    """Module -> device (int index) for every module holding parameters, as fxsplit placed them."""
    index = {d: k for k, d in enumerate(plan.devices)}
    leaf = {name.rpartition(".")[0]: index[device] for name, device in plan.param_devices.items()}
    return dict(clean_device_map(dict(sorted(leaf.items()))))


def share_weights(target: torch.nn.Module, source: torch.nn.Module) -> torch.nn.Module:
    """Make ``target`` (the same architecture) hold ``source``'s very parameter and buffer objects."""
    tensors = [*source.named_parameters(remove_duplicate=False), *source.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        owner_path, _, leaf = name.rpartition(".")
        owner = target.get_submodule(owner_path)
        if leaf in owner._parameters:
            owner._parameters[leaf] = tensor  # type: ignore[assignment]
        else:
            owner._buffers[leaf] = tensor
    return target


def build_variants(case: Case, n: int) -> tuple[dict[str, Callable[[], Any]], Plan]:
    """The variants' callables, each running one forward on the case's inputs.

    Every variant computes with the very same weight tensors (those fxsplit
    placed), so where they sit in memory cannot favour one variant: only the
    code paths differ. The hand-written placements reuse the split model's
    modules without moving them again (on logical CPU devices a move is only a
    copy); Accelerate gets its own module objects, for its hooks, holding the
    same tensors.
    """
    inputs = case.inputs()
    model = case.build()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    budgets = {f"cpu:{k}": int(1.1 * total / n) for k in range(n)}
    split = fxsplit.fxsplit(model, budgets, example_inputs=inputs, mode="weights")  # moves the model's weights in place
    plan: Plan = split.meta["fxsplit_plan"]
    device_map = plan_device_map(plan)
    modules = {
        "fxsplit": split,
        "hand": hand_placed(case.name, model, plan, move=False),
        "accelerate": dispatch(share_weights(case.build(), model), device_map),
        "accelerate-hooks": dispatch(
            share_weights(case.build(), model), {k: "cpu" for k in device_map}, force_hooks=True
        ),
        "eager": model,
        "hand-again": hand_placed(case.name, model, plan, move=False),
    }
    try:  # for the record: the same split from a torch.fx trace, where the model allows one
        modules["fxsplit-fx"] = fxsplit.fxsplit(
            share_weights(case.build(), model), budgets, example_inputs=inputs, trace="fx", mode="weights"
        )
    except FxsplitError:
        pass

    def caller(module: Any) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return module(*inputs)

        return call

    return {name: caller(m) for name, m in modules.items()}, plan


def _check(variants: dict[str, Callable[[], Any]]) -> dict[str, bool]:
    reference = _first(variants["eager"]())
    return {
        name: bool(torch.allclose(_first(call()).to("cpu"), reference, atol=1e-4, rtol=1e-4))
        for name, call in variants.items()
    }


def _time_rounds(variants: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, list[float]]:
    """Per round and variant, the median of ``calls`` forwards; the variants take turns call by call,
    in a fresh random order each turn (seeded), so none always follows the same neighbour."""
    names = list(variants)
    rng = random.Random(0)
    for call in variants.values():
        for _ in range(3):
            call()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        taken: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(calls):
            for name in rng.sample(names, len(names)):
                start = time.perf_counter()
                variants[name]()
                taken[name].append(time.perf_counter() - start)
        for name in names:
            seconds[name].append(median(taken[name]))
    return seconds


def runtime_case(name: str, n: int, rounds: int, calls: int) -> dict[str, Any]:
    """Times and ratios (to hand placement) of every variant for one model on ``n`` devices."""
    case = case_by_name(name)
    variants, plan = build_variants(case, n)
    correct = _check(variants)
    seconds = _time_rounds(variants, rounds, calls)
    hand = seconds["hand"]
    return {
        "model": name,
        "n_devices": n,
        "rounds": rounds,
        "calls_per_round": calls,
        "devices_used": len({d for d in plan.param_devices.values()}),
        "cuts": len([c for c in plan.cuts if c.kind != "output"]),
        "outputs_match": correct,
        "median_ms": {k: 1000 * median(v) for k, v in seconds.items()},
        "ratio_to_hand": {k: median([a / b for a, b in zip(v, hand, strict=True)]) for k, v in seconds.items()},
    }


def runtime_bars(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """fxsplit within 3% of hand placement, per model and N; Accelerate's ratio for the record."""
    bars = {}
    for row in rows:
        ratio = row["ratio_to_hand"]["fxsplit"]
        bars[f"{row['model']} N={row['n_devices']}: fxsplit <= 1.03 x hand placement"] = {
            "pass": ratio <= 1.03 and all(row["outputs_match"].values()),
            "value": f"{ratio:.3f} (Accelerate {row['ratio_to_hand']['accelerate']:.2f}, "
            f"hooks only {row['ratio_to_hand']['accelerate-hooks']:.2f}; "
            f"A/A control {row['ratio_to_hand']['hand-again']:.3f})",
        }
    return bars


def run_runtime(models: Sequence[str], *, quick: bool, device_counts: Sequence[int] = (2, 4)) -> dict[str, Any]:
    """Every runtime row and the bars."""
    rounds, calls = (5, 5) if quick else (30, 10)
    rows = [runtime_case(name, n, rounds, calls) for name in models for n in device_counts]
    return {"rows": rows, "bars": runtime_bars(rows)}
