"""Loading a checkpoint onto a split: peak anonymous memory, and time vs Accelerate.

Writes a sharded safetensors checkpoint (``model.safetensors.index.json``, as
``save_pretrained`` does) of a stack of MLP blocks (random float32 weights, 4
blocks, 8 large weight matrices), then, each in a fresh subprocess:

* fxsplit: the model built on ``meta``, ``fxsplit.fxsplit(model, budgets,
  checkpoint=dir)`` over 4 logical devices ``cpu:0..cpu:3`` (one block each);
* Accelerate: the model built under ``init_empty_weights()``,
  ``load_checkpoint_and_dispatch(model, dir, device_map={"": "cpu"})``.

Each child samples ``RssAnon`` of ``/proc/self/status`` (anonymous memory:
what the process allocated, not the page cache its memory maps read) every
millisecond from a thread while it loads, and checks the loaded weights
against the checksum written with the checkpoint.

The bar (fxsplit only): peak RssAnon <= model bytes + largest tensor + 400 MiB,
the whole process counted (torch itself included). Time: the whole call
(trace, plan and load for fxsplit; load and dispatch for Accelerate), the
same file, read from the page cache by both (it was just written).

    python -m benchmarks.checkpoint_load [--size 2GiB] [--dir /tmp] [--out benchmarks/CHECKPOINT_RESULTS.md]

Exits 1 when the bar fails. The checkpoint is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

HERE = Path(__file__).parent
ROOT = HERE.parent
BLOCKS = 4
DEVICES = [f"cpu:{i}" for i in range(BLOCKS)]
MARGIN = 400 * 2**20
WHAT = (
    "A sharded safetensors checkpoint (4 shards and model.safetensors.index.json) of 4 MLP blocks in float32, "
    "loaded in a fresh process by each tool: fxsplit builds the model on meta and calls "
    "`fxsplit.fxsplit(model, budgets, checkpoint=dir)` over cpu:0..cpu:3 (one block each; the time includes "
    "tracing and planning); Accelerate builds it under `init_empty_weights()` and calls "
    "`load_checkpoint_and_dispatch(model, dir, device_map={'': 'cpu'})`. *peak RssAnon* is the process's "
    "anonymous memory (torch included), sampled every millisecond during the call; *before load* is it just "
    "before. Both check the loaded weights against the checkpoint's checksum. Bar (fxsplit): peak RssAnon <= "
    "model bytes + largest tensor + 400 MiB."
)


class Stack(nn.Module):
    """``BLOCKS`` MLP blocks ``width -> 4*width -> width``: 8 weights of ``4*width**2`` elements."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(BLOCKS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def width_for(nbytes: int) -> int:
    """The width (a multiple of 64) whose float32 stack is about ``nbytes``."""
    return max(64, 64 * round(math.sqrt(nbytes / (2 * BLOCKS * 4 * 4)) / 64))


def write_checkpoint(directory: Path, nbytes: int) -> dict[str, Any]:
    """A sharded safetensors checkpoint of a random :class:`Stack` (one shard per block) and its description."""
    from safetensors.torch import save_file

    width = width_for(nbytes)
    with torch.device("meta"):
        names = list(Stack(width).state_dict().items())
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    checksum, total, largest = 0.0, 0, 0
    for block in range(BLOCKS):
        shard = f"model-{block + 1:05d}-of-{BLOCKS:05d}.safetensors"
        tensors = {n: torch.randn(t.shape, generator=generator) for n, t in names if n.startswith(f"blocks.{block}.")}
        save_file(tensors, str(directory / shard))
        for name, tensor in tensors.items():
            weight_map[name] = shard
            checksum += float(tensor.double().sum())
            total += tensor.numel() * tensor.element_size()
            largest = max(largest, tensor.numel() * tensor.element_size())
        del tensors
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return {
        "dir": str(directory),
        "width": width,
        "checksum": checksum,
        "model_bytes": total,
        "largest": largest,
        "tensors": len(weight_map),
    }


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakSampler:
    """The highest RssAnon seen, sampled every millisecond by a thread between start and stop."""

    def __init__(self) -> None:
        self.peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.001)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


