"""Generated programs (:mod:`random_programs`) split and compared with the unsplit model: a fuzz to run by hand.

Each seed's program is split as the seed says (torch.fx or torch.export; training, inference or weights mode; 2 or
3 devices; each segment pinned, or budgets at a part of the one-device total; replicas on half of the inference
runs), run in float64 under a :class:`~fxsplit.check.DeviceChecker` (``host_anywhere``: attention's causal mask)
beside an unsplit deep copy, and its outputs, every parameter's gradient and the buffers compared.
:func:`run_seed` says how it went:

* ``equal``: the split computed what the model computes;
* ``refused``: fxsplit refused the plan with one of its own errors (a budget that cannot hold it, pins that
  split one in-place write);
* ``eager_fails``: the unsplit program itself does not run (the generator makes some that do not);
* ``wrong``: outputs, gradients or buffers differ; ``crash``: any other exception, from planning or the split.

``tests/test_split_fuzz.py`` runs a fixed set of seeds in CI. By hand, every seed in its own process::

    python tests/split_fuzz.py 40000 40200        # seeds [40000, 40200): a tally, and each wrong or crash

It exits 1 when a seed is ``wrong`` or ``crash``.
"""

from __future__ import annotations

import copy
import random
import sys
from typing import Any

import torch
from fuzzrun import differences, run_seeds, weighted_loss, where
from random_programs import generate

import fxsplit
from fxsplit.check import DeviceChecker

__all__ = ["scenario", "run_seed"]


def scenario(seed: int) -> dict[str, Any]:
    """How ``seed``'s program is split: trace, mode, devices, pins or budgets' share, replicas."""
    draw = random.Random(seed * 104729 + 7)
    mode = draw.choice(["training", "training", "inference", "weights"])
    return {
        "trace": draw.choice(["fx", "export"]),
        "mode": mode,
        "devices": draw.choice([2, 2, 3]),
        "pinned": draw.random() < 0.4,
        "share": round(draw.uniform(0.45, 1.0), 3),
        "replicate": mode != "training" and draw.random() < 0.5,
    }


def _program(seed: int) -> tuple[Any, tuple[Any, ...], list[str]]:
    source, segments = generate(seed)
    namespace: dict[str, Any] = {"__name__": "program"}
    exec(compile(source, f"<program {seed}>", "exec"), namespace)  # noqa: S102 (our own generated source)
    model, args = namespace["make"]()
    model = model.double()
    args = tuple(a.double() if a.is_floating_point() else a for a in args)
    return model, args, segments


def run_seed(seed: int) -> dict[str, Any]:
    """Split ``seed``'s program as :func:`scenario` says and compare it with eager: ``{"seed", "outcome", ...}``."""
    how = scenario(seed)
    result: dict[str, Any] = {"seed": seed, **how}
    model, args, segments = _program(seed)
    reference = copy.deepcopy(model)
    eager_args = tuple(a.clone() for a in args)  # each run its own inputs: a program may write one in place
    try:
        torch.manual_seed(seed)  # the same random numbers (dropout) for both
        expected = reference(*eager_args)
        eager_loss = weighted_loss(expected)
        if eager_loss.requires_grad and how["mode"] == "training":
            eager_loss.backward()
    except Exception as error:  # noqa: BLE001 - the generator makes programs that do not run
        return {**result, "outcome": "eager_fails", "error": f"{type(error).__name__}: {error}"[:300]}
    devices = [f"cpu:{k}" for k in range(how["devices"])]
    options: dict[str, Any] = {"mode": how["mode"], "trace": how["trace"], "example_inputs": args}
    if how["mode"] == "training":
        options["optimizer"] = "sgd"
    if how["replicate"]:
        options["replicate"] = True
    try:
        if how["pinned"] and len(segments) > 1:  # the first segment on the first device, the last on the last
            draw = random.Random(seed)
            homes = sorted([0, len(devices) - 1, *(draw.randrange(len(devices)) for _ in segments[2:])])
            options["pins"] = {segment: devices[k] for segment, k in zip(segments, homes, strict=True)}
            budgets = dict.fromkeys(devices, 1 << 34)
        else:
            alone = fxsplit.plan(copy.deepcopy(model), {"cpu:0": 1 << 34}, **options)
            total = alone.memory["cpu:0"]["total"] if alone.memory else alone.device_bytes["cpu:0"]
            budgets = {d: max(1, int(total * how["share"])) for d in devices}
        gm = fxsplit.fxsplit(model, budgets, **options)
    except fxsplit.FxsplitError as error:
        return {**result, "outcome": "refused", "error": f"{type(error).__name__}: {error}"[:300]}
    except Exception as error:  # noqa: BLE001 - any other error is a finding
        return {**result, "outcome": "crash", "error": f"{type(error).__name__}: {error}"[:300], "at": where(error)}
    run_args = tuple(a.clone() for a in args)
    try:
        torch.manual_seed(seed)
        with DeviceChecker(gm.meta["fxsplit_plan"], gm, model, host_anywhere=True):  # attention's causal mask
            out = gm(*run_args)
        if how["mode"] == "training":
            loss = weighted_loss(out)
            if loss.requires_grad:
                loss.backward()
    except Exception as error:  # noqa: BLE001
        return {**result, "outcome": "crash", "error": f"{type(error).__name__}: {error}"[:300], "at": where(error)}
    differ = differences(out, expected, model, reference)
    differ += [f"input {i}" for i, (a, e) in enumerate(zip(run_args, eager_args, strict=True)) if not torch.equal(a, e)]
    used = sorted(set(gm.meta["fxsplit_plan"].placement.values()))
    return {**result, "outcome": "wrong" if differ else "equal", "differ": differ[:5], "used": used}


def main(first: int, last: int) -> int:
    """Run seeds ``[first, last)``, each in its own process; print the tally (:func:`fuzzrun.run_seeds`)."""
    return run_seeds("split_fuzz", first, last)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
