"""Offload in specs and on the command line: the ``offload:`` key, its checks, and the ``--offload-*`` flags."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

import fxsplit
from fxsplit.cli import main
from fxsplit.options import Offload
from fxsplit.spec import OFFLOAD_KEYS, SpecProblems, load_spec

KiB, MiB = 1024, 1024 * 1024
DEVICES = "devices: {cpu:0: 700KiB, cpu:1: 700KiB}\n"  # half of the 2 MiB of weights below


def model() -> torch.nn.Sequential:
    """8 x (Linear(256, 256), ReLU): 2 MiB of weights."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())])


X = (torch.randn(4, 256),)
FACTORY = """\
import torch

def factory():
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())]
    return torch.nn.Sequential(*layers), (torch.randn(4, 256),)
"""


# (spec text, [(line, path, message fragment), ...]): every expected problem, and nothing else.
BAD_OFFLOAD = [
    pytest.param(
        "offload: 16GiB", [(1, "offload", "must map host, disk, dir and prefetch, like {host: 16GiB, disk: 100GiB")]
    ),
    pytest.param("offload: 1TB", [(1, "offload", "(got str '1TB'); for host memory write {host: 1TB}")]),
    pytest.param("offload: [host]", [(1, "offload", "dir: offload/} (got list ['host'])")]),
    pytest.param("offload:\n  hots: 1GiB", [(2, "offload['hots']", "unknown key; did you mean 'host'?")]),
    pytest.param(
        "offload:\n  host: 1GiB\n  pinned: true", [(3, "offload['pinned']", "valid keys: host, disk, dir, prefetch")]
    ),
    pytest.param("offload:\n  host: 1 GiBs", [(2, "offload['host']", "host budget '1 GiBs' has unknown unit 'GiBs'")]),
    pytest.param("offload:\n  host: -1", [(2, "offload['host']", "host budget must not be negative")]),
    pytest.param("offload: {prefetch: 2}", [(1, "offload", "needs a host or disk budget")]),
    pytest.param("offload:\n  disk: 10GiB", [(2, "offload['disk']", "needs dir: the directory the stored weights")]),
    pytest.param("offload:\n  host: 1GiB\n  dir: 3", [(3, "offload['dir']", "must be a directory path, as a string")]),
    pytest.param("offload:\n  host: 1GiB\n  dir: ''", [(3, "offload['dir']", "must be a directory path")]),
    pytest.param("offload:\n  host: 1GiB\n  dir: off", [(3, "offload['dir']", "(got bool False); quote it")]),
    pytest.param("offload:\n  host: 1GiB\n  prefetch: 9", [(3, "offload['prefetch']", "from 0 to 8")]),
    pytest.param("offload:\n  host: 1GiB\n  prefetch: -1", [(3, "offload['prefetch']", "(got int -1)")]),
    pytest.param("offload:\n  host: 1GiB\n  prefetch: true", [(3, "offload['prefetch']", "(got bool True)")]),
    pytest.param("offload:\n  host: 1GiB\n  prefetch: 1.5", [(3, "offload['prefetch']", "(got float 1.5)")]),
    pytest.param(
        "devices: {cpu:0: 1 GiBs}\noffload:\n  hots: 1GiB\n  disk: 2 GB s\n  dir: [a]\n  prefetch: many\ntrace: fxx",
        [
            (1, "devices['cpu:0']", "unknown unit 'GiBs'"),
            (3, "offload['hots']", "did you mean 'host'?"),
            (4, "offload['disk']", "disk budget '2 GB s' is not a size"),
            (5, "offload['dir']", "must be a directory path"),
            (6, "offload['prefetch']", "(got str 'many')"),
            (7, "trace", "did you mean 'fx'?"),
        ],
        id="all-at-once",
    ),
]


@pytest.mark.parametrize(("text", "expected"), BAD_OFFLOAD)
def test_bad_offload_reports_every_problem_with_path_and_line(text: str, expected: list) -> None:
    with pytest.raises(SpecProblems) as caught:
        load_spec(text)
    rendered = [p.render("<spec>") for p in caught.value.problems]
    assert len(rendered) == len(expected), rendered
    for problem, (line, path, fragment) in zip(caught.value.problems, expected, strict=True):
        assert (problem.line, problem.render("x").split(": ", 2)[1]) == (line, path), rendered
        assert fragment in problem.message, rendered


