"""The route fuzz's third set of routes (:mod:`route_fuzz`, from seed 62000 on): another batch size, optimizer
steps, and the command line.

* ``resized``: planned and split with the program's example inputs (``torch.export`` with
  ``dynamic_shapes="batch"``, ``torch.fx`` plain), then run on inputs of another batch size (:func:`batch_of`:
  smaller or larger; every input's leading dimension changed, its dtype kept; drawn from the seed) and compared
  with the unsplit program on them: outputs, and in training every gradient. The program failing eagerly at the
  new batch (a size written into it) is ``eager_fails``; fxsplit's own error when planning, or when an export
  split is called (``InputMismatchError``), ``refused``; any other error of the split where eager runs, ``crash``.
* ``train_steps``: ``mode="training"`` with the optimizer drawn (SGD with momentum, Adam or AdamW, planned by its
  name), sometimes two ``Linear`` weights of one shape tied first, and sometimes ``accumulate_grads=True``: three
  steps of ``torch.optim`` on ``split.parameters()`` and on an unsplit copy, each step after one backward of
  :func:`fuzzrun.weighted_loss` or (accumulating) two, on the same inputs (new ones each micro-step, drawn from
  the seed); then every entry of the two ``state_dict()`` (by name, on the CPU, within :func:`fuzzrun.close64`'s
  tolerance, NaN equal to NaN), and the outputs and gradients of a fourth forward, compared;
  ``split.parameters()`` must yield each of the model's parameters once (a tied weight once), and nothing else.
* ``cli``: the program written to ``program.py`` with a factory ``make()`` that gives it at float64 as the fuzz
  runs it, and a YAML spec (budgets at a part of the one-device total, ``trace``, ``mode``, ``optimizer: sgd`` and
  ``accumulate_grads`` in training, pins, ``objective``; or the budgets, trace and mode as ``--budget``,
  ``--trace``, ``--mode`` flags); the command line's entry point (``fxsplit.cli.main``) called in this process
  for ``plan MODEL --spec SPEC -o plan.yaml``, ``check MODEL --plan plan.yaml`` and ``code MODEL --plan
  plan.yaml`` (``--raw`` or readable); the saved plan must equal ``fxsplit.plan`` of the same spec and options,
  ``check`` must pass it, and ``code`` must print the code of ``fxsplit.apply`` of it (``gm.code``, or
  ``fxsplit.show_code(gm)``), whose split is compared with eager. ``plan`` exiting 1 (does not fit) or 2 (bad
  input) is ``refused`` when ``fxsplit.plan`` raises the same kind of error (``BudgetError`` for 1, another
  ``FxsplitError`` for 2), else ``crash``; a spec that pins a module the program lacks (:data:`TYPO`) must exit 2
  naming it; exit 3, or a later command failing, is a ``crash``.

A refused or failed row keeps its error's first line whole (``reason``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import random
import sys
import warnings
from typing import Any, Callable

import torch
from fuzzrun import differences, weighted_loss
from route_fuzz import Case, _compared, _one_device_total, _pins, _row, _size_text, _split

import fxsplit
from fxsplit.check import DeviceChecker

__all__ = ["FACTORY", "OPTIMIZERS", "TYPO", "batch_of", "choices", "first_line", "inputs_like", "run"]

OPTIMIZERS = ("sgd_momentum", "adam", "adamw")  # as fxsplit names them; torch's in _optimizer()
TYPO = "zz"  # a pin of a module no program has: the command line must refuse it (exit 2) naming it
FACTORY = '''

_make_float32 = make


def make():
    """The program at float64, as the route fuzz runs it (route_fuzz._make)."""
    model, args = _make_float32()
    return model.double(), tuple(a.double() if a.is_floating_point() else a for a in args)
'''


def choices(route: str, draw: random.Random) -> dict[str, Any]:
    """The route's own choices, drawn after those :func:`route_fuzz.scenario` draws for every route."""
    if route == "resized":
        return {
            "mode": draw.choice(["training", "training", "inference"]),
            "share": round(draw.uniform(0.6, 0.98), 3),  # below 1: not all on one device
            "resize": draw.choice(["down", "up"]),
            "batch_draw": round(draw.random(), 3),
        }
    if route == "train_steps":
        accumulate = draw.random() < 0.4
        return {
            "mode": "training",
            "share": round(draw.uniform(0.6, 0.98), 3),
            "optimizer": draw.choice(OPTIMIZERS),
            "accumulate": accumulate,
            "set_to_none": not accumulate or draw.random() < 0.5,  # zero_grad(set_to_none=...) before each step
            "tie": draw.random() < 0.4,
        }
    mode = draw.choice(["training", "training", "inference", "weights"])
    return {
        "mode": mode,
        "share": round(draw.uniform(0.45, 0.98), 3),  # some too small: refused (exit 1)
        "unit": draw.choice(["B", "KiB", "kB"]),
        "pinned": draw.random() < 0.3,
        "typo": draw.random() < 0.1,
        "objective": draw.choice(["min_transfer", "min_transfer", "balanced"]),
        "accumulate": mode == "training" and draw.random() < 0.3,
        "flags": draw.random() < 0.4,  # budgets, trace and mode as flags, not in the spec
        "raw": draw.random() < 0.5,  # code --raw (gm.code), or readable (show_code)
    }


