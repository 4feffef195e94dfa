"""Accelerate device maps: weights where the map says, ops where they copy least, the split equal to the model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import Tied, Unused, assert_same_grads, assert_same_structure, default_loss

import fxsplit
from fxsplit.check import DeviceChecker, verify_plan, verify_split
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.planning.devicemap import place_ops, read_device_map


class Shared(nn.Module):
    """T5's shape: ``shared`` holds the embedding, but the graph reads it only through the tied ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(40, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(F.embedding(ids, self.head.weight)))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layer(x))


class Straddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.enc = Encoder()
        self.post = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.enc(self.pre(x)))


def split_by_map(model: nn.Module, device_map: dict[str, Any], inputs: tuple[Any, ...], trace: str, **options: Any):
    """Plan from the map, apply, and compare outputs and gradients with an unsplit copy."""
    reference = copy.deepcopy(model)
    plan = fxsplit.from_device_map(model, device_map, example_inputs=inputs, trace=trace, **options)
    assert plan.param_devices == read_device_map(model, device_map, options.get("devices"))
    verify_plan(plan, model=model)
    gm = fxsplit.apply(model, plan, example_inputs=inputs)
    verify_split(gm)
    with DeviceChecker(plan, gm, model):
        out = gm(*inputs)
    expected = reference(*inputs)
    assert_same_structure(out, expected)
    default_loss(out).backward()
    default_loss(expected).backward()
    assert_same_grads(model, reference)
    return plan


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_tied_module_that_runs_no_op(trace: str) -> None:
    torch.manual_seed(0)
    device_map = {"shared": "cpu:0", "head": "cpu:0", "body.0": "cpu:0", "body.2": "cpu:1"}
    plan = split_by_map(Shared(), device_map, (torch.randint(0, 40, (2, 5)),), trace)
    assert plan.param_devices["shared.weight"] == plan.param_devices["head.weight"] == "cpu:0"
    assert plan.devices == ("cpu:0", "cpu:1")


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_tied_language_model(trace: str) -> None:
    torch.manual_seed(0)
    device_map = {"emb": "cpu:0", "body.0": "cpu:0", "body.2": "cpu:1", "body.4": "cpu:1", "head": "cpu:0"}
    plan = split_by_map(Tied(), device_map, (torch.randint(0, 40, (2, 5)),), trace)
    assert not [c for c in plan.cuts if c.kind == "parameter"]  # the head runs beside the embedding it reads


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_module_straddling_devices(trace: str) -> None:
    torch.manual_seed(0)
    device_map = {"pre": "cpu:0", "enc.layer.weight": "cpu:0", "enc.layer.bias": "cpu:1", "post": "cpu:1"}
    plan = split_by_map(Straddle(), device_map, (torch.randn(3, 16),), trace)
    assert plan.param_devices["enc.layer.bias"] == "cpu:1"
    assert [(c.producer, c.kind) for c in plan.cuts if c.kind == "parameter"] == [("enc.layer.bias", "parameter")]


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_unused_submodule(trace: str) -> None:
    torch.manual_seed(0)
    device_map = {"a": "cpu:0", "b": "cpu:1", "spare": "cpu:1", "idle": "cpu:0"}
    plan = split_by_map(Unused(), device_map, (torch.randn(2, 8),), trace)
    assert plan.param_devices["spare.weight"] == "cpu:1" and plan.param_devices["idle"] == "cpu:0"


def test_whole_model_key_and_longest_match() -> None:
    model = Straddle()
    homes = read_device_map(model, {"": "cpu:1", "enc": "cpu:0", "enc.layer.bias": 1}, {1: "cpu:1"})
    assert homes == {
        "pre.weight": "cpu:1",
        "pre.bias": "cpu:1",
        "enc.layer.weight": "cpu:0",
        "enc.layer.bias": "cpu:1",
        "post.weight": "cpu:1",
        "post.bias": "cpu:1",
    }
    assert read_device_map(model, {"": 0}) == dict.fromkeys(homes, "cuda:0")


