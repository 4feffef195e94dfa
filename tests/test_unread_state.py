"""A split holds the model's tensors that no op reads: its state_dict is the model's (fxsplit.codegen.unreadstate).

Found by an outside fuzz: an unused submodule, a buffer the forward never
touches and an ``eval()`` BatchNorm's ``num_batches_tracked`` under export were
placed by the plan but missing from ``gm.state_dict()``, so the README's strict
round trip failed.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import fxsplit
from fxsplit.codegen.unreadstate import hold_unread
from fxsplit.codegen.weights import move_weights
from fxsplit.planning.apply import checked_retrace

BUDGETS = {"cpu:0": 1 << 20, "cpu:1": 1 << 20}


class Idle(torch.nn.Module):
    """Reads ``a`` and ``b``; never ``spare`` (a submodule), ``idle`` (a buffer), ``scratch`` (non-persistent) nor
    the tied pair ``tied_a`` / ``tied_b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.spare = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
        self.register_buffer("idle", torch.arange(3.0))
        self.register_buffer("scratch", torch.ones(2), persistent=False)
        self.tied_a = torch.nn.Linear(4, 4, bias=False)
        self.tied_b = torch.nn.Linear(4, 4, bias=False)
        self.tied_b.weight = self.tied_a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _split(model: torch.nn.Module, trace: str) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxsplit.fxsplit(model, BUDGETS, example_inputs=(torch.randn(2, 8),), trace=trace)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_the_state_dict_is_the_models_and_loads_strictly_both_ways(trace: str) -> None:
    model = Idle().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8)
    gm = _split(model, trace)
    state = gm.state_dict()
    assert sorted(state) == sorted(model.state_dict())  # scratch is non-persistent in both
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name].cpu(), tensor, rtol=0, atol=0)
    fresh = Idle()
    fresh.load_state_dict(state)  # strict
    gm.load_state_dict(reference.state_dict())  # strict, the other way
    torch.testing.assert_close(gm(x).cpu(), reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_the_split_shares_the_models_unread_tensors(trace: str) -> None:
    model = Idle().eval()
    gm = _split(model, trace)
    assert gm.get_parameter("spare.0.weight") is model.spare[0].weight
    assert gm.get_buffer("spare.1.running_mean") is model.spare[1].running_mean
    assert gm.get_buffer("idle") is model.idle
    assert gm.get_buffer("scratch") is model.scratch
    assert gm.get_parameter("tied_a.weight") is gm.get_parameter("tied_b.weight") is model.tied_a.weight
    names = {name for name, _ in gm.named_parameters()}
    assert {"spare.0.weight", "tied_a.weight"} <= names  # an optimizer over gm.parameters() sees what model's does


def test_an_eval_batchnorm_keeps_num_batches_tracked_under_export() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8)).eval()
    gm = _split(model, "export")
    assert "1.num_batches_tracked" in gm.state_dict()
    gm.load_state_dict(model.state_dict())  # strict
    type(model)(*[copy.deepcopy(m) for m in model]).load_state_dict(gm.state_dict())


def test_apply_holds_them_too() -> None:
    model = Idle().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = fxsplit.plan(model, BUDGETS, example_inputs=(torch.randn(2, 8),), trace="fx")
        gm = fxsplit.apply(model, plan, example_inputs=(torch.randn(2, 8),))
    assert sorted(gm.state_dict()) == sorted(model.state_dict())


def test_unread_tensors_are_moved_to_their_planned_device() -> None:
    model = Idle().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = fxsplit.plan(model, BUDGETS, example_inputs=(torch.randn(2, 8),), trace="fx")
        traced, costs, _, _ = checked_retrace(model, plan, example_inputs=(torch.randn(2, 8),))
    unread = {name for weight in costs.unused for name in weight.names}
    assert {"spare.0.weight", "idle", "tied_a.weight"} <= unread
    without = move_weights(traced.graph_module, plan, costs.weights + costs.unused)
    moved_without = len(without)
    without.undo()
    with_model = move_weights(traced.graph_module, plan, costs.weights + costs.unused, model)
    moved_with = len(with_model)
    with_model.undo()
    assert moved_with - moved_without == len(costs.unused)  # each unread tensor found in the model, and moved


def test_a_split_with_them_pickles_and_copies() -> None:
    model = Idle().eval()
    del model.scratch  # a root-level non-persistent buffer: below (torch's pickling of a graph module forgets it)
    model.spare.register_buffer("scratch", torch.ones(2), persistent=False)
    gm = _split(model, "fx")
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(gm)
    for other in (loaded, copied):
        assert sorted(other.state_dict()) == sorted(model.state_dict())
        x = torch.randn(2, 8)
        torch.testing.assert_close(other(x).cpu(), model(x), rtol=0, atol=0)


def test_hold_unread_adds_nothing_to_a_users_module() -> None:
    inner = torch.nn.Linear(8, 8)
    model = torch.nn.Module()
    model.inner = inner
    split = torch.nn.Module()
    split.inner = torch.nn.Linear(8, 8)  # a module that is not a plain container: not the split's to add to
    model.inner.register_buffer("extra", torch.ones(1))
    assert hold_unread(split, model) == []
    assert "extra" not in split.inner._buffers
    assert hold_unread(torch.nn.Module(), model) == ["inner.weight", "inner.bias", "inner.extra"]


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_copied_split_keeps_the_models_non_persistent_buffers_out_of_its_state_dict(trace: str) -> None:
    """torch's deep copy of a graph module rebuilds it without its own non-persistent set: the copy's state dict
    had the model's root-level non-persistent buffer, and did not load strictly into the model."""
    model = Idle().eval()
    copied = copy.deepcopy(_split(model, trace))
    assert "scratch" not in copied.state_dict()
    Idle().load_state_dict(copied.state_dict())  # strict


class MakesAConstant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * torch.tensor([2.0]))  # torch.export lifts it: a buffer `lifted_tensor_0`


def test_a_constant_the_trace_lifted_is_not_in_the_state_dict() -> None:
    """Found by an outside check on Falcon: export's lifted constants were in the split's state_dict, which then
    loaded strictly neither into the model nor from it."""
    model = MakesAConstant()
    gm = _split(model, "export")
    assert any(name.startswith("lifted_tensor") for name, _ in gm.named_buffers())  # the split still holds it
    assert sorted(gm.state_dict()) == sorted(model.state_dict())
    MakesAConstant().load_state_dict(gm.state_dict())  # strict
    gm.load_state_dict(model.state_dict())  # strict
    x = torch.randn(2, 8)
    torch.testing.assert_close(gm(x).cpu(), model(x), rtol=0, atol=0)
