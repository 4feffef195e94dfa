"""Pins, together-groups and leaf modules checked against the model (fxsplit.cost.constraints).

End-to-end messages through fxsplit.plan and specs are in test_spec.py and test_errors.py; here the
module's own functions, on a traced toy model and on hand-made partition problems.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

import fxsplit
from fxsplit.cost.constraints import (
    check_constraints,
    explain_infeasible_pins,
    locator,
    resolve_leaf_modules,
    together_groups,
)
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.spec import load_spec


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


EXPLICIT = locator(None, ())
DEVICES = ("cpu:0", "cpu:1", "cpu:2")


def traced(model: nn.Module) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(model)


def problems_of(pins: dict[str, str], together: list[list[str]] = (), model: nn.Module | None = None) -> str:  # type: ignore[assignment]
    model = model or Model()
    with pytest.raises(fxsplit.SpecError) as info:
        check_constraints(traced(model), model, DEVICES, pins, together, EXPLICIT)
    return str(info.value)


def test_locator_names_the_keyword_or_the_spec_line() -> None:
    assert EXPLICIT("pins", "lm_head") == "pins['lm_head']"
    assert EXPLICIT("together", 0, 1) == "together[0][1]"
    spec = load_spec("devices: {cpu:0: 1MiB}\npin:\n  lm_head: cpu:0\nleaf_modules: [Block]\n")
    from_spec = locator(spec, ())
    assert from_spec("pins", "lm_head") == "<spec>:3: pin['lm_head']"  # the spec calls it 'pin'
    assert from_spec("leaf_modules", 0) == "<spec>:4: leaf_modules[0]"
    assert locator(spec, ("pins",))("pins", "lm_head") == "pins['lm_head']"  # given as a keyword: not the spec's


def test_leaf_modules_resolve_to_classes_or_stay_paths() -> None:
    model = nn.Sequential(Model(), nn.MultiheadAttention(4, 2))
    leaves = [Block, "Block", f"{Block.__module__}.Block", "torch.nn.MultiheadAttention", "0.layers.1"]
    assert resolve_leaf_modules(model, leaves, EXPLICIT) == [Block, Block, Block, nn.MultiheadAttention, "0.layers.1"]
    full = resolve_leaf_modules(model, ["torch.nn.modules.activation.MultiheadAttention"], EXPLICIT)
    assert full == [nn.MultiheadAttention]


def test_unknown_leaf_modules_are_all_listed_with_close_names() -> None:
    with pytest.raises(fxsplit.SpecError) as info:
        resolve_leaf_modules(Model(), ["Blok", "layers.7", "Block"], EXPLICIT)
    text = str(info.value)
    assert text.startswith("2 problems with the leaf modules:")
    assert "leaf_modules[0]: 'Blok' is neither a module path of the model nor the class of one of its modules" in text
    assert "did you mean 'Block'" in text
    assert "leaf_modules[1]: 'layers.7'" in text and "'layers.1'" in text


@pytest.mark.parametrize(
    ("together", "message"),
    [
        ("embed", "together must be a list of groups"),
        (3, "together must be a list of groups"),
        (["embed", "head"], "each together-group must be a list"),
        ([[]], "a together-group must list module paths or globs as strings"),
        ([["embed", ""]], "a together-group must list module paths or globs as strings"),
        ([["embed", 3]], "(got ('embed', 3))"),
    ],
)
def test_together_groups_refuse_other_shapes(together: object, message: str) -> None:
    with pytest.raises(fxsplit.SpecError) as info:
        together_groups(together)
    assert message in str(info.value)


def test_together_groups_accept_any_iterables() -> None:
    assert together_groups((["a", "b"], ("c",))) == [("a", "b"), ("c",)]
    assert together_groups(iter([iter(["x"])])) == [("x",)]
    assert together_groups([]) == []


def test_pins_and_groups_that_agree_with_the_graph_pass() -> None:
    model = Model()
    pins = {"embed": "cpu:0", "layers.1.*": "cpu:1", "head": "cpu:2"}
    check_constraints(traced(model), model, DEVICES, pins, [["layers.1", "layers.2"]], EXPLICIT)


def test_every_pin_problem_is_reported_at_once() -> None:
    text = problems_of(
        {
            "embed": "cuda:0",  # no budget
            "layerz.0": "cpu:0",  # no module
            "layers.*": "cpu:1",
            "layers.1.proj": "cpu:2",  # one op, two devices
        }
    )
    assert text.startswith("3 problems with the pins:")
    assert "pins['embed']: pins to 'cuda:0', which has no budget (devices: cpu:0, cpu:1, cpu:2)" in text
    assert "pins['layerz.0']: no module of the model matches 'layerz.0'; did you mean 'layers.0'" in text
    assert "pins['layers.1.proj']: conflicts with pins['layers.*']: both match op 'layers_1_proj'" in text
    assert "but pin it to 'cpu:2' and 'cpu:1'; make the patterns disjoint" in text


def test_pins_against_the_device_order_and_groups_across_pins() -> None:
    text = problems_of({"head": "cpu:0", "embed": "cpu:1"}, [["embed", "head"], ["nowhere"]])
    assert text.startswith("3 problems with the pins and together-groups:")
    assert "pins['head']: pins op 'head' (in 'head') to 'cpu:0', but it runs after op 'embed'" in text
    assert "pinned to the later stage 'cpu:1' by pins['embed']" in text
    assert "together[0]: its ops must share a device, but pins 'embed', 'head' put some of them on cpu:0 and cpu:1" in (
        text
    )
    assert "together[1][0]: no module of the model matches 'nowhere'" in text


def test_a_module_inside_a_leaf_runs_no_op_of_its_own() -> None:
    model = Model()
    graph_module = fxsplit.tracing.trace(model, mode="fx", leaf_modules=[Block]).graph_module
    with pytest.raises(fxsplit.SpecError, match="module 'layers.0.proj' runs no op of the traced graph"):
        check_constraints(graph_module, model, DEVICES, {"layers.0.proj": "cpu:0"}, [], EXPLICIT)
    check_constraints(graph_module, model, DEVICES, {"layers.0": "cpu:0"}, [], EXPLICIT)  # the leaf itself


def chain(weights: list[int], pinned: dict[int, int] | None = None, together: tuple = ()) -> PartitionProblem:
    values = tuple(Value(f"w{i}", 0, i, (i,), weight=w) for i, w in enumerate(weights))
    values += tuple(Value(f"a{i}", 1, i, (i + 1,)) for i in range(len(weights) - 1))
    labels = tuple(f"layers.{i}" for i in range(len(weights)))
    return PartitionProblem(tuple(f"op{i}" for i in range(len(weights))), values, pinned or {}, together, labels)


ERROR = fxsplit.BudgetError("the original message")


def test_no_explanation_without_pins_or_when_it_does_not_fit_anyway() -> None:
    assert explain_infeasible_pins(ERROR, chain([50] * 4), [100, 100], ["cpu:0", "cpu:1"], {}, 0, EXPLICIT) is None
    over = chain([50] * 4, pinned={0: 0})
    assert (
        explain_infeasible_pins(ERROR, over, [90, 90], ["cpu:0", "cpu:1"], {"layers.0": "cpu:0"}, 0, EXPLICIT) is None
    )


def test_the_pin_that_makes_it_infeasible_is_named_with_the_reason() -> None:
    problem = chain([50] * 4, pinned={0: 1})  # the first layer pinned to the last device: everything lands there
    error = explain_infeasible_pins(ERROR, problem, [100, 100], ["cpu:0", "cpu:1"], {"layers.0": "cpu:1"}, 0, EXPLICIT)
    assert error is not None
    text = str(error)
    assert "the budgets fit the model, but not with its pins and together-groups" in text
    assert "it fits without pins['layers.0'] -> 'cpu:1'" in text
    assert "Everything after 'op0' (in 'layers.0') (pinned to 'cpu:1') needs 150 B" in text
    assert text.endswith("(the original message)")


def test_a_pinned_span_larger_than_its_device_and_a_group_are_named() -> None:
    problem = chain([50] * 4, pinned={0: 0, 2: 0})  # ops 0..2 on cpu:0: 150 bytes
    pins = {"layers.0": "cpu:0", "layers.2": "cpu:0"}
    error = explain_infeasible_pins(ERROR, problem, [100, 100], ["cpu:0", "cpu:1"], pins, 0, EXPLICIT)
    assert error is not None
    text = str(error)
    assert "it fits without any one of pins['layers.0'] -> 'cpu:0'; pins['layers.2'] -> 'cpu:0'" in text
    assert "from 'op0' (in 'layers.0') to 'op2' (in 'layers.2'), and all ops between them need 150 B" in text
    grouped = chain([50] * 4, together=((0, 3),))  # a user's group around the whole model
    error = explain_infeasible_pins(ERROR, grouped, [100, 100], ["cpu:0", "cpu:1"], {}, 1, EXPLICIT)
    assert error is not None and "it fits without together[0]" in str(error)


def test_pins_are_not_blamed_when_the_model_fits_only_out_of_order_and_stage_order_was_asked() -> None:
    # 576, 576, 480, 400 bytes over two 1060-byte devices: {576, 480} + {576, 400} fits, but no two runs in
    # order do. With contiguous=True and a pin, the pin is not what stops it: the error must not say so.
    model = nn.Sequential(
        nn.Linear(12, 12, bias=False),
        nn.Linear(12, 12, bias=False),
        nn.Linear(12, 10, bias=False),
        nn.Linear(10, 10, bias=False),
    )
    budgets = {"cpu:0": 1060, "cpu:1": 1060}
    options = {"mode": "weights", "trace": "fx"}
    assert len(set(fxsplit.plan(model, budgets, **options).placement.values())) == 2  # fits out of order
    with pytest.raises(fxsplit.BudgetError) as in_order:
        fxsplit.plan(model, budgets, contiguous=True, **options)
    with pytest.raises(fxsplit.BudgetError) as pinned:
        fxsplit.plan(model, budgets, contiguous=True, pins={"0": "cpu:0"}, **options)
    assert "not with its pins" not in str(pinned.value)
    assert str(pinned.value).split(";")[0] == str(in_order.value).split(";")[0]


class WithIdentities(nn.Module):
    """timm's shape: an identity and a dropout between the layers (no ops once traced in eval, no weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.drop, self.mid = nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 8)
        self.norm, self.head = nn.Identity(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mid(self.drop(self.embed(x)))))


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_pin_on_a_module_with_nothing_to_place_says_nothing(trace: str) -> None:
    """Found by pinning timm models' first and last children: ``patch_drop`` (an identity) was refused as a module
    that runs no op, and the pins, which leave the middle free, are no device map either. It has no op and no
    weight: nothing to place, so its pin is met; the others still hold, and the middle is placed freely."""
    model = WithIdentities().eval()
    pins = {"embed": "cpu:0", "drop": "cpu:0", "norm": "cpu:1", "head": "cpu:1"}
    budgets, inputs = {"cpu:0": 2000, "cpu:1": 2000}, (torch.randn(2, 8),)
    plan = fxsplit.plan(model, budgets, example_inputs=inputs, pins=pins, trace=trace, mode="weights")
    devices = plan.param_devices
    assert (devices["embed.weight"], devices["head.weight"], devices["mid.weight"] in ("cpu:0", "cpu:1")) == (
        "cpu:0",
        "cpu:1",
        True,
    )
    with pytest.raises(fxsplit.SpecError, match="no module of the model matches 'nrom'"):  # a typo is still one
        fxsplit.plan(model, budgets, example_inputs=inputs, pins={"nrom": "cpu:1"})
