"""Plans of whole models: where the tensors no op reads go (fxsplit.planning)."""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn
from helpers import split_and_compare


class WithSpare(nn.Module):
    """Four 256-byte layers in a chain and a 512-byte layer that forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(8, 8, bias=False) for _ in range(4)))
        self.spare = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def some_packing_fits(sizes: list[int], budgets: list[int]) -> bool:
    """Brute force: whether the tensors can be spread over the devices at all."""
    for homes in itertools.product(range(len(budgets)), repeat=len(sizes)):
        loads = [0] * len(budgets)
        for size, home in zip(sizes, homes, strict=True):
            loads[home] += size
        if all(load <= budget for load, budget in zip(loads, budgets, strict=True)):
            return True
    return False


def test_tensors_no_op_reads_are_packed_with_the_rest() -> None:
    """Splitting the layers 2 + 2 (the balanced cut) leaves two 288-byte gaps where the 512-byte spare fits
    neither; 1 + 3 with the spare beside the single layer fits. The spare must not be packed last."""
    model = WithSpare()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    budgets = {"cpu:0": 800, "cpu:1": 800}
    assert some_packing_fits(sizes, list(budgets.values()))
    gm = split_and_compare(model, budgets, (torch.randn(3, 8),))
    plan = gm.meta["fxsplit_plan"]
    for device, budget in budgets.items():
        assert plan.device_bytes[device] <= budget
    assert sum(plan.device_bytes.values()) == sum(sizes)
    assert [c.nbytes for c in plan.cuts if c.kind == "activation"] == [3 * 8 * 4]  # still one cut
