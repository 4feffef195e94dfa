"""Generated programs planned at bf16 with float32 weights, against the same program cast: a fuzz to run by hand.

``fxsplit.plan(model, dtype="bfloat16")`` of a model with real float32 weights traces it with bf16 stand-ins for
its tensors (:mod:`fxsplit.checkpoint.standin`). Each seed's program (:mod:`random_programs`) is planned that way,
and a copy of it cast as a checkpoint load casts it (floating parameters and persistent buffers) is planned at
bf16 on the inputs the stand-in plan is fed (:mod:`fxsplit.checkpoint.fed`: as given where the cast copy runs them,
else at bf16); :func:`run_seed` says how it went:

* ``equal``: both plans place, count and cut the same (all of :meth:`Plan.to_dict` but the recorded structure,
  which is the float32 model's in one and the cast copy's in the other), the float32 model is left as it was, and
  the stand-in plan applied to the cast copy computes what the cast copy computes;
* ``fallback``: the cast program does not trace, and the plan says so (a warning) and counts the program as given;
* ``eager_fails``: the cast program does not run at bf16 (the generator makes some that do not run at all);
* ``refused``: fxsplit refused both plans with the same error;
* ``wrong``: the plans differ, the model changed, or the split computes something else; ``crash``: any other
  exception.

By hand, every seed in its own process::

    python tests/standin_fuzz.py 50000 50100        # seeds [50000, 50100): a tally, and each wrong or crash
"""

from __future__ import annotations

import copy
import random
import sys
import warnings
from typing import Any

import torch
from fuzzrun import run_seeds, where
from random_programs import generate
from torch.utils._pytree import tree_flatten, tree_map_only

import fxsplit
from fxsplit.checkpoint.cast import cast_floating

__all__ = ["run_seed", "scenario"]

_STRUCTURE = ("fingerprint", "tensors", "tied")  # what each plan records of the model it was given


def scenario(seed: int) -> dict[str, Any]:
    """How ``seed``'s program is planned: trace, mode, devices, budgets' share of the one-device total."""
    draw = random.Random(seed * 7919 + 3)
    return {
        "trace": draw.choice(["fx", "export"]),
        "mode": draw.choice(["training", "inference", "weights"]),
        "devices": draw.choice([2, 3]),
        "share": round(draw.uniform(0.6, 1.1), 3),
    }


def _program(seed: int) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    source, _ = generate(seed)
    namespace: dict[str, Any] = {"__name__": "program"}
    exec(compile(source, f"<program {seed}>", "exec"), namespace)  # noqa: S102 (our own generated source)
    model, args = namespace["make"]()
    return model.float(), tuple(a.float() if a.is_floating_point() else a for a in args)


def _state(model: torch.nn.Module) -> list[tuple[Any, ...]]:
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [(name, id(t), t.dtype, t.device, t.data_ptr(), t.detach().clone()) for name, t in tensors]


def _same_state(before: list[tuple[Any, ...]], after: list[tuple[Any, ...]]) -> bool:
    return len(before) == len(after) and all(
        a[:5] == b[:5] and torch.equal(a[5], b[5]) for a, b in zip(before, after, strict=True)
    )


def _plan_rows(plan: fxsplit.Plan) -> dict[str, Any]:
    return {k: v for k, v in plan.to_dict().items() if k not in _STRUCTURE}


