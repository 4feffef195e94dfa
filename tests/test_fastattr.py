"""Mirrored registries: weights found at dict speed, and never stale, whatever replaces them."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.codegen.fastattr import Container, MirroredRegistry, mirror_registries

BUDGETS = {"cpu:0": 700, "cpu:1": 700}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.blocks(x)) * self.scale


def split(trace: str = "export") -> tuple[Net, torch.fx.GraphModule, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 8)
    gm = fxsplit.fxsplit(model, BUDGETS, example_inputs=(x,), trace=trace, mode="weights")
    assert len(set(gm.meta["fxsplit_plan"].param_devices.values())) == 2  # really split
    return model, gm, x


def container(gm: torch.fx.GraphModule, index: int) -> nn.Module:
    return getattr(gm.blocks, str(index))  # type: ignore[no-any-return]


@pytest.mark.parametrize("trace", ["export", "fx"])
def test_split_containers_are_mirrored_and_user_modules_are_not(trace: str) -> None:
    model, gm, x = split(trace)
    assert isinstance(gm._parameters, dict) and isinstance(gm._modules, MirroredRegistry)
    assert gm.__dict__["blocks"] is gm._modules["blocks"]
    for module in gm.modules():
        if isinstance(module, Container):
            assert isinstance(module._modules, MirroredRegistry) and isinstance(module._parameters, MirroredRegistry)
        elif module is not gm:
            assert type(module._parameters) is dict  # the user's own modules (fx leaf calls) stay plain
    assert type(model.blocks[0]._parameters) is dict
    registry = gm._modules
    mirror_registries(gm)  # idempotent
    assert gm._modules is registry
    torch.testing.assert_close(gm(x), model(x))
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(gm.state_dict()) == list(model.state_dict())


def test_setattr_new_parameter_is_used_by_the_next_call() -> None:
    model, gm, x = split()
    holder = container(gm, 2)
    new = nn.Parameter(torch.zeros_like(holder.weight))
    holder.weight = new
    assert holder.weight is new and holder.__dict__["weight"] is new
    model.blocks[2].weight = nn.Parameter(torch.zeros(8, 8, device=new.device))
    torch.testing.assert_close(gm(x), model(x))


def test_load_state_dict_assign_is_seen() -> None:
    model, gm, x = split()
    state = {k: torch.full_like(v, 0.1) if v.dim() else v for k, v in gm.state_dict().items()}
    gm.load_state_dict(state, assign=True)
    for name, tensor in state.items():
        owner, _, leaf = name.rpartition(".")
        assert getattr(gm.get_submodule(owner), leaf) is gm.get_submodule(owner)._parameters.get(leaf, tensor)
    model.load_state_dict({k: v.to("cpu") for k, v in state.items()})
    torch.testing.assert_close(gm(x), model(x).to(gm(x).device))


def test_functional_call_swaps_weights_for_one_call_only() -> None:
    model, gm, x = split()
    before = gm(x)
    zeros = {name: torch.zeros_like(p) for name, p in gm.named_parameters()}
    out = torch.func.functional_call(gm, zeros, (x,))
    torch.testing.assert_close(out, torch.zeros_like(out))  # relu(0) * scale
    torch.testing.assert_close(gm(x), before)  # and restored afterwards


def test_conversions_that_make_new_parameters_are_seen() -> None:
    model, gm, x = split()
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        old = container(gm, 0).weight
        gm.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    assert container(gm, 0).weight is not old and container(gm, 0).weight.dtype == torch.float64
    torch.testing.assert_close(gm(x.double()), model.double()(x.double()).to(gm(x.double()).device))


def test_delete_and_register_buffer() -> None:
    _, gm, x = split()
    del gm.scale  # a top-level buffer
    assert "scale" not in gm.__dict__
    with pytest.raises(AttributeError):
        _ = gm.scale
    gm.register_buffer("scale", torch.tensor(3.0))
    assert gm.scale.item() == 3.0 and gm.__dict__["scale"] is gm._buffers["scale"]


def test_replacing_a_container_submodule() -> None:
    _, gm, _ = split()
    fresh = nn.Module()
    gm.blocks = fresh
    assert gm.blocks is fresh and gm.__dict__["blocks"] is fresh


def test_deepcopy_and_pickle_of_a_registry_keep_the_mirror() -> None:
    _, gm, x = split()
    clone = copy.deepcopy(gm)
    torch.testing.assert_close(clone(x), gm(x))
    inner = container(clone, 1)
    inner.bias = nn.Parameter(torch.ones_like(inner.bias))
    assert not torch.equal(clone(x), gm(x))  # the copy has its own weights, and uses them

    for copied in (copy.deepcopy(inner), pickle.loads(pickle.dumps(inner))):
        assert isinstance(copied, Container) and isinstance(copied._parameters, MirroredRegistry)
        assert copied._parameters._view is copied.__dict__
        assert copied.weight is copied._parameters["weight"] and copied.weight is not inner.weight
        copied._parameters["weight"] = nn.Parameter(torch.zeros(8, 8))  # a registry write, as functional_call does
        assert copied.weight is copied._parameters["weight"]
        assert inner.weight is inner._parameters["weight"] and bool(inner.weight.any())
    assert "Container" not in repr(gm) and "(blocks): Module(" in repr(gm)


def test_registry_operations_write_through() -> None:
    view: dict[str, object] = {}
    registry = MirroredRegistry([("a", 1)], view)
    assert view == {"a": 1}
    registry["b"] = 2
    registry.update(c=3)
    registry.setdefault("d", 4)
    assert view == {"a": 1, "b": 2, "c": 3, "d": 4}
    del registry["a"]
    assert registry.pop("b") == 2 and registry.pop("zz", None) is None
    registry.popitem()
    assert view == dict(registry)
    registry.clear()
    assert view == {} and registry == {}


def test_a_whole_fx_split_saves_and_loads() -> None:
    """torch.save pickles the split (its mirrored registries as plain dicts); the loaded copy runs the same."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    x = torch.randn(3, 8)
    gm = fxsplit.fxsplit(model, BUDGETS, example_inputs=(x,), trace="fx", mode="weights")
    assert len(set(gm.meta["fxsplit_plan"].param_devices.values())) == 2
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), gm(x))
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in gm.named_parameters()]
