"""Loading a checkpoint onto a split: peak anonymous memory, and time vs Accelerate, with and without offload.

Writes a sharded safetensors checkpoint (4 shards and
``model.safetensors.index.json``, as ``save_pretrained`` does) of a stack of
16 MLP blocks (random float32 weights, 32 large weight matrices), then, each
in a fresh subprocess:

* ``fxsplit``: the model built on ``meta``, ``fxsplit.fxsplit(model, budgets,
  checkpoint=dir)`` over 4 logical devices ``cpu:0..cpu:3`` (4 blocks each);
* ``accelerate``: the model built under ``init_empty_weights()``,
  ``load_checkpoint_and_dispatch(model, dir, device_map={"": "cpu"})``;
* ``fxsplit-offload``: as ``fxsplit``, with budgets that add up to half the
  checkpoint (an eighth each) and ``offload={"disk": <checkpoint size>, "dir":
  ...}``: each device keeps resident what fits beside its streaming buffers, and
  the rest is stored on disk (for a safetensors checkpoint in the planned
  dtype: views of the checkpoint's own mapped file);
* ``accelerate-offload``: ``load_checkpoint_and_dispatch(model, dir,
  device_map=<first 8 blocks "cpu", last 8 "disk">, offload_folder=...)``: half
  the checkpoint in memory, as ``max_memory={"cpu": <half>}`` would map it.

Each child samples ``RssAnon`` of ``/proc/self/status`` (anonymous memory:
what the process allocated, not the page cache its memory maps read) every
millisecond from a thread while it loads, checks the loaded weights against
the checksum written with the checkpoint, and runs one forward (whose output
the parent compares across tools).

The bars (fxsplit only), the whole process counted (torch itself included):
``fxsplit``: peak RssAnon <= model bytes + largest tensor + 400 MiB;
``fxsplit-offload``: peak RssAnon <= resident bytes (the weights the plan keeps
on the devices and in host memory; those stored on disk are not counted) +
largest tensor + 400 MiB. Time: the whole call (trace, plan and load for
fxsplit; load and dispatch for Accelerate), on the same file, and that plus
the first forward: a load that maps the file (Accelerate's, and fxsplit's disk
storage) reads its pages only when they are used, so where the page cache does
not hold the file the first forward pays for the reads.

    python -m benchmarks.checkpoint_load [--size 2GiB] [--dir /tmp] [--out benchmarks/CHECKPOINT_RESULTS.md]

Exits 1 when a bar fails. The checkpoint is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
BLOCKS = 16
SHARDS = 4
DEVICES = [f"cpu:{i}" for i in range(4)]
MARGIN = 400 * 2**20
TOOLS = ("fxsplit", "accelerate", "fxsplit-offload", "accelerate-offload")
WHAT = (
    "A sharded safetensors checkpoint (4 shards and model.safetensors.index.json) of 16 MLP blocks in float32, "
    "loaded in a fresh process by each tool. *fxsplit* builds the model on meta and calls "
    "`fxsplit.fxsplit(model, budgets, trace='fx', mode='weights', checkpoint=dir)` over cpu:0..cpu:3 (4 blocks "
    "each; the time includes tracing and planning); *accelerate* builds it under `init_empty_weights()` and calls "
    "`load_checkpoint_and_dispatch(model, dir, device_map={'': 'cpu'})`. With offload: *fxsplit-offload* gives "
    "the 4 devices budgets that add up to half the checkpoint (an eighth each) and `offload={'disk': <checkpoint "
    "size>, 'dir': ...}`: each device keeps resident what fits beside its streaming buffers, the rest is stored on "
    "disk; *accelerate-offload* calls `load_checkpoint_and_dispatch(model, dir, device_map=<blocks 0-7: 'cpu', "
    "8-15: 'disk'>, offload_folder=...)` (half the checkpoint in memory). "
    "*resident / on disk*: weights kept in memory (devices and host) and stored on "
    "disk. *load s*: the call (for fxsplit tracing and planning included); *load + first forward s*: that and "
    "one forward of 2 rows, which reads whatever a memory map has not read yet (Accelerate's load maps the "
    "file and reads a page when it is first used). "
    "*peak RssAnon* is the process's anonymous memory (torch included), sampled every millisecond during "
    "the call; *before load* is it just before. Every tool's loaded weights are checked against the checkpoint's "
    "checksum, and each runs one forward on the same input (*output agrees*: its sum equals the first tool's to "
    "1e-5). Bars (fxsplit): peak RssAnon <= resident bytes + largest tensor + 400 MiB, resident being the whole "
    "model without offload (the weights stored on disk are not counted)."
)


class Stack(nn.Module):
    """``blocks`` MLP blocks ``width -> 4*width -> width``: ``2 * blocks`` weights of ``4*width**2`` elements."""

    def __init__(self, width: int, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def width_for(nbytes: int) -> int:
    """The width (a multiple of 64) whose float32 stack is about ``nbytes``."""
    return max(64, 64 * round(math.sqrt(nbytes / (2 * BLOCKS * 4 * 4)) / 64))


def _random(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Random weights scaled by 1/sqrt(fan-in), so that a forward through every block stays finite."""
    return torch.randn(shape, generator=generator).div_(math.sqrt(shape[-1]))


