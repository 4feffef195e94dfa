"""Model parallel and data parallel together: a split module inside DistributedDataParallel.

Two processes on the gloo backend (``torch.multiprocessing.spawn``), each
owning the same model split over ``cpu:0`` / ``cpu:1`` and wrapped in
``DistributedDataParallel(split, device_ids=None)`` (a multi-device module).
Each trains on its half of every batch; DDP averages the gradients, so both
ranks' gradients and parameters equal single-process training on the full
batch.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fxsplit
from benchmarks.measure import free_port

pytestmark = pytest.mark.slow  # two gloo processes, ~15 s

WORLD, STEPS, BATCH, LR = 2, 3, 8, 0.1
BUDGETS = {"cpu:0": "24KiB", "cpu:1": "24KiB"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.Tanh(),
        nn.LayerNorm(32),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, 16, generator=gen), torch.randn(BATCH, 4, generator=gen)) for _ in range(STEPS)]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = _model()
        data = _data()
        half = BATCH // WORLD
        mine = slice(rank * half, (rank + 1) * half)
        split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(data[0][0][mine],), mode="training", optimizer="sgd")
        plan = split.meta["fxsplit_plan"]
        ddp = DistributedDataParallel(split, device_ids=None)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
        record: dict[str, object] = {"devices": sorted({plan.param_devices[n] for n in plan.param_devices})}
        for step, (x, y) in enumerate(data):
            target = y[mine].to(plan.output_device)
            if step == 0:  # the local gradient, without the all-reduce
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x[mine]), target).backward()
                record["local"] = {n: p.grad.clone() for n, p in model.named_parameters()}
                optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x[mine]), target)
            loss.backward()
            if step == 0:
                record["averaged"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # neither rank tears gloo down while the other still talks to it (an abort, seen once in CI)
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: a rank has aborted there ("terminate called without an active
    # exception", a C++ thread still joinable) after its results were saved, failing a run that was right.
    # Errors above still reach the parent as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _single_process() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Full-batch gradients of the first step, and parameters after every step, on one device."""
    model = copy.deepcopy(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    first: dict[str, torch.Tensor] = {}
    for step, (x, y) in enumerate(_data()):
        nn.functional.mse_loss(model(x), y).backward()
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return first, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_split_module_inside_ddp_averages_gradients_like_full_batch_training(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    full_grads, full_params = _single_process()

    assert all(rank["devices"] == ["cpu:0", "cpu:1"] for rank in ranks)  # each process owns a two-device split
    for name, expected in full_grads.items():
        local = [rank["local"][name] for rank in ranks]
        assert not torch.allclose(local[0], local[1]), name  # the halves differ...
        torch.testing.assert_close((local[0] + local[1]) / 2, expected, msg=name)
        for rank in ranks:  # ...and DDP hands every rank their average: the full-batch gradient
            torch.testing.assert_close(rank["averaged"][name], expected, msg=name)
    for name, expected in full_params.items():
        for rank in ranks:
            torch.testing.assert_close(rank["params"][name], expected, msg=name)
