"""Losses whose scalar result keeps an input-sized storage (:mod:`fxsplit.memory.losscapacity`).

Which ops do it is measured here on real CPU tensors, over every loss and reduction of ``torch.nn.functional``:
if torch changes a kernel, the first test names it. The plan then holds what the allocator holds."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import fxsplit
from fxsplit.memory.allocmeter import allocated_peaks
from fxsplit.memory.losscapacity import CAPACITY_OPS, with_capacity

_X, _Y = torch.randn(16, 32), torch.randn(16, 32)
_P, _Q, _SIGN = _X.sigmoid(), _Y.sigmoid(), torch.sign(_Y)
_CLASSES = torch.randint(0, 32, (16,))
_LOSSES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "l1": lambda x: F.l1_loss(x, _Y),
    "mse": lambda x: F.mse_loss(x, _Y),
    "mse_sum": lambda x: F.mse_loss(x, _Y, reduction="sum"),
    "mse_broadcast": lambda x: F.mse_loss(x, _Y[:1].expand(16, 32)),
    "smooth_l1": lambda x: F.smooth_l1_loss(x, _Y),
    "smooth_l1_beta0": lambda x: F.smooth_l1_loss(x, _Y, beta=0.0),
    "huber": lambda x: F.huber_loss(x, _Y),
    "bce": lambda x: F.binary_cross_entropy(x.sigmoid(), _Q),
    "bce_weight": lambda x: F.binary_cross_entropy(x.sigmoid(), _Q, weight=torch.rand(32)),
    "bce_logits": lambda x: F.binary_cross_entropy_with_logits(x, _Q),
    "cross_entropy": lambda x: F.cross_entropy(x, _CLASSES),
    "cross_entropy_soft": lambda x: F.cross_entropy(x, _Q.softmax(-1), label_smoothing=0.1),
    "nll": lambda x: F.nll_loss(x, _CLASSES),
    "kl_div": lambda x: F.kl_div(x, _Y, reduction="batchmean"),
    "soft_margin": lambda x: F.soft_margin_loss(x, _SIGN),
    "multilabel_soft_margin": lambda x: F.multilabel_soft_margin_loss(x, _Q.round()),
    "hinge_embedding": lambda x: F.hinge_embedding_loss(x, _SIGN),
    "margin_ranking": lambda x: F.margin_ranking_loss(x[:, 0], _Y[:, 0], _SIGN[:, 0]),
    "cosine_embedding": lambda x: F.cosine_embedding_loss(x, _Y, _SIGN[:, 0]),
    "poisson_nll": lambda x: F.poisson_nll_loss(x, _Q),
    "gaussian_nll": lambda x: F.gaussian_nll_loss(x, _Y, _Q + 0.1),
    "triplet_margin": lambda x: F.triplet_margin_loss(x, _Y, _Y.flip(0)),
    "multi_margin": lambda x: F.multi_margin_loss(x, _CLASSES),
    "mean": lambda x: x.mean(),
    "norm": lambda x: x.norm(),
}
_KEEPS = {"mse", "mse_sum", "mse_broadcast", "smooth_l1", "bce", "bce_weight", "soft_margin"}


class _LastOp(TorchDispatchMode):
    """The last ATen op run, with its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.last: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.last = (func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(_LOSSES))
def test_the_ops_that_keep_storage_are_the_listed_ones_and_get_the_real_kernels_capacity(name: str) -> None:
    with torch.no_grad():
        real = _LOSSES[name](_X)
    capacity = real.untyped_storage().nbytes()
    assert (capacity > real.numel() * real.element_size()) == (name in _KEEPS), capacity
    if name not in _KEEPS:
        return
    spy = _LastOp()
    with torch.no_grad(), spy:
        _LOSSES[name](_X)
    assert spy.last is not None
    func, args, kwargs = spy.last
    assert func in CAPACITY_OPS
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        fake_args = tuple(fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        out = func(*fake_args, **kwargs)
        assert out.untyped_storage().nbytes() < capacity  # what the fake kernel leaves out
        made = with_capacity(func, fake_args, kwargs, out)
    assert made.shape == real.shape and made.dtype == real.dtype
    assert made.untyped_storage().nbytes() == capacity


class _Regression(nn.Module):
    def __init__(self, loss: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32))
        self.loss = loss

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prediction = self.net(x)
        return self.loss(prediction), prediction  # the loss and what it was computed from, as HF models return


@pytest.mark.parametrize("name", ["mse", "smooth_l1", "soft_margin", "bce", "smooth_l1_beta0", "huber"])
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_model_returning_its_loss_is_planned_with_the_losss_storage(name: str, devices: int, trace: str) -> None:
    torch.manual_seed(0)
    model, x = _Regression(_LOSSES[name]), torch.randn(16, 32)
    options = {"example_inputs": (x,), "mode": "training", "optimizer": "sgd", "trace": trace}
    total = fxsplit.plan(model, {"cpu:0": "1GiB"}, **options).memory["cpu:0"]["total"]
    budgets = {f"cpu:{k}": "1GiB" if devices == 1 else int(0.75 * total) for k in range(devices)}
    gm = fxsplit.fxsplit(model, budgets, **options)
    planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
    assert sum(1 for d in planned if planned[d]) == devices
    allocated = allocated_peaks(gm, x, backward=True)
    assert planned == allocated
