"""A torch.fx split whose trace read ``self.training`` refuses a mode switch that would change nothing.

torch.fx keeps the value each read of a module's ``training`` found (``F.dropout(x, p, self.training)``,
``if self.training:``). Before, ``split.eval()`` of a split traced in training mode silently kept dropout on and
batch statistics in use; torch.export splits already refused. Reads whose value changes nothing (stochastic
depth of probability 0) leave the split free to switch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxsplit
from fxsplit.errors import FxsplitError

BUDGETS = {"cpu:0": 2000, "cpu:1": 2000}
X = torch.randn(8, 16)


class Functional(nn.Module):
    """Dropout and batch norm as functions of ``self.training``, as most model code writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.a(x), 0.5, self.training)
        bn = self.bn
        return F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, self.training)


class Branch(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.p == 0 or not self.training:  # timm's DropPath
            return h
        return h * (torch.rand_like(h[:, :1]) > self.p) / (1 - self.p)


def model(kind: type[nn.Module] = Functional, *args: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(kind(*args), kind(*args), nn.Linear(16, 4))


def _split(m: nn.Module, **options: object) -> torch.fx.GraphModule:
    split = fxsplit.fxsplit(m, BUDGETS, example_inputs=(X,), trace="fx", mode="weights", **options)
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2
    return split


@pytest.mark.parametrize("traced_in", ["train", "eval"])
def test_switching_a_split_whose_trace_fixed_the_mode_raises_and_says_what_to_do(traced_in: str) -> None:
    m = getattr(model(), traced_in)()
    split = _split(m)
    wanted = "eval" if traced_in == "train" else "train"
    with pytest.raises(FxsplitError, match=rf"read self.training of '0', '1'.* {wanted}\(\) cannot change") as error:
        getattr(split, wanted)()
    assert f"call model.{wanted}() before fxsplit" in str(error.value) and "leaf_modules=['0', '1']" in str(error.value)
    assert split.training == (traced_in == "train")  # nothing switched
    getattr(split, traced_in)()  # the mode it was traced in: fine


def test_a_read_that_changes_nothing_leaves_the_split_free_to_switch() -> None:
    m = model(Branch, 0.0).train()
    split = _split(m)
    split.eval()
    torch.testing.assert_close(split(X), model(Branch, 0.0).eval()(X), rtol=0, atol=0)
    with pytest.raises(FxsplitError, match="read self.training of '0', '1'"):
        _split(model(Branch, 0.5).train()).eval()


def test_leaf_modules_read_their_mode_when_called_and_switch() -> None:
    split = _split(model().train(), leaf_modules=[Functional])
    split.eval()
    torch.testing.assert_close(split(X), model().eval()(X), rtol=0, atol=0)


def test_a_pipeline_of_such_a_split_refuses_too() -> None:
    pipeline = _split(model().train(), pipeline=fxsplit.PipelineConfig(chunks=2))
    with pytest.raises(FxsplitError, match="read self.training"):
        pipeline.eval()


def test_tracing_leaves_the_model_and_torch_as_they_were() -> None:
    m = model().train()
    m[1].eval()
    modes = [module.training for module in m.modules()]
    _split(m)
    assert [module.training for module in m.modules()] == modes
    assert "training" not in nn.Module.__dict__
    m.eval()
    assert not any(module.training for module in m.modules())
