"""Plans you can keep: YAML round trips, a readable layout, apply() and check_plan() on saved plans."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxsplit
from fxsplit.factory import load_model
from fxsplit.planning.fingerprint import fingerprint_of
from fxsplit.planning.plan import CUT_KINDS, Cut, Plan
from fxsplit.planning.ranges import summarize_modules

TinyLM = load_model(f"{Path(__file__).resolve().parents[1] / 'examples' / 'models.py'}:factory").model.__class__

# Any text but lone surrogates (which no file encoding can hold).
names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
sizes = st.integers(min_value=0, max_value=2**70)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """Plans with any strings, that meet the rules a plan file is held to (fxsplit.planning.rules)."""
    devices = tuple(draw(st.lists(names, min_size=1, max_size=4, unique=True)))
    device = st.sampled_from(devices)
    output_device = draw(device | names)
    known = st.sampled_from([*devices, output_device])
    nodes = draw(st.dictionaries(names, known, max_size=8))
    params = draw(st.dictionaries(names, device, max_size=8))
    tensors = {name: draw(names) for name in params}
    by_device = [[n for n, d in params.items() if d == home] for home in devices]
    tied = tuple(
        tuple(draw(st.lists(st.sampled_from(group), min_size=2, max_size=3, unique=True)))
        for group in by_device
        if len(group) > 1 and draw(st.booleans())
    )
    cuts = draw(
        st.lists(
            # stream cuts name a weight the plan stores off the devices: test_offload round-trips those
            st.builds(
                Cut, names, known, known, st.none() | sizes, st.sampled_from([k for k in CUT_KINDS if k != "stream"])
            ),
            max_size=5,
            unique_by=lambda c: (c.producer, c.destination),
        )
    )
    used = {d: draw(sizes) for d in devices}
    return Plan(
        devices=devices,
        budgets={d: used[d] + draw(sizes) for d in devices},
        placement=nodes,
        param_devices=params,
        device_bytes=used,
        cuts=tuple(c for c in cuts if c.source != c.destination),
        output_device=output_device,
        trace=draw(st.sampled_from(["fx", "export"]) | names),
        objective=draw(st.sampled_from(["min_transfer", "balanced"]) | names),
        modules={d: tuple(draw(st.lists(names, max_size=4))) for d in draw(st.lists(device, unique=True))},
        fingerprint=fingerprint_of(tensors, tied),
        tensors=tensors,
        tied=tied,
        reserved={d: draw(sizes) for d in draw(st.lists(device, unique=True))},
        dtype=draw(st.none() | st.sampled_from(["bfloat16", "float16"]) | names),
        leaf_modules=tuple(draw(st.lists(names, max_size=3))),
        activations_not_counted=draw(st.none() | names),
    )


@pytest.mark.slow  # 150 hypothesis examples: ~8 s
@settings(max_examples=150, deadline=None)
@given(plans())
def test_yaml_round_trip_is_exact(plan: Plan) -> None:
    text = plan.to_yaml()
    again = Plan.from_yaml(text)
    assert again == plan
    assert again.devices == plan.devices and list(again.placement) == list(plan.placement)
    assert again.to_yaml() == text


@settings(max_examples=60, deadline=None)
@given(plans())
def test_dict_round_trip_is_exact(plan: Plan) -> None:
    assert Plan.from_dict(plan.to_dict()) == plan


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["a", "b", "0", "1", "2", "x"]), min_size=1, max_size=4).map(".".join), max_size=12
    )
)
def test_module_ranges_cover_every_block_in_order(paths: list[str]) -> None:
    from fxsplit.planning.ranges import module_block

    expanded = []
    for item in summarize_modules(paths):
        prefix, _, last = item.rpartition(".")
        first, dash, end = last.partition("-")
        if dash:
            expanded += [f"{prefix}.{i}" if prefix else str(i) for i in range(int(first), int(end) + 1)]
        else:
            expanded.append(item)
    blocks = [module_block(p) for p in paths]
    deduped = [b for i, b in enumerate(blocks) if i == 0 or blocks[i - 1] != b]
    assert expanded == deduped


def test_plan_files_reject_what_they_cannot_read() -> None:
    with pytest.raises(fxsplit.SpecError, match="format: must be 'fxsplit-plan/1'"):
        Plan.from_yaml("devices: {cpu:0: 1}")
    with pytest.raises(fxsplit.SpecError, match="not valid YAML"):
        Plan.from_yaml("format: [")
    good = _small_plan().to_yaml()
    broken = good.replace("    budget: 4096", "    budget: lots", 1)
    with pytest.raises(fxsplit.SpecError, match=r"devices\['cpu:0'\]\['budget'\]: must be a byte count \(got 'lots'\)"):
        Plan.from_yaml(broken)


def _fields(data: object, where: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """The YAML path of every mapping value and list item under ``data``."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    return [path for key, value in items for path in [(*where, key), *_fields(value, (*where, key))]]


