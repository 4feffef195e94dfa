"""A table of bad inputs through every public entry point: each gives one FxsplitError, fast, and touches nothing.

Every case names the entry point, the bad value and what the message must say. The test checks the
exception's type (an ``FxsplitError`` subclass, never a raw ``AttributeError`` or ``AssertionError`` from
deep inside torch), that the message says the fragment, that it is short (a message that ``repr``s a
huge value is a bug too), that the call returns within a few seconds, and that the model it was given
is unchanged (same tensor objects, same devices, same values). The CLI cases check the exit code
(1 does not fit, 2 bad input; never 3, which means an internal error) and the one-line message.
"""

from __future__ import annotations

import contextlib
import io
import re
import signal
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.cli import main

SECONDS = 20  # per case; every case here answers in well under one on an idle machine
LONGEST_MESSAGE = 4000
X = (torch.randn(4, 16),)
BUDGETS = {"cpu:0": "8KiB", "cpu:1": "8KiB"}
MODEL_FILE = str(Path(__file__).parents[1] / "examples" / "models.py") + ":factory"


def small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 16))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.embed(ids))))


def _plan_yaml(**options: Any) -> str:
    return fxsplit.plan(small(), BUDGETS, example_inputs=X, mode="weights", **options).to_yaml()


def _edit_plan(old: str, new: str) -> Callable[[], str]:
    def edited() -> str:
        text = _plan_yaml()
        assert old in text, f"{old!r} not in the plan file"
        return text.replace(old, new, 1)

    return edited


def _alias_bomb(levels: int = 9, top: str = "devices") -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels + 1):
        refs = ", ".join([f"*a{level - 1}"] * 9)
        lines.append(f"a{level}: &a{level} [{refs}]")
    lines.append(f"{top}: *a{levels}")
    return "\n".join(lines) + "\n"


