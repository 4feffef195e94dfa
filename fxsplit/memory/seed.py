"""A backward from the outputs as a loss starts one: each output's gradient is held by autograd alone.

``torch.autograd.backward(outputs, [torch.ones_like(o) ...])`` keeps the gradients alive through the whole
backward (the caller's list holds them). A loss's backward makes the gradient of the outputs and hands it
on: it is freed once the op that made the output has used it. :func:`seeds` gives scalars whose backward
does that, so what is measured is what training holds.

>>> import torch
>>> x = torch.ones(3, requires_grad=True)
>>> torch.autograd.backward(seeds([x * 2]))
>>> x.grad
tensor([2., 2., 2.])
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["seeds"]


class _Seed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.like = tensor
        return tensor.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(ctx.like)


def seeds(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One scalar per output (which must need a gradient) whose backward gives it a gradient of ones."""
    return [_Seed.apply(output) for output in outputs]
