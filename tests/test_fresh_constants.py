"""A tensor ``forward`` makes afresh at each call, which torch.fx keeps as one constant, is copied at each call
when the graph writes it in place (fxsplit/tracing/freshconstants.py).

Before, ``mask = torch.zeros(4); mask[y.argmax()] = 1.0`` under ``trace="fx"`` wrote one tensor at every call of
the split: from the second call on it still held the ones of earlier calls, and the outputs differed from the
model's (by 0.1-0.2 here) without a word.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import TraceError

BUDGETS = {"cpu:0": 100_000, "cpu:1": 100_000}


def _inputs(n: int) -> list[torch.Tensor]:
    return [torch.randn(2, 4, generator=torch.Generator().manual_seed(seed)) for seed in range(n)]


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        mask = torch.zeros(4)  # no traced input: torch.fx makes it once, for real
        mask[y.sum(0).argmax()] = 1.0
        counts = torch.ones(4)
        counts.add_(y.mean())  # written whole, through a method
        return self.b(y * mask + counts)


@pytest.mark.parametrize("example", [False, True])
def test_a_tensor_made_at_each_call_and_written_in_place_starts_afresh_in_each_call_of_the_split(example: bool) -> None:
    torch.manual_seed(0)
    model = Masked()
    xs = _inputs(6)
    assert len({int(model.a(x).sum(0).argmax()) for x in xs}) > 1  # the mask's one moves between calls
    split = fxsplit.fxsplit(model, BUDGETS, trace="fx", mode="weights", example_inputs=(xs[0],) if example else None)
    assert "clone()" in split.code
    for x in xs:
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = split(x1), model(x2)
        assert torch.equal(out, expected)
        out.sum().backward()
        expected.sum().backward()
        assert torch.equal(x1.grad, x2.grad)
    assert not hasattr(model, "_tensor_constant0")  # the model is as it was


class Accumulating(nn.Module):
    """Adds each call's values to tensors held outside its parameters and buffers, and reads them back."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.total = torch.zeros(4)  # a plain attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        self.total.add_(y.sum(0).detach())
        return self.b(y * self.total.norm())  # torch.fx: norm() reads no traced value, so it runs once, for real


def test_state_outside_the_buffers_that_the_graph_writes_is_refused_under_fx_and_split_under_export() -> None:
    """Before, the fx split computed with the norm of the total when traced (zero): wrong from the first call."""
    torch.manual_seed(0)
    model, twin = Accumulating(), Accumulating()
    twin.load_state_dict(model.state_dict())
    with pytest.raises(TraceError, match=r"forward writes in place total, a tensor the model holds outside"):
        fxsplit.fxsplit(model, BUDGETS, trace="fx", mode="weights")
    assert not model.total.any()
    xs = _inputs(3)
    split = fxsplit.fxsplit(model, BUDGETS, trace="export", mode="weights", example_inputs=(xs[0],))
    for x in xs:  # the split writes the model's own tensor, as the model does
        assert torch.equal(split(x), twin(x))


class Returning(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), torch.zeros(3)


def test_a_tensor_made_at_each_call_and_returned_is_a_new_tensor_at_each_call_of_the_split() -> None:
    """A caller may write what the model returns (``out.div_(t)``): each call of the split returned one tensor."""
    model = Returning()
    split = fxsplit.fxsplit(model, BUDGETS, trace="fx", mode="weights")
    first = split(torch.randn(2, 4))
    first[1].add_(1.0)
    second = split(torch.randn(2, 4))
    assert not second[1].any() and second[1] is not first[1]
