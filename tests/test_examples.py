"""The examples run as a user runs them (``python examples/x.py``) and say that they match."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_three_layer() -> None:
    out = run_example("three_layer.py")
    assert "to_1 = relu.to('cpu:1')" in out  # the generated code is printed, copy visible
    assert "net1 on cpu:0, net2 on cpu:1; output on cpu:1" in out
    assert "outputs and gradients match the unsplit model" in out
    assert out.startswith("device  budget")


def test_train_two_devices() -> None:
    out = run_example("train_two_devices.py")
    lines = out.splitlines()
    steps = [line.split() for line in lines if line.strip()[:1].isdigit() and len(line.split()) == 3]
    assert len(steps) == 12
    assert all(abs(float(split) - float(single)) <= 1e-5 for _, split, single in steps)
    assert "split training matches single-device training" in out
    assert any(line.startswith("cpu:1") for line in lines)  # both devices in the plan table
