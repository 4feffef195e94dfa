"""The fxsplit command: exit codes, one-line errors, --debug, and each subcommand on the example model."""

from __future__ import annotations

import importlib.util
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import fxsplit
from fxsplit.cli import main
from fxsplit.stages import StageTimer

ROOT = Path(__file__).resolve().parents[1]
MODEL = f"{ROOT / 'examples' / 'models.py'}:factory"
SPEC = str(ROOT / "examples" / "spec_example.yaml")


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m fxsplit ARGS`` with this checkout first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "fxsplit", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan written by ``python -m fxsplit plan``: exit 0, the table, the file."""
    path = tmp_path_factory.mktemp("cli") / "plan.yaml"
    done = run_module("plan", MODEL, "--spec", SPEC, "-o", str(path))
    assert done.returncode == 0, done.stderr
    header = done.stdout.splitlines()[0]
    assert [cell.strip() for cell in header.split("  ") if cell.strip()] == [
        "device",
        "budget",
        "reserve",
        "weights",
        "% budget",
        "modules",
        "in",
        "out",
    ]
    # the head is pinned to cpu:2 and the embedding it is tied to stays on cpu:0: the read-only tied
    # weight is held on both (a replica), so neither the weight nor the embedding's output is copied
    assert "tied: model.embed_tokens.weight = lm_head.weight: on cpu:0, replicated on cpu:2 (no copy)" in done.stdout
    assert f"wrote {path}" in done.stdout
    assert fxsplit.Plan.from_yaml(path.read_text()).devices == ("cpu:0", "cpu:1", "cpu:2")
    return path


@pytest.mark.slow  # python -m fxsplit in a fresh interpreter (here or in saved_plan): 3-22 s
def test_infeasible_exits_1_with_one_line(saved_plan: Path) -> None:
    done = run_module("plan", MODEL, "--budget", "cpu:0=300KiB", "--budget", "cpu:1=300KiB")
    assert done.returncode == 1
    assert done.stderr.startswith("fxsplit: does not fit: ") and "budget" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.slow  # python -m fxsplit in a fresh interpreter (here or in saved_plan): 3-22 s
def test_bad_spec_exits_2_listing_problems_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices:\n  cpu:0: 10 GiBs\n  gpu:1: 1GiB\npinn: {}\n")
    done = run_module("plan", MODEL, "--spec", str(bad))
    assert done.returncode == 2
    assert done.stderr.startswith(f"fxsplit: error: {bad}: 3 problems:")
    assert f"{bad}:2: devices['cpu:0']: budget '10 GiBs' has unknown unit 'GiBs'" in done.stderr
    assert "Traceback" not in done.stderr
    debug = run_module("plan", MODEL, "--spec", str(bad), "--debug")
    assert debug.returncode == 2
    assert "Traceback (most recent call last)" in debug.stderr and "SpecProblems" in debug.stderr


@pytest.mark.slow  # python -m fxsplit in a fresh interpreter (here or in saved_plan): 3-22 s
def test_code_from_a_saved_plan_equals_code_from_the_spec(saved_plan: Path) -> None:
    code, from_plan, err = run("code", MODEL, "--plan", str(saved_plan))
    assert code == 0, err
    assert from_plan.startswith("# fxsplit: readable view of gm.code")
    assert "    # ---- cpu:1 ----\n    to_1 = add_2.to('cpu:1')" in from_plan and ".to('cpu:2')" in from_plan
    code, from_spec, _ = run("code", MODEL, "--spec", SPEC)
    assert code == 0 and from_spec == from_plan
    code, raw, _ = run("code", MODEL, "--plan", str(saved_plan), "--raw")
    assert code == 0 and raw.startswith("def forward(self, ids):") and "_guards_fn" in raw


@pytest.mark.slow  # python -m fxsplit in a fresh interpreter (here or in saved_plan): 3-22 s
def test_code_and_show_plan_from_budgets_alone(saved_plan: Path, tmp_path: Path) -> None:
    budgets = ("--budget", "cpu:0=700KiB", "--budget", "cpu:1=700KiB")
    code, out, err = run("code", MODEL, *budgets)
    assert code == 0, err
    assert "\ndef forward(self, ids):\n" in out and "# ---- cpu:1 ----" in out and ".to('cpu:1')" in out
    _, planned, _ = run("plan", MODEL, *budgets)
    assert "cpu:1 " in planned and "cpu:2" not in planned and "cpu:2" not in out  # the budgets' devices, not a spec's
    if importlib.util.find_spec("graphviz") is not None:
        code, out, err = run("show", MODEL, *budgets, "-o", str(tmp_path / "split.dot"), "--depth", "2")
        assert code == 0 and "(one box per module at depth 2)" in out, err
    code, _, err = run("code", MODEL, "--plan", str(saved_plan), *budgets)
    assert code == 2 and "--budget plans anew, --plan uses a saved plan" in err


@pytest.mark.slow  # python -m fxsplit in a fresh interpreter (here or in saved_plan): 3-22 s
def test_check_a_saved_plan(saved_plan: Path) -> None:
    code, out, err = run("check", MODEL, "--plan", str(saved_plan))
    assert code == 0, err
    assert "plan matches the model" in out and "cpu:2: " in out and "460.80 KiB usable" in out
    code, out, err = run("check", MODEL, "--plan", str(saved_plan), "--spec", SPEC)
    assert code == 0, err
    code, _, err = run(
        "check",
        MODEL,
        "--plan",
        str(saved_plan),
        "--budget",
        "cpu:0=100KiB",
        "--budget",
        "cpu:1=1MiB",
        "--budget",
        "cpu:2=1MiB",
    )
    assert code == 1 and "fxsplit: does not fit: the plan does not fit the budgets: 'cpu:0' holds" in err
    untied = f"{ROOT / 'examples' / 'models.py'}:untied"
    code, _, err = run("check", untied, "--plan", str(saved_plan))
    assert code == 2
    assert "tied: the plan ties ['lm_head.weight', 'model.embed_tokens.weight'], the model does not" in err


def test_show_writes_a_dot_file(tmp_path: Path) -> None:
    pytest.importorskip("graphviz")
    target = tmp_path / "split.dot"
    code, out, err = run("show", MODEL, "--spec", SPEC, "-o", str(target), "--depth", "3")
    assert code == 0, err
    assert f"wrote {target} (one box per module at depth 3)" in out
    source = target.read_text()
    assert "cluster_2" in source and "model.layers.7" in source and 'label="8.00 KiB"' in source


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("plan", "examples/models.py"), "must be 'path/to/file.py:factory' or 'package.module:factory'"),
        (("plan", "examples/nope.py:factory", "--spec", SPEC), "no such file: 'examples/nope.py'"),
        (
            ("plan", f"{ROOT / 'examples' / 'models.py'}:factroy", "--spec", SPEC),
            "has no callable 'factroy'; did you mean 'factory'?",
        ),
        (("plan", "fxsplit.nonexistent:f", "--spec", SPEC), "cannot import module 'fxsplit.nonexistent'"),
        (("plan", MODEL), "needs --spec SPEC or --budget DEVICE=SIZE"),
        (("code", MODEL), "fxsplit code needs --spec SPEC, --plan PLAN or --budget DEVICE=SIZE"),
        (("show", MODEL, "-o", "split.svg"), "fxsplit show needs --spec SPEC, --plan PLAN or --budget DEVICE=SIZE"),
        (("plan", MODEL, "--budget", "cpu:0"), "--budget 'cpu:0' must look like DEVICE=SIZE"),
        (("code", MODEL, "--plan", "/nonexistent/plan.yaml"), "cannot read plan file '/nonexistent/plan.yaml'"),
        (("code", MODEL, "--plan", SPEC), "format: must be 'fxsplit-plan/1'"),
        (("show", MODEL, "--spec", SPEC, "-o", "split.gif"), "cannot tell the picture format"),
        (("plan", MODEL, "--spec", SPEC, "--budget", "gpu:0=1GiB"), "is not a device"),
        (
            ("plan", MODEL, "--budget", "0=1GiB", "--budget", "cuda:0=1GiB"),
            "budgets name device 'cuda:0' twice (as 0 and 'cuda:0')",
        ),
        (
            ("code", MODEL, "--plan", SPEC, "--output-device", "cpu:0", "--dtype", "bf16", "--no-replicate"),
            "--dtype, --output-device, --no-replicate change how a plan is made, but --plan uses a saved plan",
        ),
        (("show", MODEL, "--plan", SPEC, "-o", "x.dot", "--mode", "training"), "--mode change how a plan is made"),
        (
            ("plan", MODEL, "--spec", SPEC, "-o", "/nonexistent/dir/plan.yaml"),
            "cannot write '/nonexistent/dir/plan.yaml': the directory '/nonexistent/dir' does not exist",
        ),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args: tuple[str, ...], fragment: str) -> None:
    code, _, err = run(*args)
    assert code == 2
    assert err.startswith("fxsplit: error: ") and fragment in err, err
    assert "Traceback" not in err


def test_int_budget_devices_are_cuda_indices_as_in_the_api() -> None:
    code, out, err = run("plan", MODEL, "--budget", "0=1MiB", "--budget", "1=1MiB")
    assert code == 0, err
    assert out.splitlines()[1].startswith("cuda:0 ") and "cuda:1 " in out


def test_debug_before_the_command_shows_the_traceback_too() -> None:
    for args in (
        ("--debug", "plan", f"{MODEL[:-8]}:nope", "--budget", "cpu:0=1MiB"),
        ("plan", f"{MODEL[:-8]}:nope", "--budget", "cpu:0=1MiB", "--debug"),
    ):
        code, _, err = run(*args)
        assert code == 2 and "Traceback (most recent call last)" in err, args
    code, _, err = run("plan", f"{MODEL[:-8]}:nope", "--budget", "cpu:0=1MiB")
    assert code == 2 and "Traceback" not in err


def test_argument_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as caught:
        main(["code", MODEL, "--spec", SPEC, "--plan", "plan.yaml"], out=io.StringIO(), err=io.StringIO())
    assert caught.value.code == 2


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("show", MODEL, "--spec", SPEC, "-o", "x.dot", "--depth", "-1"), "--depth: must be a whole number >= 0"),
        (("plan", MODEL, "--spec", SPEC, "--optimizer", "2.5"), "a whole number (got '2.5')"),
        (("plan", MODEL, "--spec", SPEC, "--optimizer", "{name: adamw"), "settings are not valid YAML"),
    ],
)
def test_argument_values_are_checked_with_a_reason(
    args: tuple[str, ...], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(list(args), out=io.StringIO(), err=io.StringIO())
    assert caught.value.code == 2 and fragment in capsys.readouterr().err


def test_spec_driven_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(ROOT / "examples" / "spec_driven.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "re-applied from the file without solving: same generated code, same outputs" in out
    assert "to_1 = add_2.to('cpu:1')" in out and "embedding.to(" not in out  # the embedding stays on cpu:0
    assert "fxsplit_runtime_replica(_fxsplit_replicas, 'model.embed_tokens.weight'" in out  # its head reads a replica


def test_progress_only_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    progress = StageTimer(screen, interval=0.01)
    with progress.stage("tracing"):
        import time

        time.sleep(0.05)
    assert "tracing ..." in screen.getvalue() and "\rtracing: 0." in screen.getvalue()
    quiet = io.StringIO()
    with StageTimer(quiet).stage("tracing"):
        pass
    assert quiet.getvalue() == ""


def test_memory_mode_and_dynamic_shapes_flags_override_the_spec(tmp_path: Path) -> None:
    target = tmp_path / "plan.yaml"
    code, out, err = run(
        "plan", MODEL, "--spec", SPEC, "--mode", "weights", "--dynamic-shapes", "batch", "-o", str(target)
    )
    assert code == 0, err
    plan = fxsplit.Plan.from_yaml(target.read_text())
    assert plan.dynamic_shapes == "batch"
    assert all("activations_peak" not in row for row in plan.memory.values())  # weights only
    code, _, err = run("plan", MODEL, "--spec", SPEC, "--mode", "training", "--optimizer", "adamw")
    assert code == 1 and "optimizer state" in err and "does not fit" in err
    code, _, err = run("plan", MODEL, "--spec", SPEC, "--optimizer", "adamw")
    assert code == 2 and "only counts with mode='training'" in err


def test_the_optimizer_flag_takes_a_name_bytes_per_element_or_settings(tmp_path: Path) -> None:
    rows = {}
    for given in ("sgd", "0", "{name: sgd, weight_decay: 0}"):
        target = tmp_path / "plan.yaml"
        code, _, err = run(
            "plan", MODEL, "--budget", "cpu:0=64MiB", "--mode", "training", "--optimizer", given, "-o", str(target)
        )
        assert code == 0, err
        rows[given] = fxsplit.Plan.from_yaml(target.read_text()).memory["cpu:0"]
    assert rows["sgd"]["optimizer"] == rows["0"]["optimizer"] == 0  # SGD without momentum keeps no state
    outputs = rows["0"]["optimizer_step"]  # bytes per element: no step temporaries, only the outputs held
    assert rows["{name: sgd, weight_decay: 0}"]["optimizer_step"] == outputs  # no decay: none either
    assert rows["sgd"]["optimizer_step"] > outputs  # a name counts the decay as set
    code, _, err = run("plan", MODEL, "--budget", "cpu:0=64MiB", "--mode", "training", "--optimizer", "{name: lion}")
    assert code == 2 and "need 'name', one of adam, adamw, sgd_momentum, sgd" in err


def test_a_reader_that_stops_early_is_not_an_error() -> None:
    # `fxsplit code ... | head -1`: the pipe closes while fxsplit still writes: exit 0, nothing on stderr
    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    err = io.StringIO()
    assert main(["code", MODEL, "--spec", SPEC], out=ClosedPipe(), err=err) == 0
    assert err.getvalue() == ""


def test_the_accumulate_grads_flag_plans_for_gradient_accumulation(tmp_path: Path) -> None:
    counts = {}
    for flags in ((), ("--accumulate-grads",)):
        target = tmp_path / "plan.yaml"
        base = ("plan", MODEL, "--budget", "cpu:0=64MiB", "--mode", "training", "--optimizer", "sgd", "-o")
        code, _, err = run(*base, str(target), *flags)
        assert code == 0, err
        counts[flags] = fxsplit.Plan.from_yaml(target.read_text()).memory_counts
    assert "accumulated" not in counts[()] and "gradients accumulated into .grad" in counts[("--accumulate-grads",)]
    code, _, err = run("plan", MODEL, "--budget", "cpu:0=64MiB", "--accumulate-grads")
    assert code == 2 and "only counts with mode='training'" in err