def _bf16(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A copy of each input (a program may write one in place), floating ones at bf16."""
    return tree_map_only(
        torch.Tensor, lambda t: t.to(torch.bfloat16 if t.is_floating_point() else t.dtype, copy=True), args
    )


def _copied(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A copy of each input (a program may write one in place)."""
    return tree_map_only(torch.Tensor, lambda t: t.clone(), args)


def _fed(cast: torch.nn.Module, args: tuple[Any, ...], seed: int) -> tuple[Any, ...]:
    """The inputs a plan at bf16 traces the program on (:mod:`fxsplit.checkpoint.fed`): ``args`` as given where the
    cast program runs them, else at bf16 (the first ``args`` object itself, or a new tuple)."""
    try:
        torch.manual_seed(seed)
        copy.deepcopy(cast)(*_copied(args))
    except Exception:  # noqa: BLE001 - a kernel that refuses two dtypes (or anything: then at bf16, as fxsplit does)
        return _bf16(args)
    return args


def _planned(
    model: torch.nn.Module, inputs: tuple[Any, ...], budgets: dict[str, int], options: dict[str, Any]
) -> tuple[fxsplit.Plan | None, str | None, list[str]]:
    """``fxsplit.plan`` of ``model``: the plan (None: refused), fxsplit's refusal (its first line), the warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            found = fxsplit.plan(model, budgets, example_inputs=inputs, **options)
        except fxsplit.FxsplitError as error:
            return None, f"{type(error).__name__}: {str(error).splitlines()[0]}", [str(w.message) for w in caught]
    return found, None, [str(w.message) for w in caught]


def run_seed(seed: int) -> dict[str, Any]:
    """Plan ``seed``'s program at bf16 both ways (:func:`scenario`) and compare: ``{"seed", "outcome", ...}``."""
    how = scenario(seed)
    result: dict[str, Any] = {"seed": seed, **how}
    torch.manual_seed(seed)
    model, args = _program(seed)
    cast = copy.deepcopy(model)
    cast_floating(cast, torch.bfloat16)
    fed = _fed(cast, args, seed)  # the inputs as given where the cast program runs them, else at bf16
    try:
        torch.manual_seed(seed)
        expected = copy.deepcopy(cast)(*_copied(fed))
    except Exception as error:  # noqa: BLE001 - not every program runs at bf16, or at all
        return {**result, "outcome": "eager_fails", "error": f"{type(error).__name__}: {error}"[:300]}
    result["fed"] = "given" if fed is args else "bf16"
    options: dict[str, Any] = {"mode": how["mode"], "trace": how["trace"], "dtype": "bfloat16"}
    if how["mode"] == "training":
        options["optimizer"] = "sgd"
    before = _state(model)
    try:
        alone = fxsplit.plan(copy.deepcopy(cast), {"cpu:0": 1 << 34}, example_inputs=_copied(fed), **options)
        total = alone.memory["cpu:0"]["total"] if alone.memory else alone.device_bytes["cpu:0"]
        budgets = {f"cpu:{k}": max(1, int(total * how["share"])) for k in range(how["devices"])}
        stood_in, refused, said = _planned(model, args, budgets, options)
        as_cast, refused_cast, _ = _planned(cast, _copied(fed), budgets, options)
    except Exception as error:  # noqa: BLE001 - any other error is a finding
        return {**result, "outcome": "crash", "error": f"{type(error).__name__}: {error}"[:300], "at": where(error)}
    if not _same_state(before, _state(model)):
        return {**result, "outcome": "wrong", "differ": ["the float32 model changed"]}
    if stood_in is None or as_cast is None:
        if refused == refused_cast:
            return {**result, "outcome": "refused", "error": str(refused)[:300]}
        return {**result, "outcome": "wrong", "differ": [f"refusals: stand-in {refused}, cast {refused_cast}"]}
    if any("could not be traced" in s for s in said):
        return {**result, "outcome": "fallback", "error": [s for s in said if "could not be traced" in s][0][:300]}
    mine, theirs = _plan_rows(stood_in), _plan_rows(as_cast)
    differ = [key for key in sorted(set(mine) | set(theirs)) if mine.get(key) != theirs.get(key)]
    if differ:
        return {**result, "outcome": "wrong", "differ": differ[:5], "warnings": said[:3]}
    try:
        gm = fxsplit.apply(cast, stood_in, example_inputs=_copied(fed))
        torch.manual_seed(seed)
        out = gm(*_copied(fed))
    except Exception as error:  # noqa: BLE001
        return {**result, "outcome": "crash", "error": f"{type(error).__name__}: {error}"[:300], "at": where(error)}
    got, want = tree_flatten(out)[0], tree_flatten(expected)[0]
    far = [
        i
        for i, (a, e) in enumerate(zip(got, want, strict=False))
        if isinstance(e, torch.Tensor)
        and (
            not isinstance(a, torch.Tensor)
            or a.shape != e.shape
            or not torch.allclose(a.cpu(), e, rtol=2e-2, atol=2e-2, equal_nan=True)
        )
    ]
    if len(got) != len(want) or far:
        return {**result, "outcome": "wrong", "differ": [f"output {i}" for i in far] or ["output count"]}
    return {**result, "outcome": "equal", "used": sorted(set(stood_in.placement.values()))}


def main(first: int, last: int) -> int:
    """Run seeds ``[first, last)``, each in its own process; print the tally (:func:`fuzzrun.run_seeds`)."""
    return run_seeds("standin_fuzz", first, last, shown=("fallback",))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
