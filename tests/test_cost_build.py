"""A traced graph as a partition problem (fxsplit.cost.build): bytes per value, weights once, constraints.

One small model with a tied weight, a batch norm (buffers written in training), an input written in
place and a submodule forward never calls, traced both ways.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxsplit.cost import walk
from fxsplit.cost.build import GraphCosts, Weight, _new, build_problem, model_tensors, named_tensors, path_matches
from fxsplit.cost.walk import module_table, one_walk
from fxsplit.errors import SpecError
from fxsplit.partition.problem import Value
from fxsplit.tracing.capture import trace


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.spare = nn.Linear(2, 2)

    def forward(self, ids: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).sum(1)
        state.add_(1)
        return self.head(self.norm(h) + state)


INPUTS = (torch.randint(0, 10, (3, 5)), torch.zeros(3, 4))
DEVICES = {"cpu:0": 0, "cpu:1": 1}


def costs(mode: str = "fx", **options: object) -> GraphCosts:
    model = Model()
    traced = trace(model, example_inputs=INPUTS, mode=mode)
    return build_problem(traced.graph_module, model, device_index=DEVICES, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("layers.1", "layers.1", True),
        ("layers.1", "layers.1.mlp.proj", True),  # inside it
        ("layers.1", "layers.10", False),  # not a prefix of the number
        ("layers.*", "layers.3.mlp", True),
        ("layers.[01]", "layers.1.mlp", True),  # a glob, and inside what it matches
        ("layers.[01]", "layers.2", False),
        ("*.proj", "layers.1.proj", True),
        ("*", "", False),  # the root module matches nothing
        ("Layers.1", "layers.1", False),  # case matters
    ],
)
def test_path_matches(pattern: str, path: str, matches: bool) -> None:
    assert path_matches(pattern, path) is matches


def test_named_tensors_are_what_torch_lists_in_the_same_order() -> None:
    model = nn.Sequential(Model(), nn.Linear(2, 2, bias=False), nn.Sequential(nn.BatchNorm1d(3)))
    expected = [(n, t, False) for n, t in model.named_parameters(remove_duplicate=False)]
    expected += [(n, t, True) for n, t in model.named_buffers(remove_duplicate=False)]
    found = named_tensors(model)
    assert [(n, b) for n, _, b in found] == [(n, b) for n, _, b in expected]
    assert all(a is b for (_, a, _), (_, b, _) in zip(found, expected, strict=True))
    assert "0.head.weight" in [n for n, _, _ in found] and "1.bias" not in [n for n, _, _ in found]
    tied = model_tensors(model)[id(model[0].embed.weight)]
    assert tied[0] == ["0.embed.weight", "0.head.weight"] and tied[2] is False


def test_a_tied_weight_is_one_value_read_by_both_ops() -> None:
    found = costs()
    assert [op.name for op in found.ops] == ["embed", "sum_1", "add_", "norm", "add", "head"]
    tied = next(w for w in found.weights if "head.weight" in w.names)
    assert tied.names == ("embed.weight", "head.weight") and tied.nbytes == 10 * 4 * 4
    value = found.problem.values[found.weight_values[found.weights.index(tied)]]
    assert (value.name, value.start, value.consumers, value.weight, value.nbytes) == (
        "embed.weight",
        0,
        (0, 5),
        160,
        160,
    )
    assert sum(found.problem.op_weights()) == 160 + 4 * 4 * 4 + 8  # embedding, batch norm (4 x 16 + 8 bytes)


def test_activations_inputs_and_unread_tensors() -> None:
    found = costs()
    values = {v.name: v for v in found.problem.values}
    assert (values["ids"].nbytes, values["ids"].consumers) == (3 * 5 * 8, (0,))
    assert (values["embed"].nbytes, values["embed"].consumers) == (3 * 5 * 4 * 4, (1,))
    assert found.value_nbytes["head"] == 3 * 10 * 4
    assert [w.names for w in found.unused] == [("spare.weight",), ("spare.bias",)]  # fx: no node reads them
    exported = costs("export")
    assert exported.unused == []  # export reads every tensor into the graph; none of its nodes is an op
    unread = [w.names for w, index in zip(exported.weights, exported.weight_values, strict=True) if index < 0]
    assert unread == [("spare.weight",), ("spare.bias",)]


def test_in_place_writes_keep_their_readers_together() -> None:
    found = costs()
    values = {v.name: v for v in found.problem.values}
    # the module's running statistics are written where it runs: every reader stays home
    assert [values[f"norm.{name}"].movable for name in ("weight", "running_mean", "running_var")] == [
        True,
        False,
        False,
    ]
    # the input 'state' is written by its first reader, state.add_ (op 2): its copy lives there, nothing else
    # must join it (a later reader elsewhere copies it after the write), and no span glues ops together
    assert found.problem.together == () and found.problem.colocated == ()


def test_planning_dtype_scales_floating_tensors_only() -> None:
    half = costs(dtype=torch.bfloat16)
    assert {w.names[0]: w.nbytes for w in half.weights} == {
        "embed.weight": 80,
        "norm.weight": 8,
        "norm.bias": 8,
        "norm.running_mean": 8,
        "norm.running_var": 8,
        "norm.num_batches_tracked": 8,  # an int64 stays 8 bytes
    }
    assert half.value_nbytes["ids"] == 3 * 5 * 8 and half.value_nbytes["head"] == 3 * 10 * 2


def test_pins_and_groups_become_op_indices() -> None:
    found = costs(pins={"head": "cpu:1", "sum_1": "cpu:0"}, together=[["embed", "norm"]])
    assert found.problem.pinned == {5: 1, 1: 0}  # by module path, or by node name
    assert (0, 3) in found.problem.together
    assert found.problem.op_labels == ("embed", "", "", "norm", "", "head")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pins": {"head": "cuda:0"}}, "pin 'head' names device 'cuda:0', which has no budget"),
        ({"pins": {"nothing": "cpu:0"}}, "pin 'nothing' matches no module or node of the traced graph"),
        ({"pins": {"head": "cpu:0", "hea*": "cpu:1"}}, "op 'head' (in 'head') is pinned to two devices"),
        ({"together": [["embed", "nothing"]]}, "together-pattern 'nothing' matches no module or node"),
    ],
)
def test_constraints_that_do_not_resolve(options: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        costs(**options)


def test_module_table_is_named_modules_with_shared_modules() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.Sequential(nn.ReLU(), shared), nn.ModuleDict({"a": shared, "b": nn.Tanh()}))
    assert list(module_table(model).items()) == list(model.named_modules())
    for dedup in (True, False):
        assert walk._modules(model, dedup) == list(model.named_modules(remove_duplicate=dedup))


def test_one_walk_lists_the_tensors_once_per_model() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert named_tensors(model) is not named_tensors(model)
    with one_walk():
        first = named_tensors(model)
        assert named_tensors(model) is first and named_tensors(model[0]) is not first
    assert named_tensors(model) is not first


def test_values_and_weights_made_from_tuples_equal_constructed_ones() -> None:
    fields = {"name": "x", "nbytes": 4, "start": 1, "consumers": (1, 3), "weight": 4, "movable": False}
    made = _new(Value, tuple(fields.values()))
    assert type(made) is Value and made == Value(**fields) and repr(made) == repr(Value(**fields)) and made.last == 3
    assert made._replace(nbytes=0) == Value(**{**fields, "nbytes": 0})
    weight = {"names": ("a", "b"), "nbytes": 8, "is_buffer": False, "nodes": ("n",)}
    assert _new(Weight, tuple(weight.values())) == Weight(**weight)