class Returns(nn.Module):
    """A model whose output torch.distributed.pipelining's last stage cannot return: a dict, or a number too."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.b(torch.relu(self.a(x)))
        return {"y": y} if self.what == "dict" else (y, x.shape[0])


@dataclass(frozen=True)
class Case:
    """One bad call: ``call(model)`` must raise ``error`` whose message matches ``says`` (a regex)."""

    id: str
    call: Callable[[nn.Module], Any]
    error: type[fxsplit.FxsplitError]
    says: str
    make: Callable[[], nn.Module] = small


def plan_with(budgets: Any = None, **options: Any) -> Callable[[nn.Module], Any]:
    options.setdefault("example_inputs", X)
    return lambda model: fxsplit.plan(model, BUDGETS if budgets is None else budgets, **options)


def split_with(budgets: Any = None, **options: Any) -> Callable[[nn.Module], Any]:
    options.setdefault("example_inputs", X)
    return lambda model: fxsplit.fxsplit(model, BUDGETS if budgets is None else budgets, **options)


def apply_text(text: Callable[[], str], **options: Any) -> Callable[[nn.Module], Any]:
    options.setdefault("example_inputs", X)
    return lambda model: fxsplit.apply(model, fxsplit.Plan.from_yaml(text()), **options)


Spec, Budget, Mismatch, Trace = fxsplit.SpecError, fxsplit.BudgetError, fxsplit.PlanMismatchError, fxsplit.TraceError
Any_ = fxsplit.FxsplitError

API_CASES = [
    # the model and the budgets
    Case("model-not-a-module", lambda m: fxsplit.plan("model.pt", BUDGETS), Any_, r"nn\.Module.*got str"),
    Case("model-a-class", lambda m: fxsplit.fxsplit(nn.Linear, BUDGETS), Any_, r"nn\.Module"),
    Case("budgets-a-list", plan_with(["cpu:0", "cpu:1"]), Spec, r"budgets must be a mapping"),
    Case("budgets-empty", plan_with({}), Spec, r"at least one device"),
    Case("budgets-missing", lambda m: fxsplit.plan(m, None, example_inputs=X), Spec, r"no budgets"),
    Case("device-unknown-type", plan_with({"gpu:0": "1MiB"}), Spec, r"'gpu:0' is not a device"),
    Case("device-meta", plan_with({"meta": "1MiB"}), Spec, r"'meta' holds no data"),
    Case("device-float-key", plan_with({1.5: "1MiB"}), Spec, r"device must be"),
    Case("device-negative-index", plan_with({-1: "1MiB"}), Spec, r"must not be negative"),
    Case("device-index-wraps-int8", plan_with({"cuda:300": "1MiB"}), Spec, r"cuda:300"),
    Case("device-index-128", plan_with({"cuda:128": "1MiB"}), Spec, r"cuda:128"),
    Case("cpu-index-255", plan_with({"cpu:255": "1MiB"}), Spec, r"cpu:255"),
    Case("device-index-wrapped", plan_with({torch.device("cuda", 128): "1MiB"}), Spec, r"negative index"),
    Case("device-twice", plan_with({"cpu:0": "8KiB", torch.device("cpu", 0): "8KiB"}), Spec, r"twice"),
    Case("cuda-and-cuda0", plan_with({"cuda": "8KiB", "cuda:0": "8KiB"}), Spec, r"cuda"),
    Case("budget-negative", plan_with({"cpu:0": -5}), Spec, r"must not be negative"),
    Case("budget-bool", plan_with({"cpu:0": True}), Spec, r"byte count"),
    Case("budget-nan", plan_with({"cpu:0": float("nan")}), Spec, r"finite"),
    Case("budget-unit", plan_with({"cpu:0": "10XB"}), Spec, r"unknown unit 'XB'"),
    Case("budget-words", plan_with({"cpu:0": "lots"}), Spec, r"not a size"),
    Case("budget-overflow", plan_with({"cpu:0": "1e400GiB"}), Spec, r"1e400GiB"),
    Case("budget-none", plan_with({"cpu:0": None}), Spec, r"byte count"),
    Case("budgets-all-zero", plan_with({"cpu:0": 0, "cpu:1": 0}), Budget, r"short by"),
    Case(
        "budgets-too-small",
        plan_with({"cpu:0": 1000, "cpu:1": 1000}, mode="weights"),
        Budget,
        r"short by .*raise the budgets",
    ),
    Case(
        "reserve-over-budget",
        plan_with({"cpu:0": 1024, "cpu:1": "8KiB"}, reserve="1KiB"),
        Spec,
        r"reserve 1.00 KiB of 'cpu:0' leaves nothing",
    ),
    Case("reserve-percent-over", plan_with(reserve="150%"), Spec, r"reserve"),
    Case("reserve-float-over-one", plan_with(reserve=1.5), Spec, r"reserve 1.5 is a float.*'10%'"),
    Case("reserve-words", plan_with(reserve="some"), Spec, r"reserve"),
    # options
    Case("option-typo", plan_with(objectve="balanced"), Spec, r"unknown option 'objectve'.*did you mean 'objective'"),
    Case("trace-mode", plan_with(trace="jit"), Spec, r"trace must be one of"),
    Case("objective", plan_with(objective="fast"), Spec, r"objective must be one of"),
    Case("mode", plan_with(mode="train"), Spec, r"mode"),
    Case("optimizer-name", plan_with(mode="training", optimizer="adagrad"), Spec, r"optimizer"),
    Case("optimizer-negative", plan_with(mode="training", optimizer=-1), Spec, r"optimizer"),
    Case("contiguous-string", plan_with(contiguous="no"), Spec, r"contiguous.*True or False"),
    Case("check-string", plan_with(check="yes"), Spec, r"check.*True or False"),
    Case("pins-a-list", plan_with(pins=["0", "cpu:1"]), Spec, r"'pins' must be a mapping"),
    Case("pins-tuple-key", plan_with(pins={("0",): "cpu:0"}), Spec, r"'pins' keys must be strings"),
    Case("pins-unknown-device", plan_with(pins={"0": "cpu:7"}), Any_, r"cpu:7"),
    Case("pins-no-module", plan_with(pins={"encoder": "cpu:1"}), Any_, r"encoder"),
    Case("pins-bad-device", plan_with(pins={"0": "gpu"}), Spec, r"'gpu' is not a device"),
    Case("leaf-modules-int", plan_with(leaf_modules=[42]), Spec, r"'leaf_modules'\[0\] must be an nn.Module subclass"),
    Case("leaf-modules-a-string", plan_with(leaf_modules="Linear"), Spec, r"write \['Linear'\]"),
    Case("example-kwargs-a-list", plan_with(example_kwargs=[1]), Spec, r"'example_kwargs' must be a mapping"),
    Case("leaf-modules-unknown", plan_with(leaf_modules=["nothing.here"]), Any_, r"nothing\.here"),
    Case("together-a-string", plan_with(together="0,2"), Any_, r"together"),
    Case("together-unknown", plan_with(together=[["0", "nothing"]]), Any_, r"nothing"),
    Case("dtype", plan_with(dtype="int7"), Spec, r"int7"),
    Case("dynamic-shapes", plan_with(dynamic_shapes="some"), Spec, r"dynamic_shapes"),
    Case("pipeline-zero-chunks", plan_with(pipeline=0), Spec, r"chunks"),
    Case("pipeline-unknown-key", plan_with(pipeline={"chunk": 2}), Spec, r"chunk"),
    Case("concrete-args-unknown", plan_with(example_inputs=None, trace="fx", concrete_args={"nope": 1}), Spec, r"nope"),
    Case("output-device", plan_with(output_device="gpu"), Spec, r"'gpu' is not a device"),
    # example inputs
    Case("example-wrong-width", plan_with(example_inputs=(torch.randn(4, 8),)), Trace, r"example|input"),
    Case("example-kwargs-unknown", plan_with(example_kwargs={"mask": torch.ones(4)}), Trace, r"mask"),
    Case("export-without-inputs", plan_with(example_inputs=None, trace="export"), Trace, r"needs example_inputs"),
    # specs
    Case("spec-missing-file", plan_with(budgets=None, spec="no/such/spec.yaml"), Spec, r"no/such/spec\.yaml"),
    Case("spec-syntax", plan_with(budgets=None, spec="devices: {cpu:0: [\n"), Spec, r"<spec>:\d+: .*not valid YAML"),
    Case(
        "spec-unknown-key",
        plan_with(budgets=None, spec="devices: {cpu:0: 8KiB}\nobjectiv: balanced\n"),
        Spec,
        r"objectiv",
    ),
    Case(
        "spec-python-tag",
        plan_with(budgets=None, spec="devices: !!python/object/apply:os.system [ls]\n"),
        Spec,
        r"python",
    ),
    Case("spec-alias-bomb", plan_with(budgets=None, spec=_alias_bomb()), Spec, r"alias|anchor"),
    Case("spec-not-a-mapping", plan_with(budgets=None, spec="- cpu:0\n- cpu:1\n"), Spec, r"mapping"),
    Case("load-spec-int", lambda m: fxsplit.load_spec(123), Spec, r"spec"),
    # running a split
    Case(
        "device-not-usable",
        split_with(
            {"cpu:0": "8KiB", "cuda:0": "8KiB"}
            if not torch.cuda.is_available()
            else {"cpu:0": "8KiB", "cuda:120": "8KiB"}
        ),
        Any_,
        r"cuda.*cpu:0",
    ),
    Case("meta-model-split", split_with(), Any_, r"meta device.*fxsplit\.plan", make=lambda: small().to("meta")),
    # saved plans
    Case("plan-garbage", lambda m: fxsplit.Plan.from_yaml("devices: [cpu:0\n"), Spec, r"plan"),
    Case("plan-not-a-mapping", lambda m: fxsplit.Plan.from_yaml("- 1\n- 2\n"), Spec, r"plan"),
    Case(
        "plan-python-tag",
        lambda m: fxsplit.Plan.from_yaml("devices: !!python/object/apply:os.system [ls]\n"),
        Spec,
        r"python|tag",
    ),
    Case("plan-alias-bomb", lambda m: fxsplit.Plan.from_yaml(_alias_bomb(top="placement")), Spec, r"alias|anchor"),
    Case(
        "plan-huge-file",
        lambda m: fxsplit.Plan.from_yaml("devices: [" + "cpu:0, " * 3_000_000 + "]\n"),
        Spec,
        r"MiB|too large|size",
    ),
    Case(
        "plan-of-another-model",
        apply_text(lambda: _plan_yaml(), example_inputs=(torch.randn(4, 32),)),
        Mismatch,
        r"another model",
        make=lambda: nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 32)),
    ),
    Case(
        "plan-tampered-fingerprint", apply_text(_edit_plan("fingerprint: ", "fingerprint: 0000")), Any_, r"fingerprint"
    ),
    Case("plan-not-a-plan", lambda m: fxsplit.apply(m, "plan.yaml", example_inputs=X), Any_, r"Plan"),
    Case("plan-unknown-device", apply_text(_edit_plan("  0.weight: cpu:0", "  0.weight: cpu:5")), Any_, r"cpu:5"),
    Case(
        "pipeline-stages-pipeline-option",
        lambda m: fxsplit.pipeline_stages(m, BUDGETS, example_inputs=X, pipeline=2),
        Spec,
        r"chunks=",
    ),
    Case(
        "pipeline-stages-dict-output",
        lambda m: fxsplit.pipeline_stages(m, BUDGETS, example_inputs=X, chunks=2).build_stage(0),
        Any_,
        r"returns a dict, but torch.distributed.pipelining's last stage must return a tensor",
        make=lambda: Returns("dict"),
    ),
    Case(
        "pipeline-stages-number-output",
        lambda m: fxsplit.pipeline_stages(m, BUDGETS, example_inputs=X, chunks=2, trace="fx").build_stage(1),
        Any_,
        r"returns 1 value\(s\) that are not tensors",
        make=lambda: Returns("number"),
    ),
    Case(
        "apply-unknown-option",
        lambda m: fxsplit.apply(m, fxsplit.Plan.from_yaml(_plan_yaml()), example_inputs=X, objective="balanced"),
        Spec,
        r"apply\(\) takes no option",
    ),
    Case(
        "check-plan-unknown-option",
        lambda m: fxsplit.check_plan(m, fxsplit.Plan.from_yaml(_plan_yaml()), example_inputs=X, budget=1),
        Spec,
        r"check_plan\(\) takes no option 'budget'",
    ),
    Case("parse-size", lambda m: fxsplit.parse_size("twelve"), Spec, r"not a size"),
]


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def snapshot(model: nn.Module) -> dict[str, tuple[int, torch.device, torch.Tensor]]:
    return {name: (id(t), t.device, t.detach().clone()) for name, t in model.state_dict(keep_vars=True).items()}


def assert_unchanged(model: nn.Module, before: dict[str, tuple[int, torch.device, torch.Tensor]]) -> None:
    after = model.state_dict(keep_vars=True)
    assert set(after) == set(before)
    for name, (ident, device, value) in before.items():
        tensor = after[name]
        assert id(tensor) == ident and tensor.device == device, f"{name} was replaced or moved"
        if device.type != "meta":
            assert torch.equal(tensor.detach(), value), f"{name} changed"


@pytest.mark.parametrize("case", API_CASES, ids=lambda c: c.id)
def test_api_bad_input_raises_one_clear_fxsplit_error(case: Case) -> None:
    model = case.make()
    before = snapshot(model)
    with time_limit(SECONDS), pytest.raises(fxsplit.FxsplitError) as info:
        case.call(model)
    assert isinstance(info.value, case.error), f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert len(message) < LONGEST_MESSAGE, f"message of {len(message)} characters"
    assert re.search(case.says, message, re.S), message
    assert_unchanged(model, before)


def _write(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


EXITING_FACTORY = """
import sys
def factory():
    sys.exit(0)
