"""Helpers the generated code calls at run time (fxsplit.runtime): move, write_back, call_with_weights."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
import torch.fx.immutable_collections as immutable
from torch import nn

from fxsplit.runtime import call_with_weights, move, write_back


class Pair(NamedTuple):
    first: torch.Tensor
    second: object


def test_move_copies_every_tensor_in_nested_containers_and_keeps_their_types() -> None:
    a, b, c = torch.ones(2), torch.zeros(3), torch.arange(4)
    value = {"list": [a, 7], "pair": Pair(b, "text"), "nested": OrderedDict(deep=(c, None))}
    moved = move(value, "meta")
    assert type(moved) is dict and type(moved["list"]) is list and type(moved["nested"]) is OrderedDict
    assert type(moved["pair"]) is Pair and type(moved["nested"]["deep"]) is tuple
    tensors = [moved["list"][0], moved["pair"].first, moved["nested"]["deep"][0]]
    assert [t.device.type for t in tensors] == ["meta"] * 3
    assert [t.shape for t in tensors] == [a.shape, b.shape, c.shape] and tensors[2].dtype == torch.int64
    assert moved["list"][1] == 7 and moved["pair"].second == "text" and moved["nested"]["deep"][1] is None
    assert a.device.type == "cpu"  # the caller's tensors stay where they were


def test_move_passes_non_tensors_through_and_keeps_a_tensor_already_there() -> None:
    marker = object()
    assert move(marker, "cpu") is marker
    x = torch.ones(2)
    assert move(x, "cpu") is x  # Tensor.to returns the tensor itself when nothing changes


def test_write_back_updates_the_callers_tensors_in_place() -> None:
    a, b = torch.zeros(2), torch.zeros(3)
    original = {"a": a, "rest": [b, "label"]}
    write_back(original, {"a": torch.full((2,), 5.0), "rest": [torch.ones(3), "label"]})
    assert original["a"] is a and original["rest"][0] is b
    assert a.tolist() == [5.0, 5.0] and b.tolist() == [1.0, 1.0, 1.0]


def test_write_back_leaves_a_tensor_that_is_its_own_copy_alone() -> None:
    leaf = torch.ones(2, requires_grad=True)  # copy_ into it would raise: a leaf that requires grad
    write_back(leaf, leaf)
    write_back((leaf,), [leaf])
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        write_back(leaf, torch.zeros(2))  # so the case above really skipped the copy


def test_write_back_needs_matching_structures() -> None:
    with pytest.raises(ValueError, match="shorter|longer"):
        write_back([torch.zeros(1), torch.zeros(1)], [torch.ones(1)])


def test_call_with_weights_uses_the_given_weights_and_leaves_the_module_alone() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    weight_before = layer.weight.detach().clone()
    other = torch.randn(2, 3)
    x = torch.randn(4, 3)
    out = call_with_weights(layer, {"weight": other}, (x,), {})
    torch.testing.assert_close(out, x @ other.T + layer.bias)
    assert layer.weight is not other and torch.equal(layer.weight, weight_before)
    torch.testing.assert_close(layer(x), x @ weight_before.T + layer.bias)


def test_call_with_weights_accepts_fx_immutable_containers() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.tensor(2.0))

        def forward(self, x: torch.Tensor, *, shift: torch.Tensor) -> torch.Tensor:
            return x * self.scale + shift

    module = Scaled()
    args = immutable.immutable_list([torch.ones(2)])
    kwargs = immutable.immutable_dict({"shift": torch.ones(2)})
    out = call_with_weights(module, immutable.immutable_dict({"scale": torch.tensor(3.0)}), args, kwargs)
    assert out.tolist() == [4.0, 4.0]
    assert module.scale.item() == 2.0


def test_prefetch_off_cuda_is_a_plain_copy_and_arrive_hands_it_over() -> None:
    from fxsplit.runtime import arrive, prefetch

    weight = torch.arange(6.0).reshape(2, 3)
    copied = prefetch(weight, "cpu:0")
    assert isinstance(copied, torch.Tensor) and torch.equal(copied, weight)
    assert copied.data_ptr() != weight.data_ptr()  # a logical device gets its own copy, as a real one would
    assert arrive(copied) is copied
    assert prefetch(weight, "cpu") is weight  # already there: Tensor.to returns the tensor itself
    moved = prefetch(weight, "meta")
    assert isinstance(moved, torch.Tensor) and moved.device.type == "meta" and moved.shape == weight.shape


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: side-stream prefetch")


@needs_cuda
def test_prefetch_to_cuda_runs_on_a_side_stream_and_arrive_waits_for_it() -> None:
    from fxsplit.runtime import Prefetched, arrive, prefetch

    weight = torch.randn(1024, 1024).pin_memory()
    started = prefetch(weight, "cuda:0")
    assert isinstance(started, Prefetched) and started.tensor.device == torch.device("cuda:0")
    ready = arrive(started)
    torch.testing.assert_close((ready @ ready).cpu(), weight @ weight)  # used on the compute stream after the wait


@needs_cuda
def test_host_stored_weights_are_pinned_where_cuda_exists() -> None:
    import fxsplit

    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    reference = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 256)
    expected = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    expected.load_state_dict(dict(zip(model.state_dict(), reference, strict=True)))
    gm = fxsplit.fxsplit(model, {"cuda:0": "900KiB"}, example_inputs=(x,), offload={"host": "4MiB"})
    plan = gm.meta["fxsplit_plan"]
    assert plan.streamed
    for name in plan.streamed:  # moved in place: the model's parameters are the split's
        tensor = model.get_parameter(name)
        assert tensor.device.type == "cpu" and tensor.is_pinned(), name
    torch.testing.assert_close(gm(x.cuda()).cpu(), expected(x))