def test_offload_fields_are_read() -> None:
    spec = load_spec(DEVICES + "offload:\n  host: 16GiB\n  disk: 100GB\n  dir: off/\n  prefetch: 0\n")
    assert spec.offload == Offload(host=16 * 2**30, disk=100 * 10**9, dir="off/", prefetch=0)
    assert spec.options() == {"offload": spec.offload}  # what fxsplit.plan gets as offload=
    assert load_spec("offload: {host: 1MiB}").offload == Offload(host=MiB)  # prefetch: fxsplit's choice (None)
    assert load_spec("offload: {host: 1MiB, disk: null}").offload == Offload(host=MiB)  # null: no disk
    assert load_spec("offload: {host: 1MiB, dir: ~/off}").offload.dir == os.path.expanduser("~/off")
    assert load_spec({"offload": Offload(host=MiB)}).offload == Offload(host=MiB)
    assert OFFLOAD_KEYS == ("host", "disk", "dir", "prefetch")


def test_a_relative_dir_is_relative_to_the_spec_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "big.yaml").write_text(DEVICES + "offload: {disk: 4MiB, dir: offload/}\n")
    (folder / "abs.yaml").write_text(DEVICES + f"offload: {{disk: 4MiB, dir: {tmp_path / 'elsewhere'}}}\n")
    assert load_spec(folder / "big.yaml").offload.dir == os.path.join(folder, "offload/")
    assert load_spec(str(folder / "abs.yaml")).offload.dir == str(tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path)
    assert load_spec("configs/big.yaml").offload.dir == os.path.join("configs", "offload/")
    monkeypatch.chdir(folder)
    assert load_spec("big.yaml").offload.dir == "offload/"
    assert load_spec(DEVICES + "offload: {disk: 4MiB, dir: offload/}").offload.dir == "offload/"  # text: as written


def test_spec_offload_streams_what_the_devices_cannot_hold() -> None:
    with pytest.raises(fxsplit.BudgetError, match="the parameters alone exceed them"):
        fxsplit.plan(model(), spec=DEVICES, example_inputs=X)
    spec = DEVICES + "offload:\n  host: 1MiB\n  disk: 4MiB\n  dir: stored\n  prefetch: 1\n"
    plan = fxsplit.plan(model(), spec=spec, example_inputs=X)
    assert plan.streamed and set(plan.streamed.values()) <= {"host", "disk"}
    assert plan.offload == {"host": MiB, "disk": 4 * MiB, "dir": "stored", "prefetch": 1}
    assert sum(plan.stored_bytes.values()) == 8 * 256 * 256 * 4  # every weight matrix stored, biases resident
    assert "offloaded: 8 parameter(s) stored in host 1.00 MiB of 1.00 MiB, disk 1.00 MiB of 4.00 MiB" in str(plan)
    # an explicit offload= replaces the spec's whole: no disk left, host alone cannot hold 2 MiB
    with pytest.raises(fxsplit.BudgetError, match="do not fit the offload storage"):
        fxsplit.plan(model(), spec=spec, example_inputs=X, offload={"host": "1MiB"})
    with pytest.raises(fxsplit.BudgetError, match="the parameters alone exceed them"):
        fxsplit.plan(model(), spec=spec, example_inputs=X, offload=None)
    hosted = fxsplit.plan(model(), spec=spec, example_inputs=X, offload={"host": "3MiB", "prefetch": 0})
    assert set(hosted.streamed.values()) == {"host"} and hosted.offload["prefetch"] == 0


