"""A torch.fx graph that lost outputs to a dict keyed by a traced value is refused (fxsplit/tracing/proxykeys.py).

timm's ``FeatureHookNet`` (``features_only=True`` with hook features: nasnet, pit, xception, ...) collects its
feature maps in forward hooks, in a dict keyed by ``out.device``, and returns ``self._feature_outputs[x.device]``.
torch.fx gives each use of a traced value a new object, so that lookup found nothing: the split returned ``[]``
where the model returns three feature maps, silently (found by the timm sweep). torch.export runs the code on real
values and splits it right.
"""

from __future__ import annotations

import functools
from collections import OrderedDict, defaultdict
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import TraceError
from fxsplit.tracing import trace

BUDGETS = {"cpu:0": "7KiB", "cpu:1": "7KiB"}  # of 10.9 KiB of weights (mode="weights")
X = torch.randn(2, 3, 16, 16, dtype=torch.float64)


class FeatureHookNet(nn.ModuleDict):
    """timm's FeatureHooks, distilled: hooks store each feature map under its device, forward returns them."""

    def __init__(self) -> None:
        super().__init__(
            OrderedDict(
                conv=nn.Conv2d(3, 8, 3, padding=1),
                act=nn.ReLU(),
                block1=nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()),
                block2=nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()),
            )
        )
        self.features: defaultdict[Any, OrderedDict[str, torch.Tensor]] = defaultdict(OrderedDict)
        self.ids = ["act", "block1", "block2"]
        for name in self.ids:
            self[name].register_forward_hook(functools.partial(self.collect, name))

    def collect(self, name: str, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        self.features[out.device][name] = out

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        for module in self.values():
            x = module(x)
        found = self.features[x.device]
        self.features[x.device] = OrderedDict()
        return [found[name] for name in self.ids if name in found]


def _model() -> FeatureHookNet:
    torch.manual_seed(0)
    return FeatureHookNet().double()


def test_an_fx_graph_that_lost_outputs_to_a_dict_keyed_by_a_traced_value_is_refused() -> None:
    model = _model()
    expected = model(X)
    assert len(expected) == 3
    with pytest.raises(TraceError, match=r"returns no tensor where the model returns 3 tensors[\s\S]*collect at"):
        fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="fx", mode="weights")
    assert [torch.equal(a, b) for a, b in zip(model(X), expected, strict=True)] == [True] * 3  # as it was
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="export", mode="weights")
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2
    for got, want in zip(split(X), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class CachedScale(nn.Module):
    """Keys a dict by its input (a cache of a value per tensor): harmless, the graph returns what the model does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = {x: 2.0}
        return self.b(torch.relu(self.a(x)) * seen.get(x, 1.0))


def test_a_traced_value_keyed_harmlessly_is_split_as_before() -> None:
    torch.manual_seed(0)
    model = CachedScale()
    x = torch.randn(4, 16)
    assert trace(model, example_inputs=(x,), mode="fx").proxy_keys  # (the outputs were compared on fakes)
    split = fxsplit.fxsplit(model, {"cpu:0": 2000, "cpu:1": 2000}, example_inputs=(x,), trace="fx")
    torch.testing.assert_close(split(x), model(x), rtol=0, atol=0)