def _child(tool: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Load the checkpoint with ``tool`` in this process; what it cost."""
    torch.set_num_threads(1)
    width = checkpoint["width"]
    if tool == "fxsplit":
        import fxsplit

        with torch.device("meta"):
            model = Stack(width).eval()
        each = math.ceil(checkpoint["model_bytes"] / BLOCKS * 1.05)
        budgets = {d: each for d in DEVICES}
        baseline = _rss_anon()
        with PeakSampler() as sampler:
            start = time.perf_counter()
            split = fxsplit.fxsplit(
                model, budgets, trace="fx", mode="weights", checkpoint=checkpoint["dir"], progress=False
            )
            seconds = time.perf_counter() - start
        devices = sorted(set(split.meta["fxsplit_plan"].param_devices.values()))
    else:
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch

        with init_empty_weights():
            model = Stack(width).eval()
        baseline = _rss_anon()
        with PeakSampler() as sampler:
            start = time.perf_counter()
            model = load_checkpoint_and_dispatch(model, checkpoint["dir"], device_map={"": "cpu"})
            seconds = time.perf_counter() - start
        devices = ["cpu"]
    checksum = sum(float(t.double().sum()) for t in model.state_dict().values())
    if not math.isclose(checksum, checkpoint["checksum"], rel_tol=1e-9, abs_tol=1e-3):
        raise SystemExit(f"{tool}: loaded weights sum to {checksum}, the checkpoint's to {checkpoint['checksum']}")
    return {"tool": tool, "seconds": seconds, "peak_anon": sampler.peak, "baseline_anon": baseline, "devices": devices}


def measure(tool: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`_child` for ``tool`` in a fresh Python; its numbers with the checkpoint's and the bar."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.checkpoint_load", "--child", tool, "--checkpoint", json.dumps(checkpoint)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{tool} child failed:\n{done.stdout}\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    bar = checkpoint["model_bytes"] + checkpoint["largest"] + MARGIN
    return {**result, **{k: checkpoint[k] for k in ("model_bytes", "largest", "tensors")}, "bar": bar}


def measure_fxsplit(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """fxsplit's numbers for ``checkpoint`` (for the test that runs a small one)."""
    return measure("fxsplit", checkpoint)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f}"


def report(results: list[dict[str, Any]], out: TextIO) -> None:
    """The results as a Markdown table."""
    out.write(
        "| tool | checkpoint MiB | tensors | largest MiB | devices | weights end up in | peak RssAnon MiB "
        "| before load MiB | bar MiB | bar | seconds |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    for r in results:
        verdict = ("ok" if r["peak_anon"] <= r["bar"] else "FAIL") if r["tool"] == "fxsplit" else "info"
        grew = r["peak_anon"] - r["baseline_anon"] >= r["model_bytes"] // 2
        held = "own memory" if grew else "views of the mapped file"
        out.write(
            f"| {r['tool']} | {_mib(r['model_bytes'])} | {r['tensors']} | {_mib(r['largest'])} | "
            f"{', '.join(r['devices'])} | {held} | {_mib(r['peak_anon'])} | {_mib(r['baseline_anon'])} | "
            f"{_mib(r['bar'])} | {verdict} | {r['seconds']:.2f} |\n"
        )
    out.write(
        "\n*weights end up in*: read from the measurement (anonymous memory grew by at least half the "
        "checkpoint or not). Views of the mapped file cost no copy, but live in the page cache (read from "
        "disk again when evicted; the checkpoint file must not be rewritten while they are in use); fxsplit "
        "copies each tensor once into memory of its own on its planned device, as it must for a GPU.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2GiB", help="checkpoint size (default 2GiB)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write the checkpoint")
    parser.add_argument("--out", default=str(HERE / "CHECKPOINT_RESULTS.md"))
    parser.add_argument("--no-accelerate", action="store_true", help="measure fxsplit only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, json.loads(args.checkpoint))))
        return 0
    from fxsplit.units import parse_size

    directory = Path(tempfile.mkdtemp(prefix="fxsplit-ckpt-", dir=args.dir))
    try:
        checkpoint = write_checkpoint(directory, parse_size(args.size))
        tools = ["fxsplit"] + ([] if args.no_accelerate else ["accelerate"])
        results = [measure(tool, checkpoint) for tool in tools]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    with open(args.out, "w") as out:
        out.write(
            f"# Loading a checkpoint onto a split\n\nWritten by `python -m benchmarks.checkpoint_load --size "
            f"{args.size}` (torch {torch.__version__}, {platform.machine()}, 1 torch thread). {WHAT}\n\n"
        )
        report(results, out)
    report(results, sys.stdout)
    failed = [r for r in results if r["tool"] == "fxsplit" and r["peak_anon"] > r["bar"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
