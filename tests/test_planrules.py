"""Saved plans are checked, not trusted: fingerprint, tensors, devices, tied groups, budgets and cuts."""

from __future__ import annotations

import copy
import dataclasses
import io
from pathlib import Path

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.cli import main
from fxsplit.factory import load_model
from fxsplit.options import Budgets
from fxsplit.planning.plan import Plan
from fxsplit.planning.rules import PlanProblems, budget_overruns, device_needs, plan_problems

# Two layers of 9408 bytes each; budgets of 12 KiB hold one layer per device. The large model has the
# same graph (same node and tensor names) with layers four times larger: 36.4 KiB each.
MODELS = """
import torch
from torch import nn


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 48))


def large():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 96))
"""
BUDGETS = {"cpu:0": "12KiB", "cpu:1": "12KiB"}
LAYER = 48 * 48 * 4 + 48 * 4
TinyLM = load_model(f"{Path(__file__).resolve().parents[1] / 'examples' / 'models.py'}:factory").model.__class__


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "pair.py"
    path.write_text(MODELS)
    return path


def small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 48))


def large() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 96))


def saved_plan() -> Plan:
    plan = fxsplit.plan(small(), BUDGETS, mode="weights", trace="fx")
    assert plan.param_devices == {"0.weight": "cpu:0", "0.bias": "cpu:0", "2.weight": "cpu:1", "2.bias": "cpu:1"}
    return plan


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert list(after) == list(before)
    for name, tensor in before.items():
        assert after[name].device == tensor.device and torch.equal(after[name], tensor), name


def test_a_saved_plan_of_fxsplit_meets_every_rule_and_applies() -> None:
    plan = saved_plan()
    assert plan_problems(plan) == []
    loaded = Plan.from_yaml(plan.to_yaml())
    assert loaded == plan
    model = small()
    reference = copy.deepcopy(model)
    gm = fxsplit.apply(model, loaded)
    x = torch.randn(3, 48)
    torch.testing.assert_close(gm(x), reference(x))
    gm(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert ours.grad is not None and theirs.grad is not None
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)
    assert fxsplit.check_plan(small(), loaded).notes == ()


def test_a_tampered_fingerprint_is_refused(models: Path, tmp_path: Path) -> None:
    plan = saved_plan()
    text = plan.to_yaml()
    assert plan.fingerprint is not None and f"fingerprint: {plan.fingerprint}\n" in text
    tampered = text.replace(f"fingerprint: {plan.fingerprint}", "fingerprint: sha256:0123456789abcdef")
    with pytest.raises(PlanProblems) as caught:
        Plan.from_yaml(tampered)
    assert isinstance(caught.value, fxsplit.SpecError) and isinstance(caught.value, fxsplit.PlanMismatchError)
    assert (
        f"<plan>:5: fingerprint: is 'sha256:0123456789abcdef' but the plan's tensors and tied groups give "
        f"'{plan.fingerprint}'; the plan was edited or damaged"
    ) in str(caught.value)
    with pytest.raises(PlanProblems, match="fingerprint: is 'sha256:0123456789abcdef'"):
        fxsplit.apply(small(), dataclasses.replace(plan, fingerprint="sha256:0123456789abcdef"))
    path = tmp_path / "tampered.yaml"
    path.write_text(tampered)
    for command in ("check", "code"):
        code, out, err = run(command, f"{models}:small", "--plan", str(path))
        assert code == 2 and out == "", (command, err)
        assert err.startswith(f"fxsplit: error: {path}: 1 problem:\n  {path}:5: fingerprint: is "), err


