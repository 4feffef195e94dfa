"""Facts about FX nodes (fxsplit.tracing.graphinfo): value kinds and bytes, module paths, in-place writes, aliases."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fxsplit.tracing.capture import trace
from fxsplit.tracing.graphinfo import (
    NONTENSOR,
    TENSOR,
    UNKNOWN,
    alias_root,
    element_size,
    input_writers,
    is_guard,
    module_path,
    mutated_inputs,
    value_bytes,
    value_kind,
)


class Opaque(nn.Module):
    """Not from torch.nn: what its forward returns is not known without running it."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class Writes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.opaque = Opaque()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = x.size(0)
        double = rows * 2
        x.view(-1).add_(1)  # writes x through a view
        h = self.act(self.lin(y))  # writes lin's output, not an input
        torch.relu_(h)
        F.relu(h, inplace=True)
        pair = self.opaque(h)
        return h * double * self.scale, x.shape, pair


def nodes(graph_module: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {node.name: node for node in graph_module.graph.nodes}


@pytest.fixture(scope="module")
def fx_graph() -> torch.fx.GraphModule:
    return trace(Writes(), mode="fx", leaf_modules=[Opaque]).graph_module


class WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.norm(self.lin(x))[:, :2]


@pytest.fixture(scope="module")
def export_graph() -> torch.fx.GraphModule:
    return trace(WithNorm(), example_inputs=(torch.randn(3, 4),), mode="export").graph_module


def test_kinds_without_shapes_come_from_the_op(fx_graph: torch.fx.GraphModule) -> None:
    found = {name: value_kind(node) for name, node in nodes(fx_graph).items()}
    assert found["size"] == NONTENSOR  # a method that returns sizes
    assert found["mul"] == NONTENSOR  # arithmetic on sizes only
    assert found["getattr_1"] == NONTENSOR  # x.shape
    assert found["lin"] == TENSOR and found["act"] == TENSOR  # torch.nn leaf modules return one tensor
    assert found["opaque"] == UNKNOWN  # a user's module may return anything
    assert found["x"] == UNKNOWN and found["mul_1"] == UNKNOWN  # inputs, and ops on them, are not known


def test_kinds_and_bytes_with_shapes_come_from_the_value() -> None:
    graph = torch.fx.Graph()
    tensor, pair, number, unknown = (graph.placeholder(name) for name in ("t", "pair", "n", "u"))
    tensor.meta["val"] = torch.empty(3, 5, dtype=torch.float32)
    pair.meta["val"] = (torch.empty(2, dtype=torch.float16), [torch.empty(4, dtype=torch.int64)])
    number.meta["val"] = 7
    assert [value_kind(n) for n in (tensor, pair, number, unknown)] == [TENSOR, UNKNOWN, NONTENSOR, UNKNOWN]
    assert value_bytes(tensor) == 60
    assert value_bytes(pair) == 2 * 2 + 4 * 8
    assert value_bytes(number) == 0
    assert value_bytes(unknown) is None  # no shapes: unknown, not zero
    # planning in bfloat16: floating tensors count at 2 bytes, integer ones as they are
    assert value_bytes(tensor, float_dtype=torch.bfloat16) == 30
    assert value_bytes(pair, float_dtype=torch.bfloat16) == 2 * 2 + 4 * 8


def test_bytes_of_shape_propagation_metadata() -> None:
    graph_module = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 6), nn.ReLU()))
    torch.fx.passes.shape_prop.ShapeProp(graph_module).propagate(torch.randn(2, 4))
    by_name = nodes(graph_module)
    assert type(by_name["_0"].meta["tensor_meta"]).__name__ == "TensorMetadata"
    assert value_kind(by_name["_0"]) == TENSOR
    assert value_bytes(by_name["_0"]) == 2 * 6 * 4
    assert value_bytes(by_name["_1"], float_dtype=torch.float16) == 2 * 6 * 2


@pytest.mark.parametrize(
    ("dtype", "float_dtype", "size"),
    [
        (torch.float32, None, 4),
        (torch.float32, torch.bfloat16, 2),
        (torch.float64, torch.float16, 2),
        (torch.int64, torch.bfloat16, 8),
        (torch.bool, torch.float32, 1),
        (torch.bfloat16, torch.float32, 4),
    ],
)
def test_element_size(dtype: torch.dtype, float_dtype: torch.dtype | None, size: int) -> None:
    assert element_size(dtype, float_dtype) == size


def test_export_guard_is_the_only_guard(export_graph: torch.fx.GraphModule) -> None:
    guards = [node.name for node in export_graph.graph.nodes if is_guard(node)]
    assert guards == ["_guards_fn"]
    assert module_path(nodes(export_graph)["_guards_fn"]) == ""  # a guard belongs to no module
    fx_graph = torch.fx.symbolic_trace(WithNorm())
    assert not any(is_guard(node) for node in fx_graph.graph.nodes)


def test_module_paths(fx_graph: torch.fx.GraphModule, export_graph: torch.fx.GraphModule) -> None:
    fx_nodes = nodes(fx_graph)
    assert module_path(fx_nodes["lin"]) == "lin"  # call_module: its target
    assert module_path(fx_nodes["scale"]) == ""  # get_attr of a root buffer
    assert module_path(fx_nodes["size"]) == ""  # fx keeps no module stack
    export_nodes = nodes(export_graph)
    assert module_path(export_nodes["lin_weight"]) == "lin"  # get_attr: the owner of the tensor
    assert module_path(export_nodes["norm_running_mean"]) == "norm"
    assert module_path(export_nodes["linear"]) == "lin"  # export: the innermost module of the stack
    assert module_path(export_nodes["batch_norm"]) == "norm"
    assert module_path(export_nodes["slice_1"]) == ""  # written in the root's forward


