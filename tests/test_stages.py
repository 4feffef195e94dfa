"""fxsplit.stages: the elapsed time of tracing and planning, on stderr when asked or on a terminal."""

from __future__ import annotations

import io

import pytest
import torch

import fxsplit
from fxsplit.stages import StageTimer


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))


def test_a_stage_prints_its_time_when_enabled_and_nothing_otherwise() -> None:
    shown, quiet = io.StringIO(), io.StringIO()
    with StageTimer(shown, enabled=True, interval=0.01).stage("tracing"):
        pass
    with StageTimer(quiet).stage("tracing"):  # not a terminal: silent by default
        pass
    assert shown.getvalue().split("\r")[-1].startswith("tracing: ") and quiet.getvalue() == ""


@pytest.mark.parametrize("progress", [True, False])
def test_fxsplit_and_apply_report_tracing_time_on_stderr_when_asked(
    progress: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    budgets = {"cpu:0": "2KiB", "cpu:1": "2KiB"}
    gm = fxsplit.fxsplit(_model(), budgets, trace="fx", progress=progress)
    fxsplit.apply(_model(), gm.meta["fxsplit_plan"], progress=progress)
    err = capsys.readouterr().err
    if progress:
        assert "fxsplit: tracing and planning: " in err and "fxsplit: tracing and checking the plan: " in err
    else:
        assert err == ""
