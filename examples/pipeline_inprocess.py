"""Pipelined model parallelism in one process: micro-batches flow through the stages.

    python examples/pipeline_inprocess.py

Splits a small MLP over three devices (``cpu:0``..``cpu:2`` here; ``cuda:0``..``cuda:2`` on a
machine with three GPUs: pass ``--cuda``), cuts each batch into 4 micro-batches and runs them on
GPipe's clock (stage s works on micro-batch t - s at tick t). Prints the plan, each stage's code
and a training loop's losses next to those of the unsplit model, which they match.
"""

from __future__ import annotations

import copy
import sys

import torch

import fxsplit


def main() -> None:
    kind = "cuda" if "--cuda" in sys.argv else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())])
    reference = copy.deepcopy(model).to(f"{kind}:0")
    x, y = torch.randn(32, 64), torch.randn(32, 64)

    pipe = fxsplit.fxsplit(
        model,
        {f"{kind}:0": "40KiB", f"{kind}:1": "40KiB", f"{kind}:2": "40KiB"},
        example_inputs=(x,),
        pipeline=fxsplit.PipelineConfig(chunks=4, checkpoint="except_last"),
    )
    print(pipe.meta["fxsplit_plan"])
    print(pipe.code)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(pipe(x), y.to(pipe.meta["fxsplit_plan"].output_device))
        loss.backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        ref_loss = torch.nn.functional.mse_loss(reference(x.to(f"{kind}:0")), y.to(f"{kind}:0"))
        ref_loss.backward()
        ref_optimizer.step()
        print(f"step {step}: pipelined loss {loss.item():.6f}   unsplit loss {ref_loss.item():.6f}")


if __name__ == "__main__":
    main()
