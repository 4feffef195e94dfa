"""The ``fxsplit`` command: plan a split from a spec, print its code, draw it, check a saved plan.

    fxsplit plan  MODEL --spec SPEC [--device-map MAP] [-o plan.yaml]
    fxsplit code  MODEL (--spec SPEC | --plan PLAN | --budget DEVICE=SIZE ...) [--raw]
    fxsplit show  MODEL (--spec SPEC | --plan PLAN | --budget DEVICE=SIZE ...) -o split.svg|.png|.dot
    fxsplit check MODEL --plan PLAN [--spec SPEC | --budget DEVICE=SIZE ...]

MODEL is ``path/to/file.py:factory`` or ``package.module:factory``: a callable
returning the model, optionally with example inputs (see :mod:`fxsplit.factory`).

Exit codes: 0 ok; 1 infeasible (the model does not fit the budgets); 2 bad
input (spec, plan, model reference, arguments, a model that cannot be traced);
3 an internal error (a bug: please report it with ``--debug`` output). Errors
are printed as one message; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Sequence, TextIO

from fxsplit.errors import BudgetError, FxsplitError, SpecError
from fxsplit.options import DYNAMIC_SHAPES, MAX_PREFETCH, MODES, OBJECTIVES, TRACE_MODES
from fxsplit.stages import StageTimer

__all__ = ["main"]

EXIT_OK, EXIT_INFEASIBLE, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", metavar="MODEL", help="path/to/file.py:factory or package.module:factory")
    common.add_argument(  # SUPPRESS: unset here leaves the top-level --debug as given
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of errors"
    )
    common.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="DEVICE=SIZE",
        help="a device budget, e.g. cuda:0=20GiB; repeat in stage order (replaces the spec's devices)",
    )
    overrides = argparse.ArgumentParser(add_help=False)
    overrides.add_argument("--trace", choices=TRACE_MODES, help="override the spec's trace mode")
    overrides.add_argument("--objective", choices=OBJECTIVES, help="override the spec's objective")
    overrides.add_argument("--dtype", help="plan as if floating tensors had this dtype (bf16, fp16, fp32)")
    overrides.add_argument("--output-device", help="where outputs are returned")
    overrides.add_argument(
        "--mode", choices=MODES, help="what the budgets hold (default inference: weights and activations)"
    )
    overrides.add_argument(
        "--optimizer",
        type=_optimizer,
        help="the optimizer counted with --mode training: adam, sgd, ..., settings such as "
        "'{name: adamw, fused: true}', or bytes of state per parameter element",
    )
    overrides.add_argument(
        "--accumulate-grads",
        action="store_true",
        default=None,
        help="with --mode training, plan for backward passes that add to existing .grad tensors (gradient "
        "accumulation): each weight's new gradient is held until it is added",
    )
    overrides.add_argument(
        "--dynamic-shapes", choices=DYNAMIC_SHAPES, help="input sizes a torch.export split keeps variable"
    )
    overrides.add_argument(
        "--device-map",
        metavar="FILE",
        help="an Accelerate device_map (JSON or YAML: module name -> device): keep the weights where it says, "
        "place the ops for the fewest copies, and print its bytes per forward beside fxsplit's own plan",
    )
    overrides.add_argument(
        "--profile",
        action="store_true",
        default=None,
        help="time each op, and each copy between devices, by running them (the time objectives; default: "
        "estimate from FLOPs and bytes)",
    )
    overrides.add_argument(
        "--no-replicate",
        dest="replicate",
        action="store_const",
        const=False,
        default=None,
        help="hold every weight on one device (default: a read-only weight read on several devices may be on each)",
    )
    offload = overrides.add_argument_group(
        "offload",
        "where weights the devices cannot hold are stored and streamed from (each overrides that field "
        "of the spec's offload)",
    )
    offload.add_argument("--offload-host", metavar="SIZE", help="host memory for them (pinned with CUDA), e.g. 16GiB")
    offload.add_argument("--offload-disk", metavar="SIZE", help="disk space for them, in --offload-dir, e.g. 100GiB")
    offload.add_argument("--offload-dir", metavar="DIR", help="the directory of the disk's safetensors file")
    offload.add_argument(
        "--prefetch",
        type=int,
        metavar="N",
        help=f"copy a streamed weight N ops ahead (0 to {MAX_PREFETCH}; default 1 on CUDA devices, else 0)",
    )

    parser = argparse.ArgumentParser(
        prog="fxsplit",
        description="Split a PyTorch model over devices under memory "
        "budgets: plan it from a YAML spec, print the generated code, draw it, check it.",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = commands.add_parser("plan", parents=[common, overrides], help="solve, print the table, save the plan")
    plan.add_argument("--spec", help="a partition spec (YAML)")
    plan.add_argument("-o", "--output", help="write the plan here (YAML)")
    code = commands.add_parser("code", parents=[common, overrides], help="print the generated forward")
    code.add_argument(
        "--raw",
        action="store_true",
        help="print gm.code exactly (default: arranged for reading, one section per device)",
    )
    show = commands.add_parser("show", parents=[common, overrides], help="draw the split (needs graphviz)")
    planning = tuple(action.dest for action in overrides._actions if action.dest != "help")
    plan.set_defaults(planning_flags=planning)
    for sub in (code, show):
        sub.set_defaults(planning_flags=planning)  # what --plan cannot honour: checked in _planned
        source = sub.add_mutually_exclusive_group()  # or --budget alone: checked in _planned
        source.add_argument("--spec", help="plan from this spec (YAML)")
        source.add_argument("--plan", help="use this saved plan (YAML) without solving")
    show.add_argument("-o", "--output", required=True, help="picture to write: .svg, .png, .pdf or .dot")
    show.add_argument(
        "--depth",
        type=_depth,
        default=None,
        help="draw one box per module at this depth of the module path (default: automatic)",
    )
    check = commands.add_parser("check", parents=[common], help="validate a saved plan against a model and budgets")
    check.add_argument("--plan", required=True, help="the saved plan (YAML)")
    check.add_argument("--spec", help="check against this spec's budgets (default: the plan's own)")
    return parser


def _budgets(pairs: Sequence[str]) -> dict[str | int, str] | None:
    if not pairs:
        return None
    budgets: dict[str | int, str] = {}
    for pair in pairs:
        device, equals, size = pair.partition("=")
        if not equals or not device or not size:
            raise FxsplitError(f"--budget {pair!r} must look like DEVICE=SIZE, e.g. cuda:0=20GiB")
        device = device.strip()
        key: str | int = int(device) if device.isdigit() else device  # an int is a CUDA index, as in the API
        if key in budgets:
            raise SpecError(
                f"--budget names '{device}' twice ({device}={budgets[key]} and {pair}); give each "
                "device one --budget, in stage order"
            )
        budgets[key] = size
    return budgets


def _depth(text: str) -> int:
    """``--depth``: a whole number >= 0 (0: the whole model in one box per device)."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0 (got {text!r})")
    return int(text)


