"""The examples run as a user runs them (``python examples/x.py``) and say that they match."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # each runs an example script in a fresh interpreter, 7-13 s

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
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


def test_pipeline_inprocess() -> None:
    out = run_example("pipeline_inprocess.py")
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("# stage")] == [
        "# stage 0 on cpu",
        "# stage 1 on cpu",
        "# stage 2 on cpu",
    ]
    steps = re.findall(r"^step (\d+): pipelined loss ([\d.]+) +unsplit loss ([\d.]+)$", out, re.M)
    assert len(steps) == 5
    assert all(abs(float(piped) - float(alone)) <= 1e-6 for _, piped, alone in steps)


def test_pipeline_torchrun_command_of_the_readme() -> None:
    command = "torchrun --standalone --nproc-per-node 2 examples/pipeline_torchrun.py"
    assert f"  {command}\n" in (ROOT / "README.md").read_text(encoding="utf-8")  # the README's block, run here
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "pipeline_torchrun.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "tied: embed.weight = head.weight: replicated on stages 0 (cpu:0), 1 (cpu:1)" in out
    assert "each forward" not in out
    losses = [float(v) for v in re.findall(r"^step \d+: loss ([\d.]+)$", out, re.M)]
    assert len(losses) == 8 and losses[-1] < losses[0] / 2
    # the first step's loss (before any update) is the unsplit model's on the same batch
    spec = importlib.util.spec_from_file_location("pipeline_torchrun", ROOT / "examples" / "pipeline_torchrun.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)  # as every rank does
    model = example.TinyLM()
    ids = torch.randint(0, 128, (16, 12))
    with torch.no_grad():
        expected = example.loss_fn(model(ids), (ids + 1) % 128).item()
    assert abs(losses[0] - expected) <= 1e-4


def test_from_checkpoint() -> None:
    out = run_example("from_checkpoint.py")
    assert "shards + model.safetensors.index.json" in out
    assert [line.split()[0] for line in out.splitlines() if line.startswith("cpu:")] == ["cpu:0:", "cpu:1:"]
    assert "the split loaded from the checkpoint gives the same logits as from_pretrained" in out


def test_offload() -> None:
    out = run_example("offload.py")
    assert "offloaded:" in out and "streamed per forward" in out
    assert re.search(r"stored in host [\d.]+ KiB of 600\.00 KiB, disk [\d.]+ KiB of 4\.00 MiB", out), out
    assert "fxsplit_runtime_prefetch(stored_" in out
    assert "logits equal to from_pretrained's" in out


def test_generate() -> None:
    out = run_example("generate.py")
    assert out.startswith("device  budget")
    cache = re.findall(r"^(cpu:\d): ([\d.]+ KiB) of cache, 4 x \[1, 2, 48, 32\]: (.*)$", out, re.M)
    assert [device for device, _, _ in cache] == ["cpu:0", "cpu:1"], out  # both devices hold layers' caches
    names = sorted(name for _, _, names in cache for name in names.split(", "))
    assert names == sorted(f"{kind}_cache_{layer}" for kind in ("key", "value") for layer in range(4))
    assert sum(float(size.split()[0]) for _, size, _ in cache) == 96.0  # 8 x 1*2*48*32 float32
    generated = re.search(r"^generated: \[([\d, ]+)\]$", out, re.M)
    assert generated is not None and len(generated.group(1).split(", ")) == 32
    assert out.rstrip().endswith("same tokens as model.generate")
