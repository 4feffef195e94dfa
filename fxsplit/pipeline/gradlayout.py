"""The gradients a stage run in its own process hands back: contiguous, as ``torch.distributed.pipelining`` needs."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["contiguous_grad", "may_be_floating"]


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def contiguous_grad(value: torch.Tensor) -> torch.Tensor:
    """``value``, whose gradient is made contiguous: a stage run in its own process hands the gradients of its inputs
    back to the stage before it, and ``torch.distributed.pipelining`` receives each into a buffer laid out like the
    gradient, which gloo refuses when it is not contiguous (a value read through ``cat`` or a slice gets a strided
    gradient: the row pieces of a split op, :mod:`fxsplit.tracing.rowsplit`)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    return _ContiguousGrad.apply(value)  # type: ignore[no-any-return]


def may_be_floating(node: torch.fx.Node) -> bool:
    """Whether the value of ``node`` may be a floating tensor (not known: it may)."""
    value = node.meta.get("val", node.meta.get("tensor_meta"))
    dtype = getattr(value, "dtype", None)
    return value is None or (dtype is not None and dtype.is_floating_point)