def _optimizer(text: str) -> Any:
    """``--optimizer``: a name, bytes per parameter element (digits), or settings (a YAML flow mapping)."""
    if text.strip().isdigit():
        return int(text)
    if text.strip().replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"bytes of state per parameter element are a whole number (got {text!r})")
    if text.lstrip().startswith("{"):
        import yaml

        try:
            settings = yaml.safe_load(text)
        except yaml.YAMLError as error:
            first = str(error).splitlines()[0]
            raise argparse.ArgumentTypeError(f"settings are not valid YAML ({first}): {text!r}") from None
        if not isinstance(settings, dict):
            raise argparse.ArgumentTypeError(f"not a mapping of settings: {text!r}")
        return settings
    return text


def _options(args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if loaded.example_kwargs:
        options["example_kwargs"] = loaded.example_kwargs
    for name in getattr(args, "planning_flags", ()):  # each the keyword option of its name (the device map and
        if name == "device_map" or name in _OFFLOAD_FLAGS.values():  # offload flags are read below)
            continue
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    spec = getattr(args, "spec", None)
    if spec:
        options["spec"] = spec
    if getattr(args, "device_map", None):
        from fxsplit.spec.load import load_device_map

        mapped = load_device_map(args.device_map)  # alone, it is the spec: messages name its lines
        options.update({"device_map": mapped.device_map} if spec else {"spec": mapped})
    offload = {flag: getattr(args, name, None) for flag, name in _OFFLOAD_FLAGS.items()}
    if any(value is not None for value in offload.values()):
        from fxsplit.spec import load_spec

        loaded_spec = load_spec(spec) if spec else None  # loaded once, for its offload
        if loaded_spec is not None:
            options["spec"] = loaded_spec
        options["offload"] = _offload(offload, loaded_spec.offload if loaded_spec else None)
    return options


_OFFLOAD_FLAGS = {  # flag -> its argparse name
    "--offload-host": "offload_host",
    "--offload-disk": "offload_disk",
    "--offload-dir": "offload_dir",
    "--prefetch": "prefetch",
}


def _offload(flags: dict[str, Any], spec: Any) -> Any:
    """The spec's offload (an :class:`~fxsplit.options.Offload` or None) with the fields the flags give replaced."""
    from fxsplit.options import Offload
    from fxsplit.units import parse_size

    fields: dict[str, Any] = {k: v for k, v in (spec.to_dict() if spec else {}).items() if v is not None}
    for flag, value in flags.items():
        if value is None:
            continue
        field = flag.removeprefix("--offload-").removeprefix("--")
        fields[field] = parse_size(value, what=flag) if field in ("host", "disk") else value
    if "host" not in fields and "disk" not in fields:
        raise SpecError("--offload-dir and --prefetch need --offload-host or --offload-disk, or a spec with offload:")
    if "disk" in fields and "dir" not in fields:
        raise SpecError("--offload-disk needs --offload-dir DIR, the directory the stored weights are written to")
    if not 0 <= (fields.get("prefetch") or 0) <= MAX_PREFETCH:
        raise SpecError(f"--prefetch must be from 0 to {MAX_PREFETCH} ops ahead (got {fields['prefetch']})")
    return Offload(**fields)


def _spec_map(spec: str | None) -> bool:
    from fxsplit.spec import load_spec

    return spec is not None and load_spec(spec).device_map is not None


def _compared(loaded: Any, made: Any, options: dict[str, Any]) -> str:
    """``device map: X per forward; fxsplit's plan: Y``: ``made`` (the map's plan) beside fxsplit's own plan
    under the same budgets and options, each copy counted (``Plan.copied_bytes``: the outputs' too)."""
    from fxsplit.api import plan
    from fxsplit.units import format_size

    options = {**options, "device_map": None, "reserve": dict(made.reserved)}
    try:
        own = plan(loaded.model, dict(made.budgets), example_inputs=loaded.example_inputs, **options)
        theirs = f"{format_size(own.copied_bytes)} per forward"
    except BudgetError as error:
        theirs = f"does not fit ({error})"
    return f"device map: {format_size(made.copied_bytes)} per forward; fxsplit's plan: {theirs}"


def _read_plan(path: str) -> Any:
    from fxsplit.planning.yamlio import plan_from_yaml
    from fxsplit.yamlfile import MAX_PLAN_BYTES, read_limited

    return plan_from_yaml(read_limited(path, "plan", MAX_PLAN_BYTES), path)


def _planned(args: argparse.Namespace, loaded: Any, progress: StageTimer) -> tuple[Any, Any, Any]:
    """``(traced graph module, costs, plan)`` from --spec (solving) or --plan (re-tracing, checked as by
    ``fxsplit check``); moves no weights."""
    from fxsplit.api import trace_and_plan
    from fxsplit.planning.apply import checked_retrace

    if getattr(args, "plan", None):
        if args.budget:
            raise FxsplitError(
                f"fxsplit {args.command}: --budget plans anew, --plan uses a saved plan with its own "
                "budgets; give one of them (fxsplit check --plan PLAN --budget ... checks a plan "
                "against other budgets)"
            )
        given = [name for name in args.planning_flags if getattr(args, name, None) is not None]
        if given:
            flags = ", ".join("--" + ("no-replicate" if n == "replicate" else n.replace("_", "-")) for n in given)
            raise FxsplitError(
                f"fxsplit {args.command}: {flags} change how a plan is made, but --plan uses a saved plan as it "
                "was made; drop them, or plan again with them (fxsplit plan ... -o plan.yaml)"
            )
        plan = _read_plan(args.plan)
        with progress.stage("tracing and checking"):
            traced, costs, _, plan = checked_retrace(
                loaded.model, plan, example_inputs=loaded.example_inputs, example_kwargs=loaded.example_kwargs
            )
        return traced.graph_module, costs, plan
    if not args.spec and not args.budget:
        raise FxsplitError(
            f"fxsplit {args.command} needs --spec SPEC, --plan PLAN or --budget DEVICE=SIZE (one per device)"
        )
    with progress.stage("tracing and planning"):
        planned = trace_and_plan(loaded.model, _budgets(args.budget), loaded.example_inputs, _options(args, loaded))
    return planned.traced.graph_module, planned.costs, planned.plan


def _run(args: argparse.Namespace, out: TextIO, progress: StageTimer) -> int:
    from fxsplit.factory import load_model

    folder = Path(getattr(args, "output", None) or ".").parent
    if not folder.is_dir():  # say so now, not after a long trace
        raise FxsplitError(f"cannot write {args.output!r}: the directory '{folder}' does not exist; create it first")
    with progress.stage("loading the model"):
        loaded = load_model(args.model)
    if args.command == "plan":
        if not args.spec and not args.budget:
            raise FxsplitError("fxsplit plan needs --spec SPEC or --budget DEVICE=SIZE (one per device)")
        from fxsplit.api import plan as make_plan

        options = _options(args, loaded)
        with progress.stage("tracing and planning"):
            made = make_plan(loaded.model, _budgets(args.budget), example_inputs=loaded.example_inputs, **options)
        print(made, file=out)
        if args.device_map or _spec_map(args.spec):
            with progress.stage("planning without the device map"):
                print(_compared(loaded, made, options), file=out)
        if args.output:
            Path(args.output).write_text(made.to_yaml(), encoding="utf-8")
            print(f"wrote {args.output}", file=out)
    elif args.command == "code":
        from fxsplit.codegen.emitter import emit
        from fxsplit.codegen.readable import show_code

        traced, _, plan = _planned(args, loaded, progress)
        split = emit(traced, plan)
        if not args.plan and (args.device_map or _spec_map(args.spec)):
            with progress.stage("planning without the device map"):
                print(f"# {_compared(loaded, plan, _options(args, loaded))}", file=out)
        print(split.code.strip() if args.raw else show_code(split), file=out)
    elif args.command == "show":
        from fxsplit.viz import auto_depth, render

        traced, _, plan = _planned(args, loaded, progress)
        depth = args.depth if args.depth is not None else auto_depth(traced, plan)
        with progress.stage("rendering"):
            target = render(traced, plan, args.output, depth=depth, title=f"{args.model}: {len(plan.devices)} devices")
        print(f"wrote {target}" + (f" (one box per module at depth {depth})" if depth else ""), file=out)
    else:
        from fxsplit.options import Budgets
        from fxsplit.planning.apply import check_plan
        from fxsplit.spec import load_spec

        plan = _read_plan(args.plan)
        budgets = None
        if args.spec:
            spec = load_spec(args.spec)
            if not args.budget:  # --budget replaces the spec's devices
                budgets = Budgets.parse(spec.devices, {d: spec.reserve_for(d) for d in spec.devices})
        if args.budget:
            budgets = Budgets.parse(_budgets(args.budget))
        with progress.stage("tracing and checking"):
            report = check_plan(
                loaded.model,
                plan,
                budgets,
                example_inputs=loaded.example_inputs,
                **({"example_kwargs": loaded.example_kwargs} if loaded.example_kwargs else {}),
            )
        print(report, file=out)
    return EXIT_OK


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    out, err = out or sys.stdout, err or sys.stderr
    args = _parser().parse_args(argv)
    progress = StageTimer(err)
    try:
        return _run(args, out, progress)
    except BudgetError as error:
        return _fail(args, err, error, EXIT_INFEASIBLE, "does not fit")
    except FxsplitError as error:
        return _fail(args, err, error, EXIT_BAD_INPUT, "error")
    except BrokenPipeError:  # the reader stopped early (fxsplit code ... | head): not an error
        _quiet_closed_stdout(out)
        return 0
    except OSError as error:
        return _fail(args, err, error, EXIT_BAD_INPUT, "error")
    except KeyboardInterrupt:
        print("fxsplit: interrupted", file=err)
        return 130
    except Exception as error:  # noqa: BLE001 - a bug: say so, one line unless --debug
        return _fail(args, err, error, EXIT_INTERNAL, f"internal error ({type(error).__name__}; please report it)")


def _quiet_closed_stdout(out: TextIO) -> None:
    """Point a closed standard output at devnull, so Python's exit flush does not report the broken pipe."""
    if out is sys.stdout:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _fail(args: argparse.Namespace, err: TextIO, error: BaseException, code: int, what: str) -> int:
    if args.debug:
        traceback.print_exception(type(error), error, error.__traceback__, file=err)
    hint = "" if args.debug else " (--debug shows the traceback)" if code == EXIT_INTERNAL else ""
    print(f"fxsplit: {what}: {error}{hint}", file=err)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