def test_emptied_tensors_no_longer_turn_the_structure_check_off(models: Path, tmp_path: Path) -> None:
    plan = saved_plan()
    text = plan.to_yaml()
    start, end = text.index("\ntensors:\n"), text.index("\nmemory:")
    emptied = text[:start] + "\ntensors: {}" + text[end:]
    with pytest.raises(PlanProblems, match=r"tensors: is empty but param_devices places 4 tensor\(s\)"):
        Plan.from_yaml(emptied)
    model = large()
    before = weights_of(model)
    with pytest.raises(PlanProblems, match=r"tensors: is empty"):
        fxsplit.apply(model, dataclasses.replace(plan, tensors={}))
    # with the fingerprint made to match the emptied tensors, the model's own tensors still show the difference
    unrecorded = dataclasses.replace(plan, tensors={}, param_devices={}, fingerprint=plan_fingerprint({}))
    with pytest.raises(fxsplit.PlanMismatchError, match="extra: the model has '0.weight' .float32.96, 96..") as caught:
        fxsplit.apply(model, unrecorded)
    assert "4 difference(s)" in str(caught.value)
    assert_untouched(model, before)
    path = tmp_path / "emptied.yaml"
    path.write_text(emptied)
    code, _, err = run("code", f"{models}:large", "--plan", str(path))
    assert code == 2 and "tensors: is empty but param_devices places 4 tensor(s)" in err


def plan_fingerprint(tensors: dict[str, str]) -> str:
    from fxsplit.planning.fingerprint import fingerprint_of

    return fingerprint_of(tensors, ())


