"""Timing helpers and the description of the machine a run happened on."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")

__all__ = [
    "fit_slope",
    "free_port",
    "load_average",
    "machine",
    "median",
    "run_alone",
    "time_call",
    "torchrun_command",
]


def median(values: Sequence[float]) -> float:
    """The median (the mean of the middle two for an even count)."""
    return float(statistics.median(values))


def time_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` took, and what it returned."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``log(y)`` against ``log(x)``: 1.0 is linear scaling."""
    import numpy as np

    return float(np.polyfit(np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float)), 1)[0])


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (zeros where the OS has none)."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> dict[str, Any]:
    """The commit measured (``git rev-parse HEAD``) and whether fxsplit/ or benchmarks/ had uncommitted changes."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
        changed = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", "fxsplit", "benchmarks"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}
    if head.returncode != 0:
        return {"commit": "unknown", "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(changed.stdout.strip())}


def _commit_label(state: dict[str, Any]) -> str:
    return state["commit"] + ("+dirty" if state["dirty"] else "")


def machine(threads: int) -> dict[str, Any]:
    """CPU, cores, memory, torch threads and library versions."""
    import accelerate
    import torch
    import transformers

    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory = round(pages * size / 2**30, 1)
    except (ValueError, OSError):
        memory = None
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": memory,
        "torch_threads": threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "fxsplit_commit": _commit_label(git_commit()),
    }


def run_alone(command: str, threads: int, quick: bool, run: Callable[[], T]) -> tuple[T, dict[str, Any]]:
    """``run()`` with ``threads`` torch threads, and the context a results file records about it.

    For a benchmark run on its own (``python -m benchmarks.X``): the command line, the machine, the
    commit, when it started, how long it took and the load average before and after.
    """
    import time
    from datetime import datetime, timezone

    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    started, load_start, clock = datetime.now(timezone.utc), load_average(), time.perf_counter()
    try:
        result = run()
    finally:
        torch.set_num_threads(previous)
    context = {
        "command": command,
        "quick": quick,
        "machine": machine(threads),
        "commit": git_commit(),
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "duration_s": time.perf_counter() - clock,
        "load_samples": [load_start[0], load_average()[0]],
    }
    return result, context


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a torch.distributed rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_command(script: Path, *args: str, processes: int = 2) -> list[str]:
    """``torchrun`` (as ``python -m torch.distributed.run``) running ``script`` with ``args`` in ``processes``
    local processes, on a free port of 127.0.0.1."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(processes),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        *args,
    ]