def test_every_wrong_field_in_a_plan_file_is_an_fxsplit_error_and_a_value_error() -> None:
    data = yaml.safe_load(_small_plan().to_yaml())
    for path in _fields(data):
        for odd in (None, -1, "x", [], {}, {1: 2}, ["cpu:0"]):
            edited = copy.deepcopy(data)
            parent = edited
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = odd
            try:
                Plan.from_yaml(yaml.safe_dump(edited))
            except fxsplit.FxsplitError as error:
                assert isinstance(error, ValueError), (path, odd, type(error))


def test_writing_a_plan_whose_devices_disagree_is_a_spec_error() -> None:
    plan = dataclasses.replace(_small_plan(), budgets={"cpu:0": 4096})
    with pytest.raises(fxsplit.SpecError, match=r"plan.budgets must have one entry per device") as caught:
        plan.to_yaml()
    assert isinstance(caught.value, ValueError)


def _small_plan() -> Plan:
    tensors = {"a.weight": "float32[16, 16]", "b.weight": "float32[16, 16]"}
    return Plan(
        devices=("cpu:0", "cpu:1"),
        budgets={"cpu:0": 4096, "cpu:1": 4096},
        placement={"x": "cpu:0", "a": "cpu:0", "b": "cpu:1", "output": "cpu:1"},
        param_devices={"a.weight": "cpu:0", "b.weight": "cpu:1"},
        device_bytes={"cpu:0": 1024, "cpu:1": 1024},
        cuts=(Cut("a", "cpu:0", "cpu:1", 64),),
        output_device="cpu:1",
        tensors=tensors,
        fingerprint=fingerprint_of(tensors, ()),
    )


X = torch.randint(0, 100, (2, 6))


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM(vocab=100, width=16, depth=6).eval()


# The model has 57 KiB of parameters. These tests are about plan files, so the plans count weights only
# (mode="weights"), not activations.
BUDGETS = {"cpu:0": "24KiB", "cpu:1": "24KiB", "cpu:2": "24KiB"}


def test_plan_file_is_readable_at_the_top() -> None:
    pins = {"lm_head": "cpu:2", "model.embed_tokens": "cpu:0"}  # tied weight copied from cpu:0 to cpu:2
    plan = fxsplit.plan(tiny(), BUDGETS, mode="weights", example_inputs=(X,), pins=pins, replicate=False)
    text = plan.to_yaml()
    head = text.split("# ----")[0]
    assert "\nplacement:" not in head and "\nparam_devices:" not in head
    data = yaml.safe_load(text)
    assert list(data["devices"]) == ["cpu:0", "cpu:1", "cpu:2"]
    summary = [m for d in data["devices"].values() for m in d["modules"]]
    assert any(m.startswith("model.layers.") and "-" in m for m in summary), summary
    assert "# 24.00 KiB" in head and "of the budget" in head
    tied = data["tied"][0]
    assert sorted(tied["names"]) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert tied["copied_to"] == ["cpu:2"]
    assert any(c["kind"] == "parameter" and c["to"] == "cpu:2" for c in data["cuts"])
    assert "tied: model.embed_tokens.weight = lm_head.weight: on cpu:0, copied to cpu:2" in str(plan)
    assert plan.fingerprint and plan.fingerprint.startswith("sha256:")
    assert plan.tensors["model.embed_tokens.weight"] == "float32[100, 16]"


def test_apply_reproduces_the_code_and_outputs() -> None:
    model = tiny()
    expected = model(X)
    gm = fxsplit.fxsplit(model, BUDGETS, mode="weights", example_inputs=(X,))
    saved = gm.meta["fxsplit_plan"].to_yaml()
    again = fxsplit.apply(tiny(), Plan.from_yaml(saved), example_inputs=(X,))
    assert again.code == gm.code
    assert again.meta["fxsplit_plan"] == Plan.from_yaml(saved)  # == the plan made: see the next test
    torch.testing.assert_close(again(X), expected)
    torch.testing.assert_close(gm(X), expected)


def test_a_plan_with_a_memory_breakdown_survives_its_file() -> None:
    plan = fxsplit.plan(tiny(), BUDGETS, mode="weights", example_inputs=(X,))
    assert plan.memory
    assert Plan.from_yaml(plan.to_yaml()) == plan


def test_apply_with_fx_plans_and_the_plans_leaf_modules() -> None:
    model = tiny()
    plan = fxsplit.plan(model, BUDGETS, mode="weights", trace="fx", leaf_modules=["Block"])
    assert plan.leaf_modules == ("Block",) and plan.trace == "fx"
    gm = fxsplit.apply(copy.deepcopy(model), Plan.from_yaml(plan.to_yaml()))
    assert 'getattr(self.model.layers, "0")(' in gm.code  # Block is a leaf: called as a module
    torch.testing.assert_close(gm(X), model(X))