def test_a_split_from_a_spec_file_stores_weights_beside_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "configs").mkdir()
    spec = tmp_path / "configs" / "big.yaml"
    spec.write_text(DEVICES + "offload:\n  disk: 4MiB\n  dir: offload\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    reference = model()
    expected = reference(*X)
    split = fxsplit.fxsplit(model(), spec=str(spec), example_inputs=X)
    torch.testing.assert_close(split(*X), expected)
    # the file is written there, mapped and unlinked at once (fxsplit.checkpoint.write): the folder remains
    assert (tmp_path / "configs" / "offload").is_dir() and not list((tmp_path / "elsewhere").iterdir())


# ---- the command line ----


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture()
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding ``chain.py:factory`` and ``big.yaml`` (with offload), the working directory."""
    (tmp_path / "chain.py").write_text(FACTORY)
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "big.yaml").write_text(
        DEVICES + "offload: {host: 1MiB, disk: 4MiB, dir: offload, prefetch: 1}\n"
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_cli_plans_a_spec_with_offload(workdir: Path) -> None:
    code, out, err = run("plan", "chain.py:factory", "--spec", "specs/big.yaml", "-o", "plan.yaml")
    assert code == 0, err
    assert out.splitlines()[0].split()[:4] == ["device", "budget", "weights", "streamed"]
    assert (
        "offloaded: 8 parameter(s) stored in host 1.00 MiB of 1.00 MiB, disk 1.00 MiB of 4.00 MiB "
        f"(dir {os.path.join('specs', 'offload')}); streamed per forward: 2.00 MiB in 8 copies, prefetch 1" in out
    )
    saved = fxsplit.Plan.from_yaml((workdir / "plan.yaml").read_text())
    assert saved.streamed and saved.offload["dir"] == os.path.join("specs", "offload")
    code, _, err = run("plan", "chain.py:factory", "--budget", "cpu:0=700KiB", "--budget", "cpu:1=700KiB")
    assert code == 1 and "does not fit" in err  # without offload it does not fit


def test_cli_flags_override_the_spec_offload_field_by_field(workdir: Path) -> None:
    spec = ("chain.py:factory", "--spec", "specs/big.yaml", "-o", "plan.yaml")
    code, out, err = run("plan", *spec, "--offload-host", "0", "--prefetch", "0", "--offload-dir", "mine")
    assert code == 0, err
    plan = fxsplit.Plan.from_yaml((workdir / "plan.yaml").read_text())
    assert plan.offload == {"host": 0, "disk": 4 * MiB, "dir": "mine", "prefetch": 0}  # disk from the spec
    assert set(plan.streamed.values()) == {"disk"} and "(dir mine)" in out
    budgets = ("--budget", "cpu:0=700KiB", "--budget", "cpu:1=700KiB")
    code, out, err = run("plan", "chain.py:factory", *budgets, "--offload-host", "3MiB", "-o", "plan.yaml")
    assert code == 0, err
    plan = fxsplit.Plan.from_yaml((workdir / "plan.yaml").read_text())
    assert plan.offload == {"host": 3 * MiB, "disk": None, "dir": None, "prefetch": 0}  # CPU devices: in line
    assert "offloaded: 6 parameter(s) stored in host 1.50 MiB of 3.00 MiB;" in out


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (("--prefetch", "2"), "--offload-dir and --prefetch need --offload-host or --offload-disk"),
        (("--offload-disk", "4MiB"), "--offload-disk needs --offload-dir DIR"),
        (("--offload-host", "1 MiBs"), "--offload-host '1 MiBs' has unknown unit 'MiBs'"),
        (("--offload-host", "1MiB", "--prefetch", "9"), "--prefetch must be from 0 to 8 ops ahead (got 9)"),
    ],
)
def test_cli_offload_flag_errors_exit_2(workdir: Path, flags: tuple[str, ...], fragment: str) -> None:
    code, _, err = run("plan", "chain.py:factory", "--budget", "cpu:0=700KiB", *flags)
    assert code == 2 and err.startswith("fxsplit: error: ") and fragment in err, err


def test_cli_checks_flags_against_the_spec_offload(workdir: Path) -> None:
    code, _, err = run("plan", "chain.py:factory", "--spec", "specs/big.yaml", "--prefetch", "9")
    assert code == 2 and "--prefetch must be from 0 to 8" in err
    with pytest.raises(SystemExit) as caught:
        run("plan", "chain.py:factory", "--spec", "specs/big.yaml", "--prefetch", "two")
    assert caught.value.code == 2
