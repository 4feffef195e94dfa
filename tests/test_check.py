"""The invariant checkers pass on real splits and catch each kind of broken plan or module."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import fxsplit
import fxsplit.plangraph
from fxsplit.api import trace_and_plan
from fxsplit.check import DeviceChecker, InvariantError, verify_plan, verify_split
from fxsplit.codegen.meta import COPY_META, DEVICE_META, CopyRecord
from fxsplit.planning.plan import Cut

# Room for the 384 bytes of parameters over two devices, not one: these checks are about placement and
# copies, so the plans count weights only (mode="weights"), not activations.
BUDGETS = {"cpu:0": 300, "cpu:1": 300}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 4))


def split() -> tuple[nn.Module, torch.fx.GraphModule]:
    m = model()
    return m, fxsplit.fxsplit(m, BUDGETS, mode="weights", example_inputs=(torch.randn(2, 4),), trace="fx")


def test_valid_split_passes_every_check() -> None:
    m = model()
    planned = trace_and_plan(m, BUDGETS, (torch.randn(2, 4),), {"trace": "fx", "mode": "weights"})
    verify_plan(planned.plan, planned.traced.graph_module, m)
    gm = fxsplit.fxsplit(m, BUDGETS, mode="weights", example_inputs=(torch.randn(2, 4),), trace="fx")
    verify_split(gm)
    with DeviceChecker(gm.meta["fxsplit_plan"], gm) as checker:
        out = gm(torch.randn(3, 4))
    assert checker.device_of(out) == "cpu:1"
    assert checker.ops_checked >= 5


def test_check_plan_lists_every_violation() -> None:
    m = model()
    planned = trace_and_plan(m, BUDGETS, (torch.randn(2, 4),), {"trace": "fx", "mode": "weights"})
    plan = planned.plan
    cut = plan.cuts[0]
    broken = dataclasses.replace(
        plan,
        placement={**{k: v for k, v in plan.placement.items() if k != "_0"}, "ghost": "cpu:7"},
        param_devices={k: v for k, v in plan.param_devices.items() if k != "0.bias"},
        device_bytes={**plan.device_bytes, "cpu:0": 301},
        cuts=(
            *plan.cuts,
            cut,
            Cut(cut.producer, "cpu:0", "cpu:0", 4, "activation"),
            Cut("x", "cpu:0", "cpu:1", 1, "weird"),
        ),
    )
    with pytest.raises(InvariantError) as info:
        verify_plan(broken, planned.traced.graph_module, m)
    message = str(info.value)
    for expected in [
        "node '_0' is not placed",
        "'ghost', which is not a node",
        "'ghost' is placed on 'cpu:7'",
        "'0.bias' of the model has no device",
        "'cpu:0' holds 301 B (301 bytes) of parameters and buffers but may hold 300 B: over by 1 B (1 bytes)",
        f"'{cut.producer}' is cut to 'cpu:1' more than once",
        "goes from 'cpu:0' to itself",
        "unknown kind 'weird'",
        "tensors['0.bias']: '0.bias' has no device in param_devices",
    ]:
        assert expected in message, (expected, message)
    assert "breaks 9 invariant(s)" in message


def test_check_plan_device_bytes_must_cover_the_weights_placed() -> None:
    m = model()
    plan = fxsplit.plan(m, BUDGETS, mode="weights", example_inputs=(torch.randn(2, 4),))
    with pytest.raises(InvariantError, match="'cpu:1' holds .* bytes of parameters and buffers but device_bytes says"):
        verify_plan(dataclasses.replace(plan, device_bytes={**plan.device_bytes, "cpu:1": 0}), model=m)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_device_bytes_are_checked_at_the_plans_dtype(dtype: str) -> None:
    """A float32 model planned in half precision: device_bytes count 2 bytes per element, and so does the check."""
    m = model()
    plan = fxsplit.plan(
        m, {"cpu:0": 150, "cpu:1": 150}, mode="weights", example_inputs=(torch.randn(2, 4),), dtype=dtype
    )
    verify_plan(plan, model=m)
    fxsplit.plan(
        m, {"cpu:0": 150, "cpu:1": 150}, mode="weights", example_inputs=(torch.randn(2, 4),), dtype=dtype, check=True
    )
    with pytest.raises(InvariantError, match="'cpu:1' holds .* bytes of parameters and buffers but device_bytes says"):
        verify_plan(dataclasses.replace(plan, device_bytes={**plan.device_bytes, "cpu:1": 0}), model=m)


def _inference_plan(**options: object) -> fxsplit.Plan:
    """A plan that counts activations: 384 bytes of parameters and about 200 of activations, on two devices."""
    return fxsplit.plan(model(), {"cpu:0": 600, "cpu:1": 600}, example_inputs=(torch.randn(2, 4),), **options)


def _with_activations(plan: fxsplit.Plan, device: str, total: int) -> fxsplit.Plan:
    """``plan`` with the activations of ``device`` raised so that its memory total is ``total``."""
    row = plan.memory[device]
    peak = total - (row["total"] - row["activations_peak"])
    return dataclasses.replace(plan, memory={**plan.memory, device: {**row, "activations_peak": peak, "total": total}})


def test_activations_over_the_budget_are_reported_though_the_parameters_fit() -> None:
    plan = _inference_plan()
    verify_plan(plan, model=model())
    device = plan.devices[0]
    assert plan.memory[device]["activations_peak"] > 0 and plan.device_bytes[device] < 600
    with pytest.raises(InvariantError) as info:
        verify_plan(_with_activations(plan, device, 601), model=model())
    params = plan.device_bytes[device]
    assert (
        f"'{device}' holds {params} B ({params} bytes) of parameters and buffers and {601 - params} B of activations "
        "peak, 601 B (601 bytes) in all, but may hold 600 B: over by 1 B (1 bytes)"
    ) in str(info.value)
    assert "breaks 1 invariant(s)" in str(info.value)


def test_the_reserve_is_held_back_from_what_a_device_may_hold() -> None:
    plan = _inference_plan(reserve=50)
    assert plan.budgets == {"cpu:0": 600, "cpu:1": 600} and plan.reserved == {"cpu:0": 50, "cpu:1": 50}
    assert all(plan.memory[d]["total"] <= 550 for d in plan.devices)  # planned under the usable budget...
    verify_plan(plan, model=model())
    device = plan.devices[0]
    verify_plan(_with_activations(plan, device, 550))
    with pytest.raises(
        InvariantError, match=r"but may hold 550 B \(its budget 600 B less 50 B reserved\): over by 1 B"
    ):
        verify_plan(_with_activations(plan, device, 551))  # ...and checked against it, not the full 600


def test_the_check_option_checks_the_memory_total(monkeypatch: pytest.MonkeyPatch) -> None:
    fit_or_offload = fxsplit.plangraph.fit_or_offload

    def activations_over(*args: object) -> fxsplit.Plan:
        made = fit_or_offload(*args)  # type: ignore[arg-type]
        return _with_activations(made, made.devices[-1], made.usable[made.devices[-1]] + 1)

    monkeypatch.setattr(fxsplit.plangraph, "fit_or_offload", activations_over)
    _inference_plan()  # unchecked: goes unnoticed
    with pytest.raises(InvariantError, match=r"in all, but may hold 550 B \(its budget 600 B less 50 B reserved\)"):
        _inference_plan(check=True, reserve=50)


def _erase_copy(gm: torch.fx.GraphModule, key: str) -> None:
    node = next(n for n in gm.graph.nodes if COPY_META in n.meta and n.meta[COPY_META].producer == key)
    node.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(node)
    gm.recompile()


def test_a_missing_copy_is_caught_statically_and_at_run_time() -> None:
    _, gm = split()
    plan = gm.meta["fxsplit_plan"]
    activation = next(c for c in plan.cuts if c.kind == "activation")
    _erase_copy(gm, activation.producer)
    with pytest.raises(InvariantError) as info:
        verify_split(gm)
    assert f"the plan cuts '{activation.producer}' to 'cpu:1' but the code makes no such copy" in str(info.value)
    assert "reads values on ['cpu:0', 'cpu:1']" in str(info.value)
    with pytest.raises(InvariantError, match=r"mixes tensors on devices \['cpu:0', 'cpu:1'\]"):
        with DeviceChecker(plan, gm):
            gm(torch.randn(2, 4))
    gm(torch.randn(2, 4))  # torch itself does not notice: the logical devices share the CPU


def test_a_copy_made_twice_or_to_its_own_device_is_caught() -> None:
    _, gm = split()
    copy = next(n for n in gm.graph.nodes if COPY_META in n.meta and n.meta[COPY_META].source is not None)
    record = copy.meta[COPY_META]
    key, destination = record.producer, record.destination
    with gm.graph.inserting_after(copy):
        again = gm.graph.call_method("to", (copy.args[0], destination))
    again.meta[COPY_META] = record
    copy.replace_all_uses_with(again)
    gm.graph.erase_node(copy)
    with gm.graph.inserting_before(again):
        first = gm.graph.call_method("to", (again.args[0], destination))
    first.meta[COPY_META] = record
    with pytest.raises(InvariantError, match=f"'{key}' is copied to '{destination}' twice"):
        verify_split(gm)
    first.meta[COPY_META] = record._replace(source=destination)
    with pytest.raises(InvariantError, match="where it already lives"):
        verify_split(gm)


def test_a_copy_that_lies_about_its_source_is_caught() -> None:
    _, gm = split()
    copy = next(n for n in gm.graph.nodes if COPY_META in n.meta and n.meta[COPY_META].source is not None)
    copy.meta[COPY_META] = CopyRecord(copy.meta[COPY_META].producer, "cpu:2", copy.meta[COPY_META].destination)
    with pytest.raises(InvariantError, match="from 'cpu:2' but the value is on 'cpu:0'"):
        verify_split(gm)


def test_a_cut_the_code_does_not_make_is_caught() -> None:
    _, gm = split()
    plan = gm.meta["fxsplit_plan"]
    extra = dataclasses.replace(plan, cuts=(*plan.cuts, Cut("_4", "cpu:1", "cpu:0", 16, "activation")))
    with pytest.raises(InvariantError, match="the plan cuts '_4' to 'cpu:0' but the code makes no such copy"):
        verify_split(gm, extra)


def test_an_output_left_on_the_wrong_device_is_caught() -> None:
    _, gm = split()
    plan = gm.meta["fxsplit_plan"]
    with pytest.raises(InvariantError, match="returned on 'cpu:1', not on output_device 'cpu:0'"):
        verify_split(gm, dataclasses.replace(plan, output_device="cpu:0"))


def test_a_hard_coded_device_left_in_place_is_caught() -> None:
    _, gm = split()
    plan = gm.meta["fxsplit_plan"]
    last = next(n for n in reversed(list(gm.graph.nodes)) if n.op == "call_module")
    with gm.graph.inserting_after(last):
        ones = gm.graph.call_function(torch.ones, (4,), {"device": "cpu"})
    with gm.graph.inserting_after(ones):
        added = gm.graph.call_function(torch.add, (last, ones))
    last.replace_all_uses_with(added, delete_user_cb=lambda user: user is not added)
    gm.recompile()
    with pytest.raises(InvariantError, match=r"reads values on \['cpu', 'cpu:1'\]"):
        verify_split(gm)
    with pytest.raises(InvariantError, match=r"mixes tensors on devices \['cpu', 'cpu:1'\]"):
        with DeviceChecker(plan, gm):
            gm(torch.randn(2, 4))


def test_device_checker_rules() -> None:
    x, y = torch.randn(3), torch.randn(3)
    with DeviceChecker() as checker:
        a, b = x.to("cpu:0"), y.to("cpu:1")
        assert (checker.device_of(a), checker.device_of(b), checker.device_of(x)) == ("cpu:0", "cpu:1", None)
        assert checker.device_of(a + y) == "cpu:0"  # made outside the mode: fits anywhere
        assert checker.device_of(a[1:].view(2, 1)) == "cpu:0"  # views keep the device
        assert checker.device_of(torch.arange(3, device="cpu:1")) == "cpu:1"
        assert checker.device_of(torch.zeros_like(b)) == "cpu:1"
        assert checker.device_of(a + torch.tensor(2.0)) == "cpu:0"  # host scalar: fine, as on CUDA
        b.copy_(a)  # copy_ may cross devices
        assert checker.device_of(b) == "cpu:1"
        with pytest.raises(InvariantError, match=r"aten.add.Tensor mixes tensors on devices \['cpu:0', 'cpu:1'\]"):
            a + b
        with pytest.raises(InvariantError, match="mixes"):
            a * torch.full((), 2.0, device="cpu:1")  # a 0-dim tensor on another accelerator is not a scalar
        with pytest.raises(InvariantError, match=r"\['cpu', 'cpu:0'\]"):
            a + torch.ones(3)  # the host is a device too
        # a tensor on a logical device says "cpu": a copy to a tensor's device stays where it was
        assert checker.device_of(b.type_as(a.double())) == checker.device_of(b.to(a.device, torch.int64)) == "cpu:1"
        with pytest.raises(InvariantError, match=r"\['cpu', 'cpu:1'\]"):
            b + torch.zeros(3, device=b.device)  # a factory op given that device makes its result on the host


def test_device_checker_copies_to_the_host_when_it_is_a_device() -> None:
    plan = split()[1].meta["fxsplit_plan"]
    with DeviceChecker(dataclasses.replace(plan, devices=(*plan.devices, "cpu"))) as checker:
        b = torch.randn(3).to("cpu:1")
        assert checker.device_of(b.to("cpu", torch.float64)) == "cpu"


def test_device_checker_tags_weights_from_the_plan() -> None:
    m, gm = split()
    plan = gm.meta["fxsplit_plan"]
    with DeviceChecker(plan, m) as checker:
        assert checker.device_of(m[4].weight) == plan.param_devices["4.weight"]
        with pytest.raises(InvariantError, match="mixes"):
            m[4](torch.randn(2, 4).to(plan.param_devices["0.weight"]))


def test_a_node_marked_for_another_device_is_caught() -> None:
    _, gm = split()
    node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.meta.get(DEVICE_META) == "cpu:1")
    node.meta[DEVICE_META] = "cpu:0"
    expected = f"'{node.name}' is marked to run on 'cpu:0' but its values are on 'cpu:1'"
    with pytest.raises(InvariantError, match=expected):
        verify_split(gm)


def test_check_option_runs_the_checkers(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 4)
    fxsplit.fxsplit(model(), BUDGETS, mode="weights", example_inputs=(x,), check=True)
    fxsplit.plan(model(), BUDGETS, mode="weights", example_inputs=(x,), check=True)
    emit = fxsplit.api.emit

    def emit_without_a_copy(*args: object) -> torch.fx.GraphModule:
        gm = emit(*args)
        _erase_copy(gm, next(c for c in gm.meta["fxsplit_plan"].cuts if c.kind == "activation").producer)
        return gm

    monkeypatch.setattr(fxsplit.api, "emit", emit_without_a_copy)
    fxsplit.fxsplit(model(), BUDGETS, mode="weights", example_inputs=(x,))  # unchecked: goes unnoticed
    with pytest.raises(InvariantError, match="makes no such copy"):
        fxsplit.fxsplit(model(), BUDGETS, mode="weights", example_inputs=(x,), check=True)
    make_plan = fxsplit.plangraph.make_plan

    def over_budget(*args: object, **kwargs: object) -> fxsplit.Plan:
        made = make_plan(*args, **kwargs)
        return dataclasses.replace(made, device_bytes={d: 10**6 for d in made.device_bytes})

    monkeypatch.setattr(fxsplit.plangraph, "make_plan", over_budget)
    with pytest.raises(InvariantError, match="but may hold 300 B: over by"):
        fxsplit.plan(model(), BUDGETS, mode="weights", example_inputs=(x,), check=True)


def test_device_checker_can_take_tensors_made_on_the_host_for_anywhere() -> None:
    """``device=x.device`` of a tensor on a logical device is the host; so is attention's own causal mask."""
    plan = split()[1].meta["fxsplit_plan"]
    q = torch.randn(2, 6, 8)  # 3-d: the math path, which makes the mask
    with pytest.raises(InvariantError, match=r"mixes tensors on devices \['cpu', 'cpu:1'\]"):
        with DeviceChecker(plan):  # by default the host is a device of its own
            torch.nn.functional.scaled_dot_product_attention(*[q.to("cpu:1")] * 3, is_causal=True)
    with DeviceChecker(plan, host_anywhere=True) as checker:
        b, k = torch.randn(3).to("cpu:1"), q.to("cpu:1")
        assert checker.device_of(b + torch.zeros(3, device=b.device)) == "cpu:1"
        assert checker.device_of(torch.ones(3)) is None
        assert checker.device_of(torch.nn.functional.scaled_dot_product_attention(k, k, k, is_causal=True)) == "cpu:1"
        with pytest.raises(InvariantError, match="mixes"):
            b + torch.randn(3).to("cpu:0")  # logical devices are still told apart
    with DeviceChecker(dataclasses.replace(plan, devices=(*plan.devices, "cpu")), host_anywhere=True) as checker:
        assert checker.device_of(torch.ones(3)) == "cpu"  # the plan places the host: a device like the others
        with pytest.raises(InvariantError, match=r"\['cpu', 'cpu:1'\]"):
            torch.randn(3).to("cpu:1") + torch.ones(3)