def test_in_place_writes_of_fx_ops(fx_graph: torch.fx.GraphModule) -> None:
    modules = dict(fx_graph.named_modules())
    written = {
        name: [m.name for m in mutated_inputs(node, modules)]
        for name, node in nodes(fx_graph).items()
        if mutated_inputs(node, modules)
    }
    assert written == {
        "add_": ["view"],  # method add_
        "act": ["lin"],  # nn.ReLU(inplace=True)
        "relu_": ["act"],  # torch.relu_
        "relu": ["act"],  # F.relu(h, inplace=True): h is still act's output
    }


def test_in_place_writes_named_by_out_and_setitem() -> None:
    graph = torch.fx.Graph()
    x, buffer = graph.placeholder("x"), graph.placeholder("buffer")
    added = graph.call_function(torch.add, (x, 1), {"out": buffer})
    stored = graph.call_function(operator.setitem, (x, 0, 2.0))
    method_out = graph.call_method("mul", (x, 2), {"out": buffer})
    dunder = graph.call_method("__iadd__", (x, 1))  # Python's operator hook, not torch's in-place naming
    plain = graph.call_function(torch.add, (x, buffer))
    graph.output((added, stored, method_out, dunder, plain))
    assert mutated_inputs(added, {}) == [buffer]
    assert mutated_inputs(stored, {}) == [x]
    assert mutated_inputs(method_out, {}) == [buffer]
    assert mutated_inputs(dunder, {}) == []
    assert mutated_inputs(plain, {}) == []
    assert alias_root(added) is buffer  # torch.add(a, b, out=buf) returns buf


def test_in_place_writes_of_aten_ops(export_graph: torch.fx.GraphModule) -> None:
    modules = dict(export_graph.named_modules())
    by_name = nodes(export_graph)
    assert [n.name for n in mutated_inputs(by_name["mul_"], modules)] == ["x"]  # from the op's schema
    assert [n.name for n in mutated_inputs(by_name["linear"], modules)] == []
    stats = {n.name for n in mutated_inputs(by_name["batch_norm"], modules)}
    assert {"norm_running_mean", "norm_running_var"} <= stats  # training batch norm updates its running stats
    assert "linear" not in stats  # the input it normalises is only read


def test_input_writers_follow_views_to_the_input(
    fx_graph: torch.fx.GraphModule, export_graph: torch.fx.GraphModule
) -> None:
    assert input_writers(fx_graph.graph, dict(fx_graph.named_modules())) == {"x": ["add_"]}  # not y, not lin
    assert input_writers(export_graph.graph, dict(export_graph.named_modules())) == {"x": ["mul_"]}


def test_chained_in_place_methods_write_the_same_input_twice() -> None:
    class Chain(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x.add_(1).mul_(2)
            return y.transpose(0, 1).clone().sub_(1)  # a write to a copy of y is not a write to y

    graph_module = torch.fx.symbolic_trace(Chain())
    assert input_writers(graph_module.graph, {}) == {"x": ["add_", "mul_"]}


def test_alias_root_follows_views_only(fx_graph: torch.fx.GraphModule, export_graph: torch.fx.GraphModule) -> None:
    fx_nodes = nodes(fx_graph)
    assert alias_root(fx_nodes["add_"]) is fx_nodes["x"]  # add_ returns view, a view of x
    assert alias_root(fx_nodes["relu_"]) is fx_nodes["lin"]  # in-place ops return what they wrote: act wrote lin
    assert alias_root(fx_nodes["mul_1"]) is fx_nodes["mul_1"]  # a new tensor
    export_nodes = nodes(export_graph)
    assert alias_root(export_nodes["slice_1"]) is export_nodes["batch_norm"]  # aten.slice is a view
    assert alias_root(export_nodes["mul_"]) is export_nodes["x"]
    assert alias_root(export_nodes["linear"]) is export_nodes["linear"]

    class Attrs(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.T.data + torch.reshape(x, (-1,)).sum()

    attrs = nodes(torch.fx.symbolic_trace(Attrs()))
    assert alias_root(attrs["getattr_2"]) is attrs["x"]  # x.T.data
    assert alias_root(attrs["reshape"]) is attrs["x"]
    assert alias_root(attrs["sum_1"]) is attrs["sum_1"]


def test_alias_root_follows_ops_in_place_by_argument(fx_graph: torch.fx.GraphModule) -> None:
    fx_nodes = nodes(fx_graph)
    assert alias_root(fx_nodes["act"]) is fx_nodes["lin"]  # nn.ReLU(inplace=True) returns lin's output
    assert alias_root(fx_nodes["relu"]) is fx_nodes["lin"]  # F.relu(h, inplace=True) returns h

    class WritesAfterInPlaceRelu(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.relu(x, inplace=True)
            y.add_(1)  # writes x too
            return y * 2

    graph_module = torch.fx.symbolic_trace(WritesAfterInPlaceRelu())
    assert input_writers(graph_module.graph, {}) == {"x": ["relu", "add_"]}