"""
FAILING_FACTORY = """
def factory():
    raise RuntimeError("checkpoint missing")
"""
NOT_A_MODEL_FACTORY = """
def factory():
    return "a string"
"""

CLI_CASES: list[tuple[str, Callable[[Path], list[str]], int, str]] = [
    ("model-file-missing", lambda t: ["plan", "no/such/file.py:factory", "--budget", "cpu:0=1MiB"], 2, "no/such"),
    ("model-ref-no-colon", lambda t: ["plan", "examples/models.py", "--budget", "cpu:0=1MiB"], 2, ":"),
    (
        "factory-missing",
        lambda t: ["plan", MODEL_FILE.replace(":factory", ":nope"), "--budget", "cpu:0=1MiB"],
        2,
        "nope",
    ),
    (
        "factory-raises",
        lambda t: ["plan", _write(t, "f.py", FAILING_FACTORY) + ":factory", "--budget", "cpu:0=1MiB"],
        2,
        "checkpoint missing",
    ),
    (
        "factory-exits",
        lambda t: ["plan", _write(t, "f.py", EXITING_FACTORY) + ":factory", "--budget", "cpu:0=1MiB"],
        2,
        "exit",
    ),
    (
        "factory-not-a-model",
        lambda t: ["plan", _write(t, "f.py", NOT_A_MODEL_FACTORY) + ":factory", "--budget", "cpu:0=1MiB"],
        2,
        "str",
    ),
    ("budget-malformed", lambda t: ["plan", MODEL_FILE, "--budget", "cpu:0"], 2, "DEVICE=SIZE"),
    ("budget-repeated", lambda t: ["plan", MODEL_FILE, "--budget", "cpu:0=1MiB", "--budget", "cpu:0=2MiB"], 2, "cpu:0"),
    ("budget-overflow", lambda t: ["plan", MODEL_FILE, "--budget", "cpu:0=1e400GiB"], 2, "1e400GiB"),
    ("budget-bad-device", lambda t: ["plan", MODEL_FILE, "--budget", "gpu:0=1MiB"], 2, "gpu:0"),
    ("no-budget-no-spec", lambda t: ["plan", MODEL_FILE], 2, "--spec"),
    (
        "does-not-fit",
        lambda t: ["plan", MODEL_FILE, "--budget", "cpu:0=10KiB", "--budget", "cpu:1=10KiB"],
        1,
        "short by",
    ),
    ("spec-missing", lambda t: ["plan", MODEL_FILE, "--spec", "no/such.yaml"], 2, "no/such.yaml"),
    ("spec-alias-bomb", lambda t: ["plan", MODEL_FILE, "--spec", _write(t, "bomb.yaml", _alias_bomb())], 2, "alias"),
    ("plan-missing", lambda t: ["code", MODEL_FILE, "--plan", "no/such-plan.yaml"], 2, "no/such-plan.yaml"),
    (
        "plan-alias-bomb",
        lambda t: ["code", MODEL_FILE, "--plan", _write(t, "bomb.yaml", _alias_bomb(top="placement"))],
        2,
        "alias",
    ),
    (
        "plan-garbage",
        lambda t: ["check", MODEL_FILE, "--plan", _write(t, "p.yaml", "devices: [\n")],
        2,
        "not valid YAML",
    ),
]


@pytest.mark.parametrize(("case", "args", "code", "says"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_exits_with_one_line(
    case: str, args: Callable[[Path], list[str]], code: int, says: str, tmp_path: Path
) -> None:
    out, err = io.StringIO(), io.StringIO()
    with time_limit(SECONDS):
        got = main(args(tmp_path), out=out, err=err)
    message = err.getvalue()
    assert got == code, f"exit {got}: {message}"
    assert message.startswith("fxsplit: ") and says in message, message
    assert len(message) < LONGEST_MESSAGE and "Traceback" not in message


def test_the_table_is_large() -> None:
    assert len(API_CASES) + len(CLI_CASES) >= 60