def test_errors_list_every_problem() -> None:
    with pytest.raises(fxsplit.SpecError) as caught:
        read_device_map(Straddle(), {"pre": "cpu:0", "enc.layr": "cpu:1"})
    message = str(caught.value)
    assert "key 'enc.layr' names no module" in message and "did you mean 'enc.layer'" in message
    assert "no key covers 4 tensor(s): 'enc.layer.weight', 'enc.layer.bias', 'post.weight', 'post.bias'" in message


def test_offload_is_refused() -> None:
    with pytest.raises(fxsplit.SpecError, match=r"'post': 'disk' offloads, which fxsplit does not support yet"):
        fxsplit.from_device_map(Straddle(), {"": "cpu:0", "post": "disk"})


def test_tied_names_must_agree() -> None:
    with pytest.raises(fxsplit.SpecError, match=r"'shared.weight' and 'head.weight' are one tensor \(tied\)"):
        read_device_map(Shared(), {"": "cpu:0", "head": "cpu:1"})


def test_budgets_must_hold_the_map() -> None:
    device_map = {"pre": "cpu:0", "enc": "cpu:0", "post": "cpu:1"}
    with pytest.raises(fxsplit.BudgetError, match=r"'cpu:0'"):
        fxsplit.from_device_map(Straddle(), device_map, {"cpu:0": 1000, "cpu:1": "1MiB"}, mode="weights")
    with pytest.raises(fxsplit.SpecError, match=r"the budgets do not name"):
        fxsplit.from_device_map(Straddle(), device_map, {"cpu:0": "1MiB"})
    with pytest.raises(fxsplit.SpecError, match=r"does not take pins"):
        fxsplit.from_device_map(Straddle(), device_map, pins={"pre": "cpu:0"})


def test_given_budgets_keep_their_order_and_devices() -> None:
    budgets = {"cpu:0": "1MiB", "cpu:1": "1MiB", "cpu:2": "1MiB"}
    plan = fxsplit.from_device_map(Straddle(), {"": "cpu:1"}, budgets, example_inputs=(torch.randn(2, 16),))
    assert plan.devices == ("cpu:0", "cpu:1", "cpu:2")
    assert set(plan.placement.values()) == {"cpu:1"} and plan.cuts == ()


def test_place_ops_copies_least_around_pins() -> None:
    chain = PartitionProblem(
        ("a", "b", "c", "d"),
        (Value("a", 100, 0, (1,)), Value("b", 1, 1, (2,)), Value("c", 100, 2, (3,))),
    )
    assert place_ops(chain, {0: 0, 3: 1}, 2).op_devices == (0, 0, 1, 1)
    assert place_ops(chain, {}, 2).op_devices == (0, 0, 0, 0)


def test_accelerate_map_of_a_transformers_model() -> None:
    accelerate = pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.config.use_cache = False
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    device_map = accelerate.infer_auto_device_map(
        model, max_memory={0: size // 2, 1: size * 2}, no_split_module_classes=["GPT2Block"]
    )
    assert set(device_map.values()) == {0, 1}
    ids = torch.randint(0, 100, (2, 8))
    reference = copy.deepcopy(model)
    plan = fxsplit.from_device_map(
        model, device_map, example_inputs=(ids,), devices={0: "cpu:0", 1: "cpu:1"}, trace="export"
    )
    own = fxsplit.plan(copy.deepcopy(model), plan.budgets, example_inputs=(ids,), trace="export")
    assert plan.transfer_bytes >= own.transfer_bytes
    gm = fxsplit.apply(model, plan, example_inputs=(ids,))
    torch.testing.assert_close(gm(ids).logits, reference(ids).logits)


def test_plan_saves_and_checks_like_any_plan() -> None:
    torch.manual_seed(0)
    model, inputs = Tied(), (torch.randint(0, 40, (2, 5)),)
    device_map = {"emb": "cpu:0", "body": "cpu:1", "head": "cpu:0"}
    plan = fxsplit.from_device_map(model, device_map, example_inputs=inputs, trace="export")
    assert fxsplit.Plan.from_yaml(plan.to_yaml()) == plan
    assert fxsplit.check_plan(model, plan, example_inputs=inputs).notes == ()
    assert plan == fxsplit.from_device_map(model, device_map, example_inputs=inputs, trace="export")
