"""torchrun worker for tests/test_distributed.py: train with fxsplit.pipeline_stages, save losses and weights.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port PORT tests/pipeline_worker.py OUT_DIR

Each case trains a few SGD steps with a torch.distributed.pipelining schedule
and saves, per rank, the losses (last rank) and the stage's parameters. One
more (``memory``) measures the bytes each rank holds over an Adam training
step of a tied language model, beside the plan's memory row for its device.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

import fxsplit

sys.path.insert(0, str(Path(__file__).parent))
from helpers import LiveBytes  # noqa: E402
from pipeline_models import MLP, LongSkip, Tied, Transposed, budgets  # noqa: E402

CHUNKS, STEPS, LR = 4, 3, 0.1
CASES = [
    ("MLP", "gpipe"),
    ("MLP", "1f1b"),
    ("LongSkip", "1f1b"),
    ("Tied", "gpipe"),
    ("TiedWide", "1f1b"),
    ("Transposed", "1f1b"),
]
MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "MLP": MLP,
    "LongSkip": LongSkip,
    "Tied": Tied,
    "Transposed": Transposed,
    "TiedWide": lambda: Tied(vocab=WIDE_VOCAB, width=128),  # its head's rows are split over the two ranks
}
WIDE_VOCAB = 4096


def batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same data on every rank and in the single-process reference."""
    gen = torch.Generator().manual_seed(7)
    if name.startswith("Tied"):
        vocab = WIDE_VOCAB if name == "TiedWide" else 24
        return [
            (torch.randint(0, vocab, (8, 5), generator=gen), torch.randint(0, vocab, (8, 5), generator=gen))
            for _ in range(STEPS)
        ]
    if name == "Transposed":
        return [(torch.randn(8, 4, 16, generator=gen), torch.randn(8, 16, 16, generator=gen)) for _ in range(STEPS)]
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)) for _ in range(STEPS)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.dtype == torch.long:
        return torch.nn.functional.cross_entropy(output.flatten(0, -2), target.flatten())
    return torch.nn.functional.mse_loss(output, target)


def make(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def train(name: str, kind: str, rank: int, world: int) -> dict[str, Any]:
    model = make(name)
    data = batches(name)
    pins = getattr(model, "pins", None)  # where a case needs its cut
    stages = fxsplit.pipeline_stages(
        model,
        budgets(model, world, replicas=True),
        mode="weights",
        example_inputs=(data[0][0],),
        chunks=CHUNKS,
        pins=pins,
    )
    stage = stages.build_stage(rank)
    schedule_type = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    schedule = schedule_type(stage, n_microbatches=CHUNKS, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=LR)
    losses: list[float] = []
    for x, y in data:
        optimizer.zero_grad()
        micro: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=micro)
            losses.append(torch.stack(micro).mean().item())
        else:
            schedule.step()
        stages.reduce_tied_grads(rank)
        optimizer.step()
    params = {path: p.detach().clone() for path, p in stage.submod.named_parameters(remove_duplicate=False)}
    rows = {piece.path: (piece.start, piece.stop) for held in stages._rows[rank].values() for piece in held}
    splits = {op: split.bounds for op, split in stages.plan.row_splits.items()}
    return {
        "losses": losses,
        "params": params,
        "tied": stages.tied,
        "stages": len(stages),
        "rows": rows,
        "splits": splits,
    }


MEMORY_PINS = {"embed": "cpu:0", "body.0": "cpu:0", "head": "cpu:1"}  # the tied weight is read on both ranks


def memory(rank: int, world: int) -> dict[str, Any]:
    """Adam training steps under 1F1B of a tied model over two ranks; the second measured.

    ``own``: the bytes of the stage's parameters and buffers (its copy of the tied weight included) and of Adam's
    state, made by the first step; ``step``: the peak of what the second step's schedule and tied-gradient
    all-reduce make (activations, buffers received, gradients, the outputs kept and returned, which the last rank
    holds on to); ``update``: the peak while ``optimizer.step()`` runs (Adam's ``foreach`` step, as on CUDA), with
    what was alive before it (gradients, outputs).
    """
    torch.manual_seed(0)
    model = Tied(vocab=2000, width=64)
    gen = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, 2000, (16, 6), generator=gen) for _ in range(2))
    budgets = {"cpu:0": "16MiB", "cpu:1": "16MiB"}
    adam = {"name": "adam", "foreach": True, "weight_decay": 0.0}  # the optimizer below, as the plan counts it
    options = {"mode": "training", "optimizer": adam, "pins": MEMORY_PINS}
    stages = fxsplit.pipeline_stages(model, budgets, example_inputs=(x,), chunks=CHUNKS, **options)
    stage = stages.build_stage(rank)
    schedule = Schedule1F1B(stage, n_microbatches=CHUNKS, loss_fn=loss_fn)
    optimizer = torch.optim.Adam(stage.submod.parameters(), lr=1e-3, foreach=True)
    peaks = {}
    for measured in (False, True):
        state = [t for entry in optimizer.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
        own = [*{id(t): t for t in [*stage.submod.parameters(), *stage.submod.buffers(), *state]}.values()]
        optimizer.zero_grad()
        with LiveBytes([*own, x, y]) as meter:
            outputs = schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])
            stages.reduce_tied_grads(rank)
            peaks["step"] = meter.peak
            meter.peak = 0
            optimizer.step()
            peaks["update"] = meter.peak
            del outputs
        if measured:
            break
    device = stages.specs[rank].device
    own_bytes = sum(t.numel() * t.element_size() for t in own)
    return {"device": device, "own": own_bytes, **peaks, "row": dict(stages.plan.memory[device])}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results: dict[str, Any] = {f"{name}-{kind}": train(name, kind, rank, world) for name, kind in CASES}
    results["memory"] = memory(rank, world)
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
