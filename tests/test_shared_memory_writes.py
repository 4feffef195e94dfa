"""Model tensors that share memory, one written in place, are refused; views that do not meet are split
(fxsplit/cost/sharedwrites.py).

Before, two buffers over one storage (``mask`` and ``head = mask[:2]``) were each held by the split as a tensor of
its own: ``forward``'s write to ``mask`` no longer reached ``head``, and the split's outputs differed from the
model's from the first call (by 3.5 here), with no word, under both tracers.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import TraceError

BUDGETS = {"cpu:0": 100_000, "cpu:1": 100_000}
X = torch.randn(2, 4)


class Overlapping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        mask = torch.zeros(4)
        self.register_buffer("mask", mask)
        self.register_buffer("head", mask[:2])  # a view of mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        self.mask.mul_(0.5).add_(y.detach().sum(0))
        return y * self.mask + (y[:, :2] * self.head).sum()


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_written_buffer_another_buffer_views_is_refused(trace: str) -> None:
    model = Overlapping()
    mask = model.mask
    with pytest.raises(TraceError, match=r"forward writes 'mask' in place, and 'head' shares its memory"):
        fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace, mode="weights")
    assert model.mask is mask and not mask.any() and model.head._base is mask  # as it was


class Cached(nn.Module):
    """One cache tensor, each layer writing its own view of it: views that do not meet (one interleaved)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        cache = torch.zeros(2, 3, 2, 4)  # layer, position, key/value, feature
        self.register_buffer("keys_0", cache[0, :, 0])  # keys and values of a layer interleave in memory
        self.register_buffer("values_0", cache[0, :, 1])
        self.register_buffer("keys_1", cache[1, :, 0])
        self.register_buffer("values_1", cache[1, :, 1])

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            keys, values = getattr(self, f"keys_{i}"), getattr(self, f"values_{i}")
            keys.index_copy_(0, position, x[:1].detach())
            values.index_copy_(0, position, x[1:].detach() * 2)
            x = x + keys.sum(0) - values.mean(0)
        return x


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_views_of_one_cache_that_do_not_meet_are_split_and_written_as_in_the_model(trace: str) -> None:
    torch.manual_seed(0)
    model = Cached()
    twin = copy.deepcopy(model)
    total = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    split = fxsplit.fxsplit(
        model, {"cpu:0": total, "cpu:1": total}, example_inputs=(X, torch.tensor([0])), trace=trace, mode="weights"
    )
    for step in range(3):
        x, position = torch.randn(2, 4), torch.tensor([step])
        assert torch.equal(split(x, position), twin(x, position))


class Viewed(nn.Module):
    """A tensor made in forward and a view of it, each kept by torch.fx as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        mask = torch.zeros(4)
        head = mask[:2]
        mask[y.sum(0).argmax()] = 1.0
        return y * mask + (y[:, :2] * head).sum()


def test_fx_constants_that_are_views_of_one_another_one_written_are_refused() -> None:
    with pytest.raises(TraceError, match=r"forward writes '_tensor_constant0' in place"):
        fxsplit.fxsplit(Viewed(), BUDGETS, trace="fx", mode="weights")
