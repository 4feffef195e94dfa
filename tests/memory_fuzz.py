"""Generated programs (:mod:`random_programs`) split, run, and the allocator's peak on each device compared with the
activation peak the plan charged there: a fuzz to run by hand.

The budget promise (``docs/GUARANTEES.md``, section 2) rests on the memory model: a device holds its weights and at
most the plan's ``activations_peak`` while the split runs. Each seed's program is planned as the seed says
(torch.fx or torch.export; inference or training; 2 or 3 devices; budgets at a part of the one-device total), its
split run once (a forward under ``torch.no_grad()`` in inference; a forward and a backward in training) under
:func:`~fxsplit.memory.allocmeter.allocated_peaks`, and each device's measured peak compared with its row.
:func:`run_seed` says how it went:

* ``within``: no device held more than the plan charged it (bytes the meter could not place on a device, ``"?"``
  in ``measured``, aside);
* ``over``: some device held more (``over`` lists them with both numbers): the budget could be exceeded;
* ``refused``: fxsplit refused the plan with one of its own errors;
* ``not_counted``: the plan could not count activations (it says so, and warns);
* ``eager_fails``: the unsplit program itself does not run;
* ``crash``: any other exception, from planning, the split or the meter.

By hand, every seed in its own process::

    python tests/memory_fuzz.py 70000 70100        # seeds [70000, 70100): a tally, and each over or crash

It exits 1 when a seed is ``over`` or ``crash``.
"""

from __future__ import annotations

import copy
import random
import sys
from typing import Any

import torch
from fuzzrun import run_seeds, weighted_loss, where
from split_fuzz import _program

import fxsplit
from fxsplit.memory.allocmeter import allocated_peaks

__all__ = ["run_seed", "scenario"]


def scenario(seed: int) -> dict[str, Any]:
    """How ``seed``'s program is planned: trace, mode, devices, budgets' share of the one-device total."""
    draw = random.Random(seed * 7919 + 3)
    return {
        "trace": draw.choice(["fx", "export"]),
        "mode": draw.choice(["training", "inference"]),
        "devices": draw.choice([2, 2, 3]),
        "share": round(draw.uniform(0.6, 1.2), 3),
    }


def run_seed(seed: int) -> dict[str, Any]:
    """Plan and run ``seed``'s program as :func:`scenario` says; its measured peaks against the plan's rows."""
    how = scenario(seed)
    result: dict[str, Any] = {"seed": seed, **how}
    model, args, _ = _program(seed)
    training = how["mode"] == "training"
    try:
        with torch.set_grad_enabled(training):
            loss = weighted_loss(copy.deepcopy(model)(*(a.clone() for a in args)))
        if loss.requires_grad:
            loss.backward()
    except Exception as error:  # noqa: BLE001 - the generator makes programs that do not run
        return {**result, "outcome": "eager_fails", "error": f"{type(error).__name__}: {error}"[:300]}
    devices = [f"cpu:{k}" for k in range(how["devices"])]
    options: dict[str, Any] = {"mode": how["mode"], "trace": how["trace"], "example_inputs": args}
    if training:
        options["optimizer"] = "sgd"
    try:
        alone = fxsplit.plan(copy.deepcopy(model), {"cpu:0": 1 << 34}, **options)
        if not alone.memory or alone.activations_not_counted:
            return {**result, "outcome": "not_counted", "why": str(alone.activations_not_counted)[:200]}
        budgets = {d: max(1, int(alone.memory["cpu:0"]["total"] * how["share"])) for d in devices}
        gm = fxsplit.fxsplit(model, budgets, **options)
    except fxsplit.FxsplitError as error:
        return {**result, "outcome": "refused", "error": f"{type(error).__name__}: {error}"[:300]}
    except Exception as error:  # noqa: BLE001 - any other error is a finding
        return {**result, "outcome": "crash", "error": f"{type(error).__name__}: {error}"[:300], "at": where(error)}
    plan = gm.meta["fxsplit_plan"]
    run_args = tuple(a.clone() for a in args)
    try:
        torch.manual_seed(seed)
        with torch.set_grad_enabled(training):
            measured = allocated_peaks(gm, *run_args, backward=training and _needs_grad(gm, run_args))
    except Exception as error:  # noqa: BLE001
        return {**result, "outcome": "crash", "error": f"{type(error).__name__}: {error}"[:300], "at": where(error)}
    over = {
        device: {"measured": measured[device], "planned": plan.memory[device]["activations_peak"]}
        for device in plan.devices
        if measured.get(device, 0) > plan.memory[device]["activations_peak"]
    }
    planned = {device: plan.memory[device]["activations_peak"] for device in plan.devices}
    used = sorted(set(plan.placement.values()))
    outcome = "over" if over else "within"
    return {**result, "outcome": outcome, "over": over, "measured": measured, "planned": planned, "used": used}


def _needs_grad(gm: torch.fx.GraphModule, args: tuple[Any, ...]) -> bool:
    """Whether a loss of the split's outputs has a gradient (some programs return constants only)."""
    return weighted_loss(gm(*(a.clone() for a in args))).requires_grad


def main(first: int, last: int) -> int:
    """Run seeds ``[first, last)``, each in its own process; print the tally (:func:`fuzzrun.run_seeds`)."""
    return run_seeds("memory_fuzz", first, last, bad=("over", "crash"))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
