"""Hostile YAML is refused fast: alias bombs, huge files, deep nesting, long values, in specs and plan files."""

from __future__ import annotations

import io
import time
import tracemalloc
from pathlib import Path
from typing import Callable

import pytest

import fxsplit
from fxsplit.cli import main
from fxsplit.planning.yamlio import plan_from_yaml
from fxsplit.yamlfile import MAX_PLAN_BYTES, MAX_SPEC_BYTES, YamlProblems, load_yaml, short_repr

MODEL = f"{Path(__file__).resolve().parents[1] / 'examples' / 'models.py'}:factory"
QUICK = 5.0  # seconds of this process's CPU (not wall time: a loaded machine stretches that): generous, the
# slowest case (a 50,000-item flow list) takes under 2; what it guards against is parsing that grows with the
# square of the input, or an alias bomb


def alias_bomb(levels: int, key: str) -> str:
    """Billion laughs: 9 ** (levels + 1) strings from a few hundred bytes, the last level under ``key``."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join([*lines, f"{key}: *a{levels}"]) + "\n"


def plan_bomb(levels: int) -> str:
    return "format: fxsplit-plan/1\n" + alias_bomb(levels, "devices")


def timed(call: Callable[[], object]) -> tuple[BaseException, float]:
    start = time.process_time()
    with pytest.raises(fxsplit.FxsplitError) as caught:
        call()
    return caught.value, time.process_time() - start


def run(*args: str) -> tuple[int, str, float]:
    err = io.StringIO()
    start = time.process_time()
    code = main(list(args), out=io.StringIO(), err=err)
    return code, err.getvalue(), time.process_time() - start


@pytest.mark.parametrize("levels", [9, 12])
def test_alias_bombs_in_specs_are_refused_fast(levels: int, tmp_path: Path) -> None:
    text = alias_bomb(levels, "devices")
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    for source in (text, path, str(path)):
        error, seconds = timed(lambda source=source: fxsplit.load_spec(source))  # type: ignore[misc]
        assert seconds < QUICK
        assert isinstance(error, fxsplit.SpecError) and len(str(error)) < 1000
        assert ":2: <top>: alias *a0: a spec file takes no YAML aliases" in str(error)


@pytest.mark.parametrize("levels", [8, 9, 12])
def test_alias_bombs_in_plan_files_are_refused_fast(levels: int) -> None:
    error, seconds = timed(lambda: fxsplit.Plan.from_yaml(plan_bomb(levels)))
    assert seconds < QUICK
    assert isinstance(error, fxsplit.SpecError) and len(str(error)) < 1000
    assert "<plan>:3: <top>: alias *a0: a plan file takes no YAML aliases" in str(error)


def test_alias_bombs_through_the_cli_exit_2_fast(tmp_path: Path) -> None:
    spec, plan = tmp_path / "spec.yaml", tmp_path / "plan.yaml"
    spec.write_text(alias_bomb(9, "devices"))
    plan.write_text(plan_bomb(9))
    for args in (
        ("plan", MODEL, "--spec", str(spec)),
        ("check", MODEL, "--plan", str(plan)),
        ("code", MODEL, "--plan", str(plan)),
        ("check", MODEL, "--plan", str(plan), "--spec", str(spec)),
    ):
        code, err, seconds = run(*args)
        assert code == 2 and seconds < QUICK, (args, code, seconds)
        assert err.startswith("fxsplit: error: ") and "takes no YAML aliases" in err and len(err) < 1000


def test_a_huge_file_is_refused_without_being_read(tmp_path: Path) -> None:
    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as handle:
        handle.truncate(256 << 20)  # sparse: 256 MiB of zero bytes, no disk used
    tracemalloc.start()
    try:
        spec_error, spec_seconds = timed(lambda: fxsplit.load_spec(huge))
        code, err, cli_seconds = run("check", MODEL, "--plan", str(huge))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert spec_seconds < QUICK and cli_seconds < QUICK
    assert peak < MAX_PLAN_BYTES, peak
    assert f"spec file '{huge}' is 256.00 MiB (268435456 bytes); a spec file may hold at most 1.00 MiB" in str(
        spec_error
    )
    assert code == 2 and "plan file" in err and "256.00 MiB" in err and "at most 8.00 MiB" in err


def test_huge_text_is_refused_by_size(tmp_path: Path) -> None:
    big = "pin:\n" + "".join(f"  layer{i}: cpu:0\n" for i in range(MAX_SPEC_BYTES // 16))
    assert len(big) > MAX_SPEC_BYTES
    error, seconds = timed(lambda: fxsplit.load_spec(big))
    assert seconds < QUICK and "a spec may hold at most 1.00 MiB (1048576 bytes)" in str(error)
    error, seconds = timed(lambda: fxsplit.Plan.from_yaml("x" * (MAX_PLAN_BYTES + 1)))
    assert seconds < QUICK and "a plan may hold at most 8.00 MiB" in str(error)
    path = tmp_path / "big.yaml"
    path.write_text(big)
    code, err, _ = run("plan", MODEL, "--spec", str(path))
    assert code == 2 and "a spec file may hold at most 1.00 MiB" in err


def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    deep = "devices: " + "[" * 50_000 + "]" * 50_000 + "\n"
    error, seconds = timed(lambda: fxsplit.load_spec(deep))
    assert seconds < QUICK and "nested more than 32 levels deep" in str(error)
    error, seconds = timed(lambda: fxsplit.Plan.from_yaml("format: fxsplit-plan/1\n" + deep))
    assert seconds < QUICK and "nested more than 32 levels deep" in str(error)
    path = tmp_path / "deep.yaml"
    path.write_text(deep)
    code, err, _ = run("code", MODEL, "--plan", str(path))
    assert code == 2 and "nested more than 32 levels deep" in err


@pytest.mark.slow  # nine 200 kB documents: ~7 s
def test_long_values_are_cut_short_in_messages() -> None:
    long = "x" * 200_000
    cases = [
        lambda: fxsplit.load_spec(f"trace: {long}\n"),
        lambda: fxsplit.load_spec(f"devices: {{cpu:0: {long}}}\n"),
        lambda: fxsplit.load_spec(f"devices:\n  ? {long}\n  : 1GiB\n"),  # a long key needs '?'
        lambda: fxsplit.load_spec(f"? {long}\n: 1\n"),
        lambda: fxsplit.load_spec(f"pin: [{', '.join(['a'] * 50_000)}]\n"),
        lambda: fxsplit.load_spec({"devices": {"cpu:0": "1GiB"}, "objective": long}),
        lambda: fxsplit.Plan.from_yaml(f"format: {long}\n"),
        lambda: fxsplit.Plan.from_yaml(f"format: fxsplit-plan/1\ndevices: {{cpu:0: {{budget: {long}}}}}\n"),
        lambda: fxsplit.Plan.from_yaml(f"format: fxsplit-plan/1\nplacement: [{', '.join(['a'] * 50_000)}]\n"),
    ]
    for case in cases:
        error, seconds = timed(case)
        assert seconds < QUICK
        assert isinstance(error, fxsplit.SpecError)
        assert len(str(error)) < 2000, str(error)[:3000]
        assert "..." in str(error), str(error)


def test_many_problems_are_counted_and_the_message_stays_short() -> None:
    text = "".join(f"key{i}: 1\n" for i in range(5000))
    error, _ = timed(lambda: fxsplit.load_spec(text))
    assert isinstance(error, YamlProblems) and len(error.problems) == 5000
    assert "<spec>: 5000 problems:" in str(error) and "... and 4950 more" in str(error)
    assert len(str(error)) < 20_000


def test_python_tags_stay_refused_in_plan_files(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    text = f"format: fxsplit-plan/1\ndevices: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(fxsplit.SpecError, match="no Python objects, no code"):
        plan_from_yaml(text)
    assert not marker.exists()


def test_unreadable_files_say_why(tmp_path: Path) -> None:
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("devices: {cpu:0: 1GiB}  # d\xe9j\xe0 vu\n".encode("latin-1"))
    with pytest.raises(fxsplit.SpecError, match=r"is not UTF-8 text \(byte 27 is 0xe9\)"):
        fxsplit.load_spec(latin)
    code, err, _ = run("check", MODEL, "--plan", str(latin))
    assert code == 2 and "is not UTF-8 text" in err
    with pytest.raises(fxsplit.SpecError, match="cannot read spec file"):
        fxsplit.load_spec(tmp_path / "nope.yaml")


def test_what_is_read_keeps_its_lines() -> None:
    data, lines, problems = load_yaml("a: 1\nb:\n  - x\n  - {c: 2}\nb: 3\n", "spec")
    assert data == {"a": 1, "b": 3}
    assert lines[("a",)] == 1 and lines[("b", 1, "c")] == 4
    assert [(p.path, p.line) for p in problems] == [(("b",), 5)]
    assert short_repr("y" * 10_000).count("y") < 70
