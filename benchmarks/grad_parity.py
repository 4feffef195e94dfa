"""Training over two devices against the unsplit model: the loss and every parameter's gradient, for every causal LM.

For every causal LM type transformers names (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), or those given: the small
config of :mod:`benchmarks.dtype_parity` with every dropout probability set to 0, random weights, ``eval()`` (no
random draws), float32, then

* the unsplit model: ``loss.backward()`` on a copy (the reference) and, when some gradient of the split differs,
  on a float64 copy (the exact gradients);
* a copy of the model split by ``fxsplit.fxsplit(..., mode="training")`` over ``cpu:0``/``cpu:1``, each budget 0.6
  of what one device holding the whole model needs (its plan's memory row), and again at 0.75 (another cut):
  ``loss.backward()``.

A row is ``equal`` when the loss and every gradient are the reference's bit for bit; ``rounding`` when the loss is
and some gradients differ, but each is as close to the float64 gradient as the reference's (its largest error at most
``ROUNDING`` times the reference's, plus one float32 step of the tensor's largest value): autograd adds the
gradients of a value read on both devices in another order (docs/GUARANTEES.md, "To the bit?"); ``unchecked``
when so but the model does not run in float64 to tell; ``trace differs`` when the loss is not the reference's
but is that of ``torch.export.export(model).module()``, the graph the split runs; ``fail`` otherwise, or when
fxsplit raised on a model the reference ran (but for a ``BudgetError``: ``refused``, as training memory is not
additive and a split need not fit). A model whose small config does not build or run is listed as not run; one over
3M parameters at these sizes is skipped.

    python -m benchmarks.grad_parity [--out benchmarks/GRAD_PARITY.md] [kinds ...]

Exits 1 when a row fails.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

import fxsplit
from benchmarks.dtype_parity import MAX_PARAMETERS, small_config

__all__ = ["FRACTIONS", "ROUNDING", "classify", "main", "one", "report"]

FRACTIONS = (0.6, 0.75)  # each device's budget, of what one device holding the whole model needs: one split each
ROUNDING = 2.0  # a differing gradient's error against float64 may be this many times the reference's


def _without_dropout(config: Any) -> Any:
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key or key.endswith("_drop")):
            try:
                setattr(config, key, 0.0)
            except Exception:  # noqa: BLE001 - a config that checks each value: leave that one
                pass
    return config


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids, use_cache=False)
    return out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]


def classify(
    got: dict[str, torch.Tensor | None],
    want: dict[str, torch.Tensor | None],
    exact: dict[str, torch.Tensor | None] | None,
) -> tuple[str, list[str], float]:
    """``(status, names of differing gradients, largest ratio of errors)``: ``equal``, ``rounding`` or ``fail``
    for the split's gradients ``got`` against the reference's ``want`` and the float64 ones ``exact``, by name;
    ``unchecked`` when some differ and there are no float64 gradients (``exact`` None) to tell rounding apart."""
    differ, worst, wrong = [], 0.0, False
    for name, grad in got.items():
        ref = want.get(name)
        if grad is None or ref is None:
            if (grad is None) != (ref is None):
                differ.append(name)
                wrong = True
            continue
        if torch.equal(grad, ref):
            continue
        differ.append(name)
        if exact is None:
            continue
        truth = exact.get(name)
        if truth is None or grad.shape != ref.shape:
            wrong = True
            continue
        step = torch.finfo(ref.dtype).eps * ref.abs().max().item()
        ours = (grad.double() - truth).abs().max().item()
        theirs = (ref.double() - truth).abs().max().item()
        worst = max(worst, ours / theirs if theirs else float("inf"))
        wrong = wrong or ours > ROUNDING * theirs + step
    if wrong:
        return "fail", sorted(differ), worst
    return ("equal" if not differ else "unchecked" if exact is None else "rounding"), sorted(differ), worst


def one(kind: str, fractions: Sequence[float] = FRACTIONS) -> list[dict[str, Any]]:
    """One model type, a row per budget fraction: ``status`` (``equal``, ``rounding``, ``unchecked``, ``fail``,
    ``refused``, ``skipped``, ``not run``) and what was seen."""
    from transformers import AutoModelForCausalLM

    try:
        config = _without_dropout(small_config(kind))
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMETERS:
            return [{"kind": kind, "status": "skipped", "why": f"{size:,} parameters at these sizes"}]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
        reference, unsplit = copy.deepcopy(model), copy.deepcopy(model)  # (the float64 copy is made of ``unsplit``)
        want_loss = _loss(reference, ids)
        want_loss.backward()
    except Exception as error:  # noqa: BLE001 - this script's config, or the reference: not run
        return [{"kind": kind, "status": "not run", "why": f"{type(error).__name__}: {_first(error)}"}]
    want = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False)}
    exact: list[dict[str, torch.Tensor | None] | None] = []  # made once, when some gradient first differs
    options = dict(example_inputs=(ids,), example_kwargs={"labels": ids, "use_cache": False}, mode="training")
    rows = []
    for fraction in fractions:
        start = time.perf_counter()
        row: dict[str, Any] = {"kind": kind, "fraction": fraction}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                alone = fxsplit.plan(unsplit, {"cpu:0": 1 << 40}, **options)
                budget = int(fraction * alone.memory["cpu:0"]["total"])
                split = fxsplit.fxsplit(copy.deepcopy(unsplit), {"cpu:0": budget, "cpu:1": budget}, **options)
            loss = _loss(split, ids)
            loss.backward()
        except fxsplit.BudgetError as error:  # a split of training memory need not fit twice the budget
            rows.append({**row, "status": "refused", "why": f"BudgetError: {_first(error)}"})
            continue
        except Exception as error:  # noqa: BLE001 - reported as the row's failure
            rows.append({**row, "status": "fail", "why": f"fxsplit raised {type(error).__name__}: {_first(error)}"})
            continue
        grads = {name: p.grad for name, p in split.named_parameters()}
        if not exact and any(not _same(g, want.get(n)) for n, g in grads.items()):
            exact.append(_exact(unsplit, ids))
        status, differ, worst = classify(grads, want, exact[0] if exact else {})
        rows.append(
            {
                **row,
                "status": status if torch.equal(loss.detach(), want_loss.detach()) else _differs(unsplit, ids, loss),
                "devices": len(set(split.meta["fxsplit_plan"].param_devices.values())),
                "loss_diff": (loss.detach() - want_loss.detach()).abs().item(),
                "gradients": len(grads),
                "differ": differ,
                "error_ratio": worst,
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    return rows


def _differs(unsplit: torch.nn.Module, ids: torch.Tensor, loss: torch.Tensor) -> str:
    """``trace differs`` when the split's loss is that of torch.export's own module of the model (the graph the split
    runs: the model's code took another path while traced, docs/GUARANTEES.md), else ``fail``."""
    try:
        with torch.no_grad():
            exported = torch.export.export(copy.deepcopy(unsplit), (), dict(input_ids=ids, labels=ids, use_cache=False))
            theirs = _loss(exported.module(), ids)
    except Exception:  # noqa: BLE001 - no export to compare with: the difference stands
        return "fail"
    return "trace differs" if torch.equal(theirs, loss.detach()) else "fail"


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _exact(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor | None] | None:
    """The float64 model's gradients (of ``model``'s weights as they were split: the same values), or None where
    the model does not run in float64 (a grouped matmul of MoE experts takes no double)."""
    try:
        exact = copy.deepcopy(model).double()
        _loss(exact, ids).backward()
    except Exception:  # noqa: BLE001 - no float64 run: the differences are not checked against it
        return None
    return {name: p.grad for name, p in exact.named_parameters(remove_duplicate=False)}


def _first(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:160] if lines else ""


def report(rows: list[dict[str, Any]]) -> str:
    """The results file: the counts, then one line per model type."""
    statuses = ("equal", "rounding", "unchecked", "trace differs", "fail", "refused", "skipped", "not run")
    counts = {status: sum(r["status"] == status for r in rows) for status in statuses}
    lines = [
        "# Training over two devices: fxsplit's loss and gradients against the unsplit model's",
        "",
        "`python -m benchmarks.grad_parity` (see its docstring). Equal: the loss and every gradient bit for bit.",
        "Rounding: the loss bit for bit, some gradients not, each as close to the float64 gradient as the unsplit",
        f"model's (error ratio: the split's largest error over the reference's; at most {ROUNDING:g}, plus one",
        "float32 step of the tensor's largest value). Unchecked: the loss bit for bit, some gradients not, and the",
        "model does not run in float64 to tell (a MoE's grouped matmul). Trace differs: the loss is not the eager",
        "model's but is torch.export's own module's to the bit (the graph the split runs; docs/GUARANTEES.md).",
        "",
        ", ".join(f"{status}: {n}" for status, n in counts.items()),
        "",
        "| model type | budgets | result | devices | gradients differ | error ratio | seconds / why |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "gradients" in r:
            differ = f"{len(r['differ'])} of {r['gradients']}"
            ratio = f"{r['error_ratio']:.2f}" if r["differ"] else ""
            row = f"{r['status']} | {r['devices']} | {differ} | {ratio} | {r['seconds']}"
        else:
            row = f"{r['status']} | | | | {r['why'].replace('|', '/')}"
        lines.append(f"| {r['kind']} | {r.get('fraction', '')} | {row} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", help="model types (default: every causal LM type transformers names)")
    parser.add_argument("--out", default="benchmarks/GRAD_PARITY.md")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = []
    for kind in args.kinds or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        for row in one(kind):
            rows.append(row)
            print(row, flush=True)
    Path(args.out).write_text(report(rows))
    failed = [r["kind"] for r in rows if r["status"] == "fail"]
    print(f"wrote {args.out}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