def test_apply_to_a_different_model_says_what_differs() -> None:
    plan = fxsplit.plan(tiny(), BUDGETS, mode="weights", example_inputs=(X,))
    other = TinyLM(vocab=100, width=16, depth=5)
    other.lm_head.weight = nn.Parameter(other.lm_head.weight.detach().clone())
    with pytest.raises(fxsplit.PlanMismatchError) as caught:
        fxsplit.apply(other, plan, example_inputs=(X,))
    text = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert f"fingerprint {plan.fingerprint} in the plan" in text
    assert "missing: the plan has 'model.layers.5.up.weight' (float32[64, 16]), the model does not" in text
    assert "tied: the plan ties ['lm_head.weight', 'model.embed_tokens.weight'], the model does not" in text
    wider = TinyLM(vocab=100, width=16, depth=6)
    wider.model.norm = nn.LayerNorm(16, elementwise_affine=True, bias=False)
    with pytest.raises(fxsplit.PlanMismatchError, match="missing: the plan has 'model.norm.bias'"):
        fxsplit.apply(wider, plan, example_inputs=(X,))


def test_apply_notices_changed_code() -> None:
    plan = fxsplit.plan(tiny(), BUDGETS, mode="weights", example_inputs=(X,))

    class Doubled(TinyLM):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.model(ids)) * 2

    model = Doubled(vocab=100, width=16, depth=6)
    with pytest.raises(fxsplit.PlanMismatchError, match=r"1 node\(s\) the plan does not place(.|\n)*node 'mul'"):
        fxsplit.apply(model, plan, example_inputs=(X,))
    with pytest.raises(fxsplit.FxsplitError, match="traced with torch.export; pass example_inputs"):
        fxsplit.apply(tiny(), plan)


def test_a_plan_made_for_bf16_applies_to_the_cast_model() -> None:
    plan = fxsplit.plan(tiny(), BUDGETS, mode="weights", example_inputs=(X,), dtype="bf16")
    model = tiny().to(torch.bfloat16)
    gm = fxsplit.apply(model, plan, example_inputs=(X,))
    assert gm(X).dtype == torch.bfloat16
    with pytest.raises(
        fxsplit.PlanMismatchError,
        match=r"changed: 'model.embed_tokens.weight' is float16\[100, 16\] in the model, float32",
    ):
        fxsplit.apply(tiny().to(torch.float16), plan, example_inputs=(X,))


def test_check_plan_validates_budgets_and_consistency() -> None:
    model = tiny()
    plan = fxsplit.plan(model, BUDGETS, mode="weights", example_inputs=(X,), reserve="1KiB")
    report = fxsplit.check_plan(model, plan, example_inputs=(X,))
    assert [d for d, _, _ in report.devices] == list(plan.devices)
    assert all(used <= limit == 23 * 1024 for _, limit, used in report.devices)
    assert "budgets held" in str(report)
    with pytest.raises(fxsplit.BudgetError, match="'cpu:0' holds .* but may hold 1.00 KiB: over by"):
        fxsplit.check_plan(model, plan, {"cpu:0": 1024, "cpu:1": 10**6, "cpu:2": 10**6}, example_inputs=(X,))
    with pytest.raises(fxsplit.BudgetError, match="'cpu:2' holds .* but has no budget in the budgets given"):
        fxsplit.check_plan(model, plan, {"cpu:0": 10**6, "cpu:1": 10**6}, example_inputs=(X,))
    last_op = [n for n, d in plan.placement.items() if d == "cpu:1"][-1]
    edited = dataclasses.replace(plan, placement={**plan.placement, last_op: "cpu:2"})
    with pytest.raises(fxsplit.PlanMismatchError, match="cuts are not those its placement implies"):
        fxsplit.check_plan(model, edited, example_inputs=(X,))
    elsewhere = dataclasses.replace(plan, placement={**plan.placement, last_op: "cuda:7"})
    with pytest.raises(fxsplit.PlanMismatchError, match=f"'{last_op}' is placed on 'cuda:7', which is neither"):
        fxsplit.check_plan(model, elsewhere, example_inputs=(X,))
    other = next(d for d in plan.devices if d != plan.output_device)
    assert plan.output_device == plan.placement["output"]
    moved_output = dataclasses.replace(plan, output_device=other)  # the output node still placed elsewhere
    with pytest.raises(fxsplit.PlanMismatchError, match=f"output_device is '{other}' but placement puts the output"):
        fxsplit.check_plan(model, moved_output, example_inputs=(X,))


def test_plans_are_deterministic() -> None:
    first = fxsplit.plan(tiny(), BUDGETS, mode="weights", example_inputs=(X,)).to_yaml()
    assert fxsplit.plan(tiny(), BUDGETS, mode="weights", example_inputs=(X,)).to_yaml() == first


def test_fx_plans_made_with_shapes_need_the_inputs_again() -> None:
    model = tiny()
    gm = fxsplit.fxsplit(model, BUDGETS, mode="weights", example_inputs=(X,), trace="fx")
    plan = Plan.from_yaml(gm.meta["fxsplit_plan"].to_yaml())
    with pytest.raises(fxsplit.FxsplitError, match="made with example inputs"):
        fxsplit.apply(tiny(), plan)
    assert fxsplit.apply(tiny(), plan, example_inputs=(X,)).code == gm.code