def test_a_plan_for_the_small_model_is_refused_on_the_large_one(models: Path, tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(saved_plan().to_yaml())
    model = large()
    before = weights_of(model)
    with pytest.raises(fxsplit.PlanMismatchError, match=r"changed: '0.weight' is float32\[96, 96\] in the model"):
        fxsplit.apply(model, Plan.from_yaml(path.read_text()))
    assert_untouched(model, before)
    code, _, err = run("check", f"{models}:large", "--plan", str(path))
    assert code == 2 and "changed: '0.weight' is float32[96, 96] in the model, float32[48, 48] in the plan" in err


def over_budget_plan() -> Plan:
    """Both layers on cpu:0 (cuts as the placement implies), its budget left at 12 KiB: an edited placement."""
    roomy = fxsplit.plan(
        small(),
        {"cpu:0": "24KiB", "cpu:1": "24KiB"},
        mode="weights",
        trace="fx",
        pins={"0": "cpu:0", "2": "cpu:0"},
        output_device="cpu:1",
    )
    assert set(roomy.param_devices.values()) == {"cpu:0"}
    return dataclasses.replace(
        roomy, budgets={"cpu:0": 12 * 1024, "cpu:1": 12 * 1024}, device_bytes={"cpu:0": LAYER, "cpu:1": LAYER}
    )


def test_apply_rechecks_the_budgets_with_the_models_own_tensors(models: Path, tmp_path: Path) -> None:
    edited = Plan.from_yaml(over_budget_plan().to_yaml())  # the file meets every rule: the bytes it states fit
    model = small()
    before = weights_of(model)
    expected = (
        f"'cpu:0' holds 18.38 KiB ({2 * LAYER} bytes) of parameters and buffers but may hold 12.00 KiB: "
        f"over by 6.38 KiB ({2 * LAYER - 12 * 1024} bytes)"
    )
    with pytest.raises(fxsplit.BudgetError) as caught:
        fxsplit.apply(model, edited)
    assert expected in str(caught.value) and "plan again for this model" in str(caught.value)
    assert_untouched(model, before)
    with pytest.raises(fxsplit.BudgetError, match="over by 6.38 KiB"):
        fxsplit.check_plan(model, edited)
    path = tmp_path / "edited.yaml"
    path.write_text(edited.to_yaml())
    for command in ("code", "check"):
        code, out, err = run(command, f"{models}:small", "--plan", str(path))
        assert code == 1 and out == "", (command, err)
        assert err.startswith("fxsplit: does not fit: the plan does not fit the budgets: ") and expected in err


def test_the_reserve_counts_when_a_plan_is_applied() -> None:
    plan = saved_plan()
    reserving = dataclasses.replace(plan, reserved={"cpu:1": 4096})
    with pytest.raises(
        fxsplit.BudgetError,
        match=r"'cpu:1' holds 9.19 KiB \(9408 bytes\) of parameters and buffers "
        r"but may hold 8.00 KiB \(its budget 12.00 KiB less 4.00 KiB reserved\): over by 1.19 KiB",
    ):
        fxsplit.apply(small(), Plan.from_yaml(reserving.to_yaml()))


def test_check_plan_holds_activations_to_the_budgets_too() -> None:
    x = torch.randn(4, 48)
    plan = fxsplit.plan(small(), BUDGETS, example_inputs=(x,))  # mode="inference": activations count
    report = fxsplit.check_plan(small(), plan, example_inputs=(x,))
    assert [(d, needs) for d, _, needs in report.devices] == [(d, plan.memory[d]["total"]) for d in plan.devices]
    weights_only = {d: plan.device_bytes[d] for d in plan.devices}  # room for the parameters, not the activations
    with pytest.raises(fxsplit.BudgetError) as caught:
        fxsplit.check_plan(small(), plan, weights_only, example_inputs=(x,))
    assert plan.memory["cpu:0"] == {
        "params": 9408,
        "buffers": 0,
        "grads": 0,
        "optimizer": 0,
        "activations_peak": 1536,
        "total": 10944,
    }
    assert (
        "'cpu:0' holds 9.19 KiB (9408 bytes) of parameters and buffers and 1.50 KiB of activations peak, 10.69 KiB "
        "(10944 bytes) in all, but may hold 9.19 KiB: over by 1.50 KiB (1536 bytes)"
    ) in str(caught.value) and "plan again with these budgets" in str(caught.value)


def _bare_plan(**fields: object) -> Plan:
    base: dict[str, object] = {
        "devices": ("a", "b"),
        "budgets": {"a": 100, "b": 100},
        "placement": {},
        "param_devices": {},
        "device_bytes": {"a": 60, "b": 100},
        "cuts": (),
        "output_device": "b",
    }
    return Plan(**{**base, **fields})  # type: ignore[arg-type]


def test_the_budget_rule_is_one_helper_over_the_memory_total_and_the_usable_budget() -> None:
    assert budget_overruns(_bare_plan()) == []  # no breakdown: device_bytes, against the full budget
    reserving = _bare_plan(reserved={"b": 10})
    assert [(o.device, o.needs, o.usable, o.excess) for o in budget_overruns(reserving)] == [("b", 100, 90, 10)]
    assert str(budget_overruns(reserving)[0]) == (
        "'b' holds 100 B (100 bytes) of parameters and buffers but may hold 90 B (its budget 100 B less 10 B "
        "reserved): over by 10 B (10 bytes)"
    )
    rows = {
        "a": {"params": 60, "buffers": 0, "grads": 60, "optimizer": 0, "activations_peak": 30, "total": 150},
        "b": {"params": 100, "buffers": 0, "total": 100},
    }
    training = _bare_plan(memory=rows)
    assert device_needs(training) == {"a": 150, "b": 100}
    assert device_needs(training, {"a": 10, "b": 0}) == {"a": 100, "b": 0}  # the model's own bytes replace the plan's
    (over,) = budget_overruns(training)
    assert str(over).startswith(
        "'a' holds 60 B (60 bytes) of parameters and buffers and 90 B of gradients and activations peak, 150 B "
        "(150 bytes) in all, but may hold 100 B: over by 50 B"
    )
    given = Budgets({"a": 1000})  # budgets given to check against: a device they leave out may hold nothing
    assert [(o.device, o.usable) for o in budget_overruns(training, budgets=given)] == [("b", 0)]


def test_a_plan_file_may_state_no_negative_bytes() -> None:
    problems = plan_problems(_bare_plan(budgets={"a": -1, "b": 100}, reserved={"b": -5}))
    messages = [p.message for p in problems]
    assert "budget of 'a' is negative (-1 bytes)" in messages and "reserved of 'b' is negative (-5 bytes)" in messages


def test_apply_rechecks_the_cuts(models: Path, tmp_path: Path) -> None:
    plan = saved_plan()
    assert plan.cuts
    uncut = dataclasses.replace(plan, cuts=())
    model = small()
    before = weights_of(model)
    with pytest.raises(
        fxsplit.PlanMismatchError,
        match=r"cuts are not those its placement implies(.|\n)*"
        r"placement implies .*cpu:0 -> cpu:1",
    ):
        fxsplit.apply(model, Plan.from_yaml(uncut.to_yaml()))
    assert_untouched(model, before)
    path = tmp_path / "uncut.yaml"
    path.write_text(uncut.to_yaml())
    code, _, err = run("code", f"{models}:small", "--plan", str(path))
    assert code == 2 and "cuts are not those its placement implies" in err


def tied_plan() -> Plan:
    torch.manual_seed(0)
    model = TinyLM(vocab=100, width=16, depth=2).eval()
    plan = fxsplit.plan(model, {"cpu:0": "40KiB", "cpu:1": "40KiB"}, mode="weights", trace="fx")
    assert plan.tied == (("model.embed_tokens.weight", "lm_head.weight"),)
    return plan


def test_one_tied_tensor_on_two_devices_is_refused() -> None:
    plan = tied_plan()
    home = plan.param_devices["lm_head.weight"]
    other = next(d for d in plan.devices if d != home)
    text = plan.to_yaml()
    line = f"  lm_head.weight: {home}\n"
    assert line in text
    split = text.replace(line, f"  lm_head.weight: '{other}'\n")
    with pytest.raises(PlanProblems) as caught:
        Plan.from_yaml(split)
    message = str(caught.value)
    assert "tied[0]: tied names are one tensor, so they share one device, but param_devices puts " in message
    assert f"'model.embed_tokens.weight' on '{home}', 'lm_head.weight' on '{other}'; give them one device" in message
    with pytest.raises(PlanProblems, match="tied names are one tensor"):
        fxsplit.apply(
            TinyLM(vocab=100, width=16, depth=2),
            dataclasses.replace(plan, param_devices={**plan.param_devices, "lm_head.weight": other}),
        )


def test_every_problem_of_a_plan_file_is_reported_at_once() -> None:
    plan = tied_plan()
    home = plan.param_devices["lm_head.weight"]
    other = next(d for d in plan.devices if d != home)
    node = next(iter(plan.placement))
    text = (
        plan.to_yaml()
        .replace(f"fingerprint: {plan.fingerprint}", "fingerprint: sha256:feedfacefeedface")
        .replace(f"  lm_head.weight: {home}\n", f"  lm_head.weight: '{other}'\n")
        .replace(f"\n  {node}: {plan.placement[node]}\n", f"\n  {node}: cuda:9\n")
        .replace("  model.norm.weight: float32[16]\n", "")
    )
    with pytest.raises(PlanProblems) as caught:
        Plan.from_yaml(text)
    found = [(p.path, p.line) for p in caught.value.problems]
    assert {path for path, _ in found} == {
        ("fingerprint",),
        ("param_devices", "model.norm.weight"),
        ("tied", 0),
        ("placement", node),
    }
    assert [line for _, line in found] == sorted(line or 0 for _, line in found)
    lines = text.splitlines()
    for path, line in found:
        assert line is not None and str(path[-1]) in lines[line - 1], (path, line, lines[line - 1])
    message = str(caught.value)
    assert message.startswith("<plan>: 4 problems:\n  <plan>:5: fingerprint: is 'sha256:feedfacefeedface'")
    assert f"placement['{node}']: node '{node}' is placed on 'cuda:9', which is neither a budget device" in message
    assert "param_devices['model.norm.weight']: 'model.norm.weight' is not listed under tensors" in message


def test_a_damaged_plan_file_raises_only_fxsplit_errors() -> None:
    text = saved_plan().to_yaml()
    cut_short = [text[:n] for n in range(0, text.index("\ntensors:"), 97)]  # each misses a required part
    edits = [
        text.replace(": cpu:", ": [cpu:", 1),
        text.replace("budget: 12288", "budget: -1", 1),
        text.replace("kind: activation", "kind: teleport"),
        text.replace("format:", "format: ["),
        text.replace("  0.weight: float32[48, 48]", "  0.weight: [48, 48]"),
        text.replace("\n", "\n\t", 1),
    ]
    for case in [*cut_short, *edits]:
        with pytest.raises(fxsplit.FxsplitError) as caught:
            Plan.from_yaml(case)
        assert isinstance(caught.value, fxsplit.SpecError) and len(str(caught.value)) < 2000


def test_pipeline_stages_hold_a_given_plan_to_the_rules() -> None:
    plan = saved_plan()
    with pytest.raises(PlanProblems, match="fingerprint: is 'sha256:0123456789abcdef'"):
        fxsplit.pipeline_stages(
            small(),
            dataclasses.replace(plan, fingerprint="sha256:0123456789abcdef"),
            example_inputs=(torch.randn(4, 48),),
            chunks=2,
        )