def write_checkpoint(directory: Path, nbytes: int) -> dict[str, Any]:
    """A sharded safetensors checkpoint of a random :class:`Stack` (``SHARDS`` shards) and its description."""
    from safetensors.torch import save_file

    width = width_for(nbytes)
    with torch.device("meta"):
        names = list(Stack(width).state_dict().items())
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    checksum, total, largest = 0.0, 0, 0
    per_shard = BLOCKS // SHARDS
    for index in range(SHARDS):
        shard = f"model-{index + 1:05d}-of-{SHARDS:05d}.safetensors"
        mine = {f"blocks.{b}." for b in range(index * per_shard, (index + 1) * per_shard)}
        tensors = {n: _random(t.shape, generator) for n, t in names if n[: n.index(".", 7) + 1] in mine}
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
        "blocks": BLOCKS,
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


def offload_budget(checkpoint: dict[str, Any]) -> int:
    """Each device's budget for ``fxsplit-offload``: an eighth of the checkpoint, so that the 4 budgets add up to
    half of it (with 2% slack); fxsplit keeps resident what fits beside its streaming buffers."""
    return math.ceil(checkpoint["model_bytes"] / (2 * len(DEVICES)) * 1.02)


def _hooked_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every weight of an Accelerate-dispatched model: offloaded ones (on meta) read through the module's hook."""
    tensors = []
    for name, tensor in model.state_dict().items():
        if tensor.device.type == "meta":
            owner, _, leaf = name.rpartition(".")
            tensor = model.get_submodule(owner)._hf_hook.weights_map[leaf]  # type: ignore[union-attr, index]
        tensors.append(tensor)
    return tensors


def _child(tool: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Load the checkpoint with ``tool`` in this process; what it cost."""
    torch.set_num_threads(1)
    width, blocks, total = checkpoint["width"], checkpoint.get("blocks", BLOCKS), checkpoint["model_bytes"]
    scratch = Path(tempfile.mkdtemp(prefix="fxsplit-ckpt-offload-", dir=Path(checkpoint["dir"]).parent))
    resident, on_disk = total, 0
    try:
        if tool.startswith("fxsplit"):
            import fxsplit
            from fxsplit.partition.milp import milp_available

            milp_available()  # imports SciPy's solver (about 22 MiB) when installed: a library, counted as fxsplit is

            with torch.device("meta"):
                model = Stack(width, blocks).eval()
            options: dict[str, Any] = {}
            if tool == "fxsplit-offload":
                budgets = {d: offload_budget(checkpoint) for d in DEVICES}
                options["offload"] = {"disk": total, "dir": str(scratch)}
            else:
                budgets = {d: math.ceil(total / len(DEVICES) * 1.05) for d in DEVICES}
            baseline = _rss_anon()
            with PeakSampler() as sampler:
                start = time.perf_counter()
                model = fxsplit.fxsplit(
                    model, budgets, trace="fx", mode="weights", checkpoint=checkpoint["dir"], progress=False, **options
                )
                seconds = time.perf_counter() - start
            plan = model.meta["fxsplit_plan"]
            devices = sorted(set(plan.param_devices.values()))
            on_disk = plan.stored_bytes.get("disk", 0)
            resident = total - on_disk
        else:
            from accelerate import init_empty_weights, load_checkpoint_and_dispatch

            with init_empty_weights():
                model = Stack(width, blocks).eval()
            device_map: dict[str, str] = {"": "cpu"}
            extra: dict[str, Any] = {}
            if tool == "accelerate-offload":
                device_map = {f"blocks.{b}": "cpu" if b < blocks // 2 else "disk" for b in range(blocks)}
                extra["offload_folder"] = str(scratch)
            baseline = _rss_anon()
            with PeakSampler() as sampler:
                start = time.perf_counter()
                model = load_checkpoint_and_dispatch(model, checkpoint["dir"], device_map=device_map, **extra)
                seconds = time.perf_counter() - start
            devices = sorted(set(device_map.values()))
            if tool == "accelerate-offload":
                named = dict(model.named_parameters())
                on_disk = sum(
                    named[n].numel() * named[n].element_size() for n in named if int(n.split(".")[1]) >= blocks // 2
                )
                resident = total - on_disk
        x = torch.randn(2, width, generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        with torch.no_grad():  # before the checksum, which would read every page of a lazily mapped file
            output = float(model(x).double().sum())
        forward_seconds = time.perf_counter() - start
        tensors = list(model.state_dict().values()) if tool.startswith("fxsplit") else _hooked_tensors(model)
        checksum = sum(float(t.double().sum()) for t in tensors)
        del tensors
        if not math.isclose(checksum, checkpoint["checksum"], rel_tol=1e-9, abs_tol=1e-3):
            raise SystemExit(f"{tool}: loaded weights sum to {checksum}, the checkpoint's to {checkpoint['checksum']}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "tool": tool,
        "seconds": seconds,
        "peak_anon": sampler.peak,
        "baseline_anon": baseline,
        "devices": devices,
        "resident_bytes": resident,
        "disk_bytes": on_disk,
        "output_sum": output,
        "forward_seconds": forward_seconds,
    }


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
    bar = result["resident_bytes"] + checkpoint["largest"] + MARGIN
    return {**result, **{k: checkpoint[k] for k in ("model_bytes", "largest", "tensors")}, "bar": bar}


def measure_fxsplit(checkpoint: dict[str, Any], *, offload: bool = False) -> dict[str, Any]:
    """fxsplit's numbers for ``checkpoint`` (for the tests that run a small one)."""
    return measure("fxsplit-offload" if offload else "fxsplit", checkpoint)


def passes(result: dict[str, Any]) -> bool | None:
    """Whether ``result`` meets its bar (None for Accelerate, which has none)."""
    return result["peak_anon"] <= result["bar"] if result["tool"].startswith("fxsplit") else None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f}"


