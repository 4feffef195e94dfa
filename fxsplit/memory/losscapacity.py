"""Loss kernels whose scalar result keeps an input-sized storage, which torch's fake kernels leave out.

ATen's ``mse_loss`` and ``smooth_l1_loss`` compute the elementwise loss in their output and then resize it to a
scalar (their shared meta function ends in ``resize_({})``, on every backend); on the CPU,
``binary_cross_entropy`` and ``soft_margin_loss`` do the same. ``resize_`` keeps the storage, so the loss, a
scalar, holds as many bytes as its input for as long as it lives: in training, through the whole backward. Their
fake kernels return a scalar of its own size. A model returning ``F.mse_loss(prediction, target)`` over a
64 x 64 prediction was planned 16 KiB short of what the CPU held (0.93 of it).

:func:`with_capacity` gives such a result the storage the real kernel leaves it. Which ops do this is measured,
not assumed: ``tests/test_loss_capacity.py`` runs every loss and reduction of ``torch.nn.functional`` on real
CPU tensors and checks that exactly these keep more than their result.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["CAPACITY_OPS", "with_capacity"]

_NONE = 0  # ATen's Reduction::None
_REDUCTION_AT = {  # op -> the position of its reduction argument
    torch.ops.aten.mse_loss.default: 2,
    torch.ops.aten.smooth_l1_loss.default: 2,
    torch.ops.aten.binary_cross_entropy.default: 3,
    torch.ops.aten.soft_margin_loss.default: 2,
}
CAPACITY_OPS = frozenset(_REDUCTION_AT)
"""The ops whose reduced (scalar) result keeps the storage of the elementwise loss."""


def with_capacity(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    """``out`` of ``func(*args, **kwargs)`` (an op of :data:`CAPACITY_OPS`, on fake tensors) holding a storage as
    large as the real kernel leaves it; ``out`` unchanged when the op does not reduce (``reduction="none"``) or
    computes no elementwise loss (``smooth_l1_loss`` with ``beta=0`` is ``l1_loss``)."""
    at = _REDUCTION_AT[func]
    reduction = args[at] if len(args) > at else kwargs.get("reduction", 1)
    if func is torch.ops.aten.smooth_l1_loss.default:
        beta = args[3] if len(args) > 3 else kwargs.get("beta", 1.0)
        if beta == 0:
            return out
    if reduction == _NONE or not isinstance(out, torch.Tensor) or out.dim() != 0:
        return out
    shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
    nbytes = math.prod(shape) * out.element_size()
    if nbytes <= out.untyped_storage().nbytes():
        return out
    made = torch.empty(math.prod(shape), dtype=out.dtype, device=out.device)
    return made.resize_(())
