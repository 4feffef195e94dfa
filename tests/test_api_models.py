"""End to end: split models over cpu:0, cpu:1, ... and compare with the unsplit model.

Every split runs its forward under a DeviceChecker (no op may mix logical
devices, as none could on real GPUs); outputs, the gradient of every
parameter and the buffers after the steps must equal those of an unsplit copy.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from helpers import (
    Branches,
    DictOut,
    DirectParameter,
    Dropouts,
    HardCodedDevices,
    InPlace,
    MultiIO,
    Passthrough,
    Residual,
    RunningSum,
    SharedModule,
    SizeLater,
    Tied,
    UNet,
    Unused,
    WithBatchNorm,
    budgets_for,
    mlp,
    split_and_compare,
)

import fxsplit
from fxsplit.check import DeviceChecker, verify_split

TRACES = ["fx", "export"]

CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]], int]] = {
    "mlp_chain": (mlp, lambda: (torch.randn(5, 16),), 3),
    "residual": (Residual, lambda: (torch.randn(5, 10),), 3),
    "unet_long_skips": (UNet, lambda: (torch.randn(2, 3, 8, 8),), 3),
    "branches_merge": (Branches, lambda: (torch.randn(4, 12),), 3),
    "tied_weights": (Tied, lambda: (torch.randint(0, 40, (3, 7)),), 2),
    "batchnorm_train": (WithBatchNorm, lambda: (torch.randn(6, 8),), 2),
    "two_inputs_tuple_dict_out": (MultiIO, lambda: (torch.randn(3, 6), torch.randn(3, 4)), 3),
    "dict_out_scalar_input": (DictOut, lambda: (torch.randn(3, 5), torch.tensor(2.0)), 2),
    "in_place_ops": (InPlace, lambda: (torch.randn(3, 8),), 3),
    "hard_coded_devices": (HardCodedDevices, lambda: (torch.randn(3, 8),), 3),
    "module_called_twice": (SharedModule, lambda: (torch.randn(4, 8),), 3),
    "parameter_read_twice": (DirectParameter, lambda: (torch.randn(4, 8),), 3),
    "dropout_train": (Dropouts, lambda: (torch.randn(4, 8),), 3),
    "passthrough_and_non_tensor_outputs": (Passthrough, lambda: (torch.randn(4, 8),), 3),
    "size_used_later": (SizeLater, lambda: (torch.randn(4, 8),), 3),
    "unused_parameters_and_buffers": (Unused, lambda: (torch.randn(4, 8),), 3),
}


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_split_matches_unsplit(case: str, trace: str) -> None:
    make, inputs, devices = CASES[case]
    torch.manual_seed(0)
    model = make()
    gm = split_and_compare(model, budgets_for(model, devices), inputs(), trace=trace, steps=2)
    plan = gm.meta["fxsplit_plan"]
    if case == "unused_parameters_and_buffers":  # the ops fit one device; the idle tensors go elsewhere
        assert plan.param_devices["spare.weight"] != plan.param_devices["a.weight"] and "idle" in plan.param_devices
    else:
        assert plan.cuts


@pytest.mark.parametrize("trace", TRACES)
def test_buffer_updated_in_forward_and_read_later(trace: str) -> None:
    """The budgets need the read after the write on another stage: a copy taken after the write."""
    torch.manual_seed(0)
    model = RunningSum()
    split_and_compare(model, budgets_for(model, 3), (torch.randn(4, 8),), trace=trace, steps=2)


def test_tied_weight_is_one_tensor_placed_once() -> None:
    torch.manual_seed(0)
    model = Tied()
    ids = (torch.randint(0, 40, (3, 7)),)
    gm = split_and_compare(model, budgets_for(model, 2), ids, contiguous=True, replicate=False)  # no replica
    plan = gm.meta["fxsplit_plan"]
    assert plan.param_devices["emb.weight"] == plan.param_devices["head.weight"]
    assert model.head.weight is model.emb.weight
    weight_bytes = model.emb.weight.numel() * 4
    total = sum(p.numel() * 4 for p in model.parameters())  # parameters() yields the tied tensor once
    assert sum(plan.device_bytes.values()) == total
    # The head runs away from the embedding, so the shared weight travels once, as a parameter copy.
    parameter_cuts = [c for c in plan.cuts if c.kind == "parameter"]
    assert [(c.producer, c.nbytes) for c in parameter_cuts] == [("emb.weight", weight_bytes)]


def test_tied_head_runs_beside_its_embedding_when_that_copies_less() -> None:
    torch.manual_seed(0)
    model = Tied()
    inputs = (torch.randint(0, 40, (3, 7)),)
    contiguous = fxsplit.plan(
        copy.deepcopy(model),
        budgets_for(model, 2),
        example_inputs=inputs,
        trace="fx",
        contiguous=True,
        mode="weights",
        replicate=False,
    )
    gm = split_and_compare(model, budgets_for(model, 2), inputs, replicate=False)  # tests/test_replication.py: with
    plan = gm.meta["fxsplit_plan"]
    assert plan.placement["head"] == plan.param_devices["emb.weight"]
    assert not [c for c in plan.cuts if c.kind == "parameter"]
    assert plan.transfer_bytes < contiguous.transfer_bytes


@pytest.mark.parametrize("trace", TRACES)
def test_batchnorm_eval_mode(trace: str) -> None:
    torch.manual_seed(0)
    model = WithBatchNorm()
    model.train()
    model(torch.randn(16, 8))  # non-trivial running statistics
    model.eval()
    split_and_compare(model, budgets_for(model, 2), (torch.randn(6, 8),), trace=trace)


def test_batchnorm_cumulative_average_falls_back_to_fx() -> None:
    """momentum=None reads a buffer as a Python number, which torch.export cannot trace; auto uses fx."""
    torch.manual_seed(0)
    model = WithBatchNorm(cumulative=True)
    gm = split_and_compare(model, budgets_for(model, 2), (torch.randn(6, 8),), trace="fx", steps=3)
    assert int(model.bn2.num_batches_tracked) == 3
    auto = fxsplit.plan(
        WithBatchNorm(cumulative=True), budgets_for(model, 2), example_inputs=(torch.randn(6, 8),), mode="weights"
    )
    assert auto.trace == "fx"
    assert gm.meta["fxsplit_plan"].placement == auto.placement


def test_keyword_inputs_with_export() -> None:
    torch.manual_seed(0)
    model = MultiIO()
    x, y = torch.randn(3, 6), torch.randn(3, 4)
    split_and_compare(model, budgets_for(model, 3), (x,), kwargs={"y": y}, trace="export")


@pytest.mark.parametrize("trace", TRACES)
def test_output_device_option(trace: str) -> None:
    torch.manual_seed(0)
    model = MultiIO()
    gm = split_and_compare(
        model, budgets_for(model, 3), (torch.randn(3, 6), torch.randn(3, 4)), trace=trace, output_device="cpu:0"
    )
    plan = gm.meta["fxsplit_plan"]
    assert plan.output_device == plan.placement["output"] == "cpu:0"
    assert all(c.destination == "cpu:0" for c in plan.cuts if c.kind == "output")
    inputs = (torch.randn(3, 6), torch.randn(3, 4))
    free = fxsplit.plan(model, budgets_for(model, 3), example_inputs=inputs, trace=trace, mode="weights")
    assert plan.copied_bytes >= free.copied_bytes  # the given device is kept, at a price the free choice never pays


@pytest.mark.parametrize("trace", TRACES)
def test_output_device_without_a_budget(trace: str) -> None:
    torch.manual_seed(0)
    model = mlp()
    gm = split_and_compare(model, budgets_for(model, 3), (torch.randn(4, 16),), trace=trace, output_device="cpu:7")
    assert gm.meta["fxsplit_plan"].cuts[-1].destination == "cpu:7"


class DictInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, batch: dict[str, torch.Tensor], alpha: float = 1.0) -> torch.Tensor:
        return self.c(self.b(self.a(batch["x"]))) * batch["scale"] * alpha + batch["y"]


@pytest.mark.parametrize("trace", TRACES)
def test_dict_and_float_inputs(trace: str) -> None:
    torch.manual_seed(0)
    model = DictInput()
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 8), "scale": torch.tensor(3.0)}
    split_and_compare(model, budgets_for(model, 3), (batch, 2.5), trace=trace)


@pytest.mark.parametrize("trace", TRACES)
def test_gradient_reaches_the_input(trace: str) -> None:
    torch.manual_seed(0)
    model = mlp()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    gm = fxsplit.fxsplit(model, budgets_for(model, 3), example_inputs=(x.detach(),), trace=trace, mode="weights")
    gm(x).square().sum().backward()
    reference(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_a_device_with_no_budget_in_the_middle() -> None:
    torch.manual_seed(0)
    model = mlp()
    each = budgets_for(model, 2)["cpu:0"]
    gm = split_and_compare(model, {"cpu:0": each, "cpu:1": 0, "cpu:2": each}, (torch.randn(4, 16),))
    plan = gm.meta["fxsplit_plan"]
    assert plan.device_bytes["cpu:1"] == 0 and "cpu:1" not in plan.param_devices.values()


def test_default_output_device_is_the_last_stage_that_runs_ops() -> None:
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(2, 16)
    roomy = fxsplit.plan(model, {"cpu:0": 10**6, "cpu:1": 10**6}, example_inputs=(x,))
    assert set(roomy.placement.values()) == {"cpu:0"}  # no reason to cut: cpu:1 runs nothing
    assert roomy.output_device == "cpu:0" and roomy.cuts == ()
    tight = fxsplit.plan(model, budgets_for(model, 3), example_inputs=(x,), mode="weights")
    last_op = [name for name in tight.placement if name != "output"][-1]
    assert tight.output_device == tight.placement[last_op] == tight.placement["output"]


def test_pins_move_modules() -> None:
    torch.manual_seed(0)
    model = mlp()
    budgets = {"cpu:0": 10**6, "cpu:1": 10**6}
    gm = split_and_compare(model, budgets, (torch.randn(2, 16),), pins={"0": "cpu:0", "6": "cpu:1"})
    plan = gm.meta["fxsplit_plan"]
    assert plan.param_devices["6.weight"] == "cpu:1"
    assert plan.param_devices["0.weight"] == "cpu:0"


def test_balanced_objective_end_to_end() -> None:
    torch.manual_seed(0)
    model = Residual()
    budgets = {"cpu:0": 10**6, "cpu:1": 10**6}
    gm = split_and_compare(model, budgets, (torch.randn(4, 10),), objective="balanced")
    used = gm.meta["fxsplit_plan"].device_bytes
    assert abs(used["cpu:0"] - used["cpu:1"]) <= 0.5 * max(used.values())


def test_budget_keys_as_torch_devices_and_strings() -> None:
    torch.manual_seed(0)
    model = mlp()
    each = budgets_for(model, 2)["cpu:0"]
    budgets = {torch.device("cpu", 0): each, "cpu:1": f"{each}B"}
    plan = fxsplit.plan(model, budgets, example_inputs=(torch.randn(2, 16),), mode="weights")
    assert plan.devices == ("cpu:0", "cpu:1")
    assert plan.budgets == {"cpu:0": each, "cpu:1": each}


@pytest.mark.parametrize("trace", TRACES)
def test_plan_does_not_touch_the_model(trace: str) -> None:
    torch.manual_seed(0)
    model = WithBatchNorm().train()
    model(torch.randn(4, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: (p, p.data_ptr(), p.requires_grad) for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    fxsplit.plan(model, budgets_for(model, 2), example_inputs=(torch.randn(6, 8),), trace=trace, mode="weights")
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert int(after["bn1.num_batches_tracked"]) == 1
    assert {n: (p, p.data_ptr(), p.requires_grad) for n, p in model.named_parameters()} == params
    assert dict(model.named_modules()) == modules
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == hooks
    assert model.training and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("trace", TRACES)
def test_split_shares_parameters_with_the_model(trace: str) -> None:
    torch.manual_seed(0)
    model = Residual()
    reference = copy.deepcopy(model)
    originals = dict(model.named_parameters())
    gm = fxsplit.fxsplit(
        model, budgets_for(model, 3), example_inputs=(torch.randn(2, 10),), trace=trace, mode="weights"
    )
    assert dict(model.named_parameters()) == originals  # the very same Parameter objects
    by_id = {id(p) for p in model.parameters()}
    assert {id(p) for p in gm.parameters()} <= by_id
    assert {p.data_ptr() for p in gm.parameters()} <= {p.data_ptr() for p in model.parameters()}
    # An optimizer built on model.parameters() trains the split module.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(2, 10)  # export fixes the batch size of the example
    for net, opt in ((gm, optimizer), (reference, ref_optimizer)):
        net(x).square().sum().backward()
        opt.step()
    torch.testing.assert_close(gm(x), reference(x))


def test_meta_model_can_be_planned_not_split() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB that never exist
    layer = (1024 * 1024 + 1024) * 4
    budgets = {"cpu:0": 3 * layer, "cpu:1": 3 * layer, "cpu:2": 3 * layer}
    for kwargs in ({}, {"example_inputs": (torch.empty(4, 1024, device="meta"),)}):
        plan = fxsplit.plan(model, budgets, mode="weights", **kwargs)
        assert sorted(plan.device_bytes.values()) == [2 * layer, 3 * layer, 3 * layer]
        assert len(set(plan.param_devices.values())) == 3
        assert all(p.device.type == "meta" for p in model.parameters())
    assert plan.cuts[0].nbytes == 4 * 1024 * 4  # shapes known from the meta example input
    with pytest.raises(fxsplit.FxsplitError, match=r"meta device.*fxsplit\.plan\(\)"):
        fxsplit.fxsplit(model, budgets, mode="weights")
    assert all(p.device.type == "meta" for p in model.parameters())


def test_copies_at_cuts_only_once_per_destination() -> None:
    """A value read by many ops on another device is copied once there."""

    class Fan(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(8, 8)
            self.rest = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.first(x)
            out = h
            for layer in self.rest:
                out = layer(out) + h
            return out

    torch.manual_seed(0)
    model = Fan()
    gm = split_and_compare(model, budgets_for(model, 3), (torch.randn(2, 8),))
    plan = gm.meta["fxsplit_plan"]
    first = [c for c in plan.cuts if c.producer == "first"]
    assert len(first) == len({c.destination for c in first}) >= 1
    verify_split(gm)


def test_inputs_on_another_device_are_moved_in() -> None:
    torch.manual_seed(0)
    model = mlp()
    gm = fxsplit.fxsplit(model, budgets_for(model, 2), trace="fx", mode="weights")
    plan = gm.meta["fxsplit_plan"]
    x = torch.randn(2, 16)
    with DeviceChecker(plan, gm) as checker:
        on_last = x.to(plan.devices[-1])
        out = gm(on_last)
    assert checker.device_of(out) == plan.output_device


def test_public_names() -> None:
    assert fxsplit.__all__ == sorted(fxsplit.__all__)
    for name in fxsplit.__all__:
        assert hasattr(fxsplit, name), name
    assert issubclass(fxsplit.BudgetError, ValueError) and issubclass(fxsplit.BudgetError, fxsplit.FxsplitError)
    assert issubclass(fxsplit.SpecError, ValueError) and issubclass(fxsplit.TraceError, fxsplit.FxsplitError)


@pytest.mark.slow  # GPT-2 with labels: ~7 s
def test_hugging_face_causal_lm_with_labels() -> None:
    """A transformers 5.x GPT-2 (tied head) via export: the ModelOutput, its loss and every gradient match."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=4,
        n_head=2,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 8))
    gm = split_and_compare(
        model,
        budgets_for(model, 3),
        (ids,),
        kwargs={"labels": ids},
        trace="export",
        loss=lambda out: out.loss,
        min_devices=3,
    )
    out = gm(ids, labels=ids)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions" and out.loss.dim() == 0
    plan = gm.meta["fxsplit_plan"]
    assert plan.param_devices["lm_head.weight"] == plan.param_devices["transformer.wte.weight"]