def report(results: list[dict[str, Any]], out: TextIO) -> None:
    """The results as a Markdown table."""
    out.write(
        "| tool | checkpoint MiB | tensors | largest MiB | devices | resident / on disk MiB "
        "| resident weights end up in | peak RssAnon MiB | before load MiB | bar MiB | bar | load s "
        "| load + first forward s | output agrees |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    first = results[0]["output_sum"] if results else 0.0
    for r in results:
        verdict = {True: "ok", False: "FAIL", None: "info"}[passes(r)]
        grew = r["peak_anon"] - r["baseline_anon"] >= r["resident_bytes"] // 2
        held = "own memory" if grew else "views of the mapped file"
        agrees = "yes" if math.isclose(r["output_sum"], first, rel_tol=1e-5, abs_tol=1e-3) else "NO"
        out.write(
            f"| {r['tool']} | {_mib(r['model_bytes'])} | {r['tensors']} | {_mib(r['largest'])} | "
            f"{', '.join(r['devices'])} | {_mib(r['resident_bytes'])} / {_mib(r['disk_bytes'])} | {held} | "
            f"{_mib(r['peak_anon'])} | {_mib(r['baseline_anon'])} | {_mib(r['bar'])} | {verdict} | "
            f"{r['seconds']:.2f} | {r['seconds'] + r['forward_seconds']:.2f} | {agrees} |\n"
        )
    out.write(
        "\n*resident weights end up in*: read from the measurement (anonymous memory grew by at least half the "
        "resident bytes or not). Views of the mapped file cost no copy, but live in the page cache (read from "
        "disk again when evicted; the checkpoint file must not be rewritten while they are in use); fxsplit "
        "copies each resident tensor once into memory of its own on its planned device, as it must for a GPU. "
        "Weights on disk: fxsplit's are views of the checkpoint's own file (a safetensors tensor already in the "
        "planned dtype is not copied); Accelerate writes its offloaded weights again, as .dat files in "
        "offload_folder.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2GiB", help="checkpoint size (default 2GiB)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write the checkpoint")
    parser.add_argument("--out", default=str(HERE / "CHECKPOINT_RESULTS.md"))
    parser.add_argument("--no-accelerate", action="store_true", help="measure fxsplit only")
    parser.add_argument("--no-offload", action="store_true", help="leave out the offload variants")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, json.loads(args.checkpoint))))
        return 0
    from benchmarks.measure import load_average
    from fxsplit.units import parse_size

    load = [load_average()[0]]
    directory = Path(tempfile.mkdtemp(prefix="fxsplit-ckpt-", dir=args.dir))
    try:
        checkpoint = write_checkpoint(directory, parse_size(args.size))
        tools = [
            t
            for t in TOOLS
            if not (args.no_accelerate and t.startswith("accelerate")) and not (args.no_offload and "offload" in t)
        ]
        results = [measure(tool, checkpoint) for tool in tools]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    load.append(load_average()[0])
    with open(args.out, "w") as out:
        out.write(
            f"# Loading a checkpoint onto a split\n\nWritten by `python -m benchmarks.checkpoint_load --size "
            f"{args.size}` (torch {torch.__version__}, {platform.machine()}, 1 torch thread; 1-minute load average "
            f"{load[0]:.2f} at the start, {load[1]:.2f} at the end, on {os.cpu_count()} cores). {WHAT}\n\n"
        )
        report(results, out)
    report(results, sys.stdout)
    failed = [r for r in results if passes(r) is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
