"""The model from the manual model-parallel tutorials, split over two devices automatically.

PyTorch's tutorial places ``net1`` on ``cuda:0`` and ``net2`` on ``cuda:1`` by
hand (``.to("cuda:0")`` in ``__init__``, ``x.to("cuda:1")`` in ``forward``).
Here the model has no device code at all: fxsplit reads the budgets, decides
where each layer goes, and generates the forward with the copy in it.

Runs on two GPUs when two are visible, else on two logical CPU devices
("cpu:0", "cpu:1"), where every op is checked not to mix devices, as it could
not on real GPUs.

    python examples/three_layer.py
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import fxsplit
from fxsplit.check import DeviceChecker, verify_split


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def main() -> None:
    torch.manual_seed(0)
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    devices = ("cuda:0", "cuda:1") if gpus else ("cpu:0", "cpu:1")
    model = ToyModel()
    reference = copy.deepcopy(model)  # the unsplit model, to compare with
    x = torch.randn(20, 10)

    # net1 holds 440 bytes of weights, net2 220, and a forward on this batch needs up to 1.56 KiB of
    # activations besides (counted by default, mode="inference"): 2.21 KiB on one device, so with
    # 2 KiB each neither device may hold both layers.
    budgets = {devices[0]: "2KiB", devices[1]: "2KiB"}
    gm = fxsplit.fxsplit(model, budgets, example_inputs=(x,), trace="fx")
    plan = gm.meta["fxsplit_plan"]
    print(plan)
    print(gm.code)
    verify_split(gm)

    if gpus:
        out = gm(x)
    else:
        with DeviceChecker(plan, gm):  # fails if an op mixes cpu:0 and cpu:1
            out = gm(x)
    expected = reference(x)
    torch.testing.assert_close(out.cpu(), expected)
    out.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad, msg=lambda m, n=name: f"grad of {n}: {m}")
    print(
        f"net1 on {plan.param_devices['net1.weight']}, net2 on {plan.param_devices['net2.weight']}; "
        f"output on {plan.output_device}"
    )
    print("outputs and gradients match the unsplit model")


if __name__ == "__main__":
    main()
