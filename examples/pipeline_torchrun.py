"""Pipeline parallelism across processes: fxsplit's stages on torch.distributed.pipelining.

Two processes on this machine, one stage each, gloo backend (CPU):

    torchrun --standalone --nproc-per-node 2 examples/pipeline_torchrun.py

(Add ``--schedule 1f1b`` for ``Schedule1F1B``; with GPUs, ``--cuda`` makes rank i use ``cuda:i``
and the nccl backend.) Every rank builds the same model, and fxsplit cuts it into per-stage
modules under the budgets (one device per rank, in order); rank i runs stage i. The model's code
is not changed. Tied weights (here the input embedding and the output head) are replicated on the
stages that use them, and ``stages.reduce_tied_grads(rank)`` sums their gradients after each step.
Rank 0 feeds the inputs, the last rank computes the loss and prints it.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

import fxsplit


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 128, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.GELU())
            for _ in range(depth)
        )
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        torch.nn.init.normal_(self.embed.weight, std=0.05)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kind = "cuda" if args.cuda else "cpu"
    chunks = 4

    torch.manual_seed(0)  # every rank builds the same model and data
    model = TinyLM()
    inputs = [torch.randint(0, 128, (16, 12)) for _ in range(args.steps)]
    batches = [(ids, (ids + 1) % 128) for ids in inputs]  # learn to predict the next token id

    # Budgets from what the model needs on one device (for training with SGD), shared out
    # with room to spare (each stage that reads the tied weight holds its own copy), yet so that every rank is needed.
    # The loop below takes the losses, not the outputs: return_outputs=False here and in schedule.step, so the last
    # stage keeps no micro-batch's logits and its budget need not hold them.
    # mode="training": a budget holds the gradients, the optimizer's state and what autograd saves, too.
    training = {"mode": "training", "optimizer": "sgd"}
    alone = fxsplit.plan(
        model, {f"{kind}:0": "1GiB"}, example_inputs=(batches[0][0],), pipeline={"chunks": chunks}, **training
    )
    budgets = {f"{kind}:{i}": int(alone.memory[f"{kind}:0"]["total"] / world * 2.2) for i in range(world)}
    stages = fxsplit.pipeline_stages(
        model, budgets, example_inputs=(batches[0][0],), chunks=chunks, return_outputs=False, **training
    )
    if rank == 0:
        print(stages)  # the plan, tied weights as the stages hold them
    stage = stages.build_stage(rank)
    print(f"rank {rank}: stage {rank} on {stages.specs[rank].device}, takes {stages.specs[rank].inputs}")
    schedule = (ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B)(stage, chunks, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=2.0)

    device = stages.specs[rank].device
    for step, (ids, target) in enumerate(batches):
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(ids.to(device), return_outputs=False)
        elif rank == world - 1:
            schedule.step(target=target.to(device), losses=losses, return_outputs=False)
            print(f"step {step}: loss {torch.stack(losses).mean().item():.4f}")
        else:
            schedule.step(return_outputs=False)
        stages.reduce_tied_grads(rank)
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