def run(case: Case) -> dict[str, Any]:
    """``case`` down its route (one of ``route_fuzz.ROUTES_THIRD``): its row."""
    route = {"resized": _resized, "train_steps": _train_steps, "cli": _cli}[case.how["route"]]
    return _reasoned(route(case))


def _reasoned(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with ``reason``, its error's first line, when it has an error (kept whole where the split noted it)."""
    if "error" in row and "reason" not in row:
        row["reason"] = first_line(row["error"])
    return row


def first_line(text: str) -> str:
    """The first line of an error message, and the next when the first ends with a colon (``1 problem:``)."""
    lines = text.strip().splitlines() or [""]
    return lines[0] + (" " + lines[1].strip() if lines[0].endswith(":") and len(lines) > 1 else "")


def _noted_split(result: dict[str, Any], build: Callable[[], Any]) -> tuple[Any, dict[str, Any] | None, list[str]]:
    """:func:`route_fuzz._split`, its refusal's or crash's row with the error's first line whole (``reason``)."""
    seen: list[BaseException] = []

    def noting() -> Any:
        try:
            return build()
        except Exception as error:
            seen.append(error)
            raise

    made, row, said = _split(result, noting)
    if row is not None and seen:
        row["reason"] = first_line(f"{type(seen[0]).__name__}: {seen[0]}")
    return made, row, said


def _budgets(case: Case, options: dict[str, Any]) -> dict[str, int]:
    total = _one_device_total(case.model, options)["total"]
    return {d: max(1, int(total * case.how["share"])) for d in case.devices}


def batch_of(rows: int, resize: str, batch_draw: float) -> int:
    """The other batch size: ``down`` from 1 to ``rows - 1``, ``up`` from ``rows + 1`` to ``2 * rows``."""
    if resize == "down" and rows > 1:
        return 1 + int(batch_draw * (rows - 1))
    return rows + 1 + int(batch_draw * rows)


def inputs_like(args: tuple[Any, ...], batch: int, seed: int) -> tuple[Any, ...]:
    """Inputs like ``args`` drawn from ``seed``: each input whose leading size is the first input's (the batch)
    with ``batch`` rows, dtypes kept; floating ones normal, integer ones (labels) drawn from the input's own values,
    so that they stay in its range."""
    generator = torch.Generator().manual_seed(seed)
    rows = args[0].shape[0]
    made: list[Any] = []
    for a in args:
        if not isinstance(a, torch.Tensor) or a.dim() == 0:
            made.append(a)
            continue
        shape = (batch, *a.shape[1:]) if a.shape[0] == rows else tuple(a.shape)
        if a.is_floating_point():
            made.append(torch.randn(shape, generator=generator, dtype=a.dtype))
        else:
            made.append(a.flatten()[torch.randint(a.numel(), shape, generator=generator)])
    return tuple(made)


def _eager(model: torch.nn.Module, args: tuple[Any, ...], seed: int, train: bool) -> Any:
    """``model`` on a copy of ``args`` (its loss backward when ``train``), random numbers drawn as the split's."""
    torch.manual_seed(seed)
    out = model(*(a.clone() for a in args))
    loss = weighted_loss(out)
    if train and loss.requires_grad:
        loss.backward()
    return out


def _resized(case: Case) -> dict[str, Any]:
    seed, how, result = case.seed, case.how, case.result
    model, args, options = case.model, case.args, case.options
    rows = args[0].shape[0]
    batch = batch_of(rows, how["resize"], how["batch_draw"])
    result["batch"] = [rows, batch]
    resized = inputs_like(args, batch, seed)
    reference = copy.deepcopy(model)  # eager at the new batch (before the split moves the model's weights)
    try:
        expected = _eager(reference, resized, seed, how["mode"] == "training")
    except Exception as error:  # noqa: BLE001 - a program may write its batch size into its code
        return _row(result, "eager_fails", error, phase="resized")
    if how["trace"] == "export":
        options["dynamic_shapes"] = "batch"

    gm, refused, said = _noted_split(result, lambda: fxsplit.fxsplit(model, _budgets(case, options), **options))
    if gm is None:
        return refused  # type: ignore[return-value]
    result["warned"] = said
    moved = case._replace(args=resized, expected=expected, reference=reference)
    return _compared(moved, gm, model, said, refused_when_run=how["trace"] == "export")


def _tie(model: torch.nn.Module, seed: int) -> list[str] | None:
    """Tie the weights of two ``Linear`` layers of one shape (the second's becomes the first's): their names, or
    None when no two have one shape."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    pairs = [(a, b) for i, a in enumerate(linears) for b in linears[i + 1 :] if a[1].weight.shape == b[1].weight.shape]
    if not pairs:
        return None
    (first, kept), (second, tied) = random.Random(seed).choice(pairs)
    tied.weight = kept.weight
    return [f"{first}.weight", f"{second}.weight"]


def _optimizer(name: str, parameters: Any) -> torch.optim.Optimizer:
    if name == "sgd_momentum":
        return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=1e-3)
    return torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.01)


def _close64nan(got: torch.Tensor, want: torch.Tensor) -> bool:
    """:func:`fuzzrun.close64`, NaN where eager has NaN (a program's overflow) too."""
    return got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-9, atol=1e-12, equal_nan=True)


def _train_steps(case: Case) -> dict[str, Any]:
    seed, how, result = case.seed, case.how, case.result
    model, args, options = case.model, case.args, case.options
    if how["tie"]:
        result["tied"] = _tie(model, seed)
    options["optimizer"] = how["optimizer"]
    if how["accumulate"]:
        options["accumulate_grads"] = True
    unsplit = copy.deepcopy(model)  # trained eagerly beside the split

    gm, refused, said = _noted_split(result, lambda: fxsplit.fxsplit(model, _budgets(case, options), **options))
    if gm is None:
        return refused  # type: ignore[return-value]
    result["warned"] = said
    plan = gm.meta["fxsplit_plan"]
    differ = []
    theirs, mine = list(gm.parameters()), list(model.parameters())
    if len(theirs) != len(mine) or {id(p) for p in theirs} != {id(p) for p in mine}:
        differ.append(f"split.parameters() gives {len(theirs)} tensors, the model {len(mine)}, not the same ones")
    stepped = _optimizer(how["optimizer"], gm.parameters()), _optimizer(how["optimizer"], unsplit.parameters())
    rows, micro = args[0].shape[0], 2 if how["accumulate"] else 1

    def split_run(k: int, train: bool) -> Any:  # the split on the k-th inputs, under the device check
        torch.manual_seed(seed + k)
        with DeviceChecker(plan, gm, model, host_anywhere=True):
            out = gm(*inputs_like(args, rows, seed * 31 + k))
        loss = weighted_loss(out)
        if train and loss.requires_grad:
            loss.backward()
        return out

    try:
        for step in range(3):
            for optimizer in stepped:
                optimizer.zero_grad(set_to_none=how["set_to_none"])
            for k in range(step * micro, (step + 1) * micro):
                split_run(k, train=True)
                _eager(unsplit, inputs_like(args, rows, seed * 31 + k), seed + k, train=True)
            for optimizer in stepped:
                optimizer.step()
        out = split_run(3 * micro, train=False)
    except Exception as error:  # noqa: BLE001 - eager ran this program; the split must too (or the device check)
        return _row(result, "crash", error, phase="steps")
    expected = _eager(unsplit, inputs_like(args, rows, seed * 31 + 3 * micro), seed + 3 * micro, train=False)
    state, want = gm.state_dict(), unsplit.state_dict()
    weights = {name for name, _ in unsplit.named_parameters(remove_duplicate=False)}
    for name, tensor in want.items():
        if name not in state:
            differ.append(f"split.state_dict() lacks {name}")
        elif not _close64nan(state[name].cpu(), tensor):
            differ.append(f"{'parameter' if name in weights else 'buffer'} {name} after 3 steps")
    found = [*differ, *differences(out, expected, model, unsplit, close=_close64nan)]  # (diverged: NaN in both)
    used = sorted(set(plan.placement.values()))
    return _row(result, "wrong" if found else "equal", differ=found[:5], used=used)


def _cli_command(argv: list[str], said: list[str]) -> tuple[int, str, str]:
    """``fxsplit ARGV`` in this process: its exit code, what it printed, and its error line(s)."""
    from fxsplit.cli import main

    out, err, path = io.StringIO(), io.StringIO(), list(sys.path)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = main(argv, out=out, err=err)
    finally:
        sys.path[:] = path  # the factory's folder, added while it was imported
    said.extend(str(w.message)[:200] for w in caught if issubclass(w.category, fxsplit.FxsplitWarning))
    return code, out.getvalue(), err.getvalue().strip()


def _cli_spec(case: Case, path: str) -> tuple[list[str], dict[str, Any], dict[str, int]]:
    """Write the spec to ``path``: the flags given beside it, the same options as keywords, and the budgets."""
    seed, how, segments, devices = case.seed, case.how, case.segments, case.devices
    options = {**case.options, **({"accumulate_grads": True} if how["accumulate"] else {})}
    budgets = _budgets(case, options)
    sizes = {d: _size_text(b, how["unit"]) for d, b in budgets.items()}
    keywords: dict[str, Any] = {"trace": how["trace"], "mode": how["mode"]}
    settings = [f"trace: {how['trace']}", f"mode: {how['mode']}"]
    if how["mode"] == "training":
        keywords["optimizer"] = "sgd"
        settings.append("optimizer: sgd")
    if how["accumulate"]:
        keywords["accumulate_grads"] = True
        settings.append("accumulate_grads: true")
    lines = [f"# route_fuzz seed {seed}", f"objective: {how['objective']}"]
    keywords["objective"] = how["objective"]
    flags: list[str] = []
    if how["flags"]:
        flags = [f"--budget={d}={size}" for d, size in sizes.items()]
        flags += ["--trace", how["trace"], "--mode", how["mode"]]
        flags += ["--optimizer", "sgd"] if how["mode"] == "training" else []
        flags += ["--accumulate-grads"] if how["accumulate"] else []
    else:
        lines += ["devices:", *(f"  {d}: {size}" for d, size in sizes.items()), *settings]
    pins = _pins(seed, segments, devices) if how["pinned"] and len(segments) > 1 else {}
    if how["typo"]:
        pins = {**pins, TYPO: devices[-1]}
    if pins:
        keywords["pins"] = pins
        lines += ["pin:", *(f'  "{s}": {d}' for s, d in pins.items())]
    with open(path, "w") as file:
        file.write("\n".join(lines) + "\n")
    return flags, keywords, {d: fxsplit.parse_size(size) for d, size in sizes.items()}


def _cli(case: Case) -> dict[str, Any]:
    how, result, directory = case.how, case.result, case.directory
    model, args = case.model, case.args
    fresh = copy.deepcopy(model)  # planned by fxsplit.plan with the spec and the flags as keywords
    program = os.path.join(directory, "program.py")
    with open(program, "w") as file:
        file.write(case.source + FACTORY)
    reference, spec, saved = f"{program}:make", os.path.join(directory, "spec.yaml"), os.path.join(directory, "p.yaml")
    flags, keywords, budgets = _cli_spec(case, spec)
    said: list[str] = []
    code, printed, error = _cli_command(["plan", reference, "--spec", spec, "-o", saved, *flags], said)
    result["exit"] = code
    if code != 0:
        return _cli_refusal(result, code, error, fresh, spec, keywords, budgets if flags else None, case)
    if how["typo"]:
        return _row(result, "wrong", differ=[f"plan accepted a pin of {TYPO!r}, no module of the program"])
    with open(saved) as file:
        planned = fxsplit.Plan.from_yaml(file.read())
    differ = []
    try:
        by_api = fxsplit.plan(fresh, budgets if flags else None, spec=spec, example_inputs=args, **keywords)
    except Exception as caught:  # noqa: BLE001 - the command planned it, fxsplit.plan must too
        return _row(result, "crash", caught, phase="fxsplit.plan")
    if by_api != planned:
        differ.append("the saved plan differs from fxsplit.plan's of the same spec and options")
    checked, report, error = _cli_command(["check", reference, "--plan", saved], said)
    if checked != 0 or not report.startswith("plan matches the model"):
        return _row(result, "crash", phase="check", exit=checked, reason=first_line(error or report))
    shown, text, error = _cli_command(["code", reference, "--plan", saved, *(["--raw"] if how["raw"] else [])], said)
    if shown != 0:
        return _row(result, "crash", phase="code", exit=shown, reason=first_line(error))
    applied, failed, more = _noted_split(result, lambda: fxsplit.apply(model, planned, example_inputs=args))
    if applied is None:  # the command made and checked this plan: applying it must work
        return {**failed, "outcome": "crash", "phase": "apply"}  # type: ignore[dict-item]
    said += more
    result["warned"] = said
    wanted = applied.code if how["raw"] else fxsplit.show_code(applied)
    if text.strip() != wanted.strip():
        differ.append("code printed by `fxsplit code --plan` differs from apply's" + (" (raw)" if how["raw"] else ""))
    return _compared(case, applied, model, said, differ)


def _cli_refusal(
    result: dict[str, Any],
    code: int,
    error: str,
    fresh: torch.nn.Module,
    spec: str,
    keywords: dict[str, Any],
    budgets: dict[str, int] | None,
    case: Case,
) -> dict[str, Any]:
    """The row of ``fxsplit plan`` exiting ``code``: refused when fxsplit.plan refuses the same spec and options with
    the same kind of error (a ``BudgetError`` for exit 1, another ``FxsplitError`` for 2), and a pin of
    :data:`TYPO` is refused naming it; else a crash."""
    reason = first_line(error)
    if code not in (1, 2):
        return _row(result, "crash", phase="plan", reason=reason)
    if case.how["typo"] and (code != 2 or repr(TYPO) not in error):
        return _row(result, "wrong", differ=[f"a pin of {TYPO!r} exits {code}, not 2 naming it"], reason=reason)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            fxsplit.plan(fresh, budgets, spec=spec, example_inputs=case.args, **keywords)
    except fxsplit.BudgetError:
        same = code == 1
    except fxsplit.FxsplitError:
        same = code == 2
    else:
        same = False
    if not same:
        return _row(result, "crash", phase="plan", reason=f"exit {code} where fxsplit.plan says otherwise: {reason}")
    return _row(result, "refused", reason=reason)
