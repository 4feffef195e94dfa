"""One attribute-path walker: what it reaches, what a missing part does, and that each stage using it kept its rule.

Callers that ask whether a path names a tensor (or a subgraph) take a missing
part as "no"; callers that read a path the graph or the plan vouches for
raise an ``AttributeError`` that names the path and the missing part.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.fx
from torch import nn

from fxsplit.attrpath import attr_at
from fxsplit.planning.plan import Plan


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, bias=False))
        self.register_buffer("scale", torch.ones(2))
        self.config = {"width": 2}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * self.scale


def _plan(param_devices: dict[str, str]) -> Plan:
    return Plan(
        devices=("cpu:0",),
        budgets={"cpu:0": 1 << 20},
        placement={},
        param_devices=param_devices,
        device_bytes={"cpu:0": 0},
        cuts=(),
        output_device="cpu:0",
    )


def _get_attr(target: str) -> torch.fx.Node:
    return torch.fx.Graph().get_attr(target)


def test_paths_reach_children_parameters_buffers_and_plain_attributes() -> None:
    net = Net()
    assert attr_at(net, "layers.0.weight") is net.layers[0].weight
    assert attr_at(net, "scale") is net.scale
    assert attr_at(net, "layers.1") is net.layers[1]
    assert attr_at(net, "config") == {"width": 2}
    assert attr_at(torch, "nn.Linear") is nn.Linear


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("head.weight", "cannot reach 'head.weight': the root (Net) has no attribute 'head'"),
        ("layers.3.weight", "cannot reach 'layers.3.weight': 'layers' (Sequential) has no attribute '3'"),
        ("layers.0.gain", "cannot reach 'layers.0.gain': 'layers.0' (Linear) has no attribute 'gain'"),
        ("layers.1.bias.data", "cannot reach 'layers.1.bias.data': 'layers.1.bias' is None"),
    ],
)
def test_a_missing_part_is_named_or_gives_the_default(path: str, message: str) -> None:
    net = Net()
    with pytest.raises(AttributeError) as caught:
        attr_at(net, path)
    assert str(caught.value) == message
    assert attr_at(net, path, None) is None
    assert attr_at(net, path, "absent") == "absent"


def test_an_attribute_that_is_none_is_returned_as_none() -> None:
    assert attr_at(Net(), "layers.1.bias") is None  # present, and None: not missing


def test_a_path_that_repeats_a_name_says_which_one_is_missing() -> None:
    root = types.SimpleNamespace(a=types.SimpleNamespace(b=1))
    with pytest.raises(AttributeError, match="'a' \\(SimpleNamespace\\) has no attribute 'a'"):
        attr_at(root, "a.a")


# Each caller, as it behaved before it used the helper.


def test_check_asks_whether_a_get_attr_reads_a_tensor() -> None:
    from fxsplit.check import _is_tensor

    gm = torch.fx.symbolic_trace(Net())
    assert _is_tensor(gm, _get_attr("layers.0.weight"))
    assert not _is_tensor(gm, _get_attr("layers.1.bias"))  # None
    assert not _is_tensor(gm, _get_attr("layers.5.weight"))  # missing


def test_the_device_checker_skips_names_a_module_lacks() -> None:
    from fxsplit.check import DeviceChecker

    net = Net()
    plan = _plan({"layers.0.weight": "cpu:0", "layers.1.bias": "cpu:0", "gone.weight": "cpu:0"})
    checker = DeviceChecker(plan, net)
    assert checker.device_of(net.layers[0].weight) == "cpu:0"
    assert checker.device_of(net.layers[1].weight) is None


def test_pipeline_stages_home_only_tensor_attributes() -> None:
    from fxsplit.pipeline.stages import _Cutter

    cutter = types.SimpleNamespace(gm=torch.fx.symbolic_trace(Net()))
    assert _Cutter._is_weight(cutter, _get_attr("scale"))  # type: ignore[arg-type]
    assert not _Cutter._is_weight(cutter, _get_attr("layers.1.bias"))  # type: ignore[arg-type]
    assert not _Cutter._is_weight(cutter, _get_attr("gone"))  # type: ignore[arg-type]


def test_distributed_stages_find_replicated_weights_by_path_or_say_which_is_missing() -> None:
    from fxsplit.pipeline.tiedgrads import _gathered

    net = Net()
    gm = torch.fx.symbolic_trace(net)
    assert _gathered(gm, "layers.0.weight", (), grads=False) is net.layers[0].weight
    with pytest.raises(AttributeError, match="cannot reach 'layers.0.gain'"):
        _gathered(gm, "layers.0.gain", (), grads=False)


def test_codegen_finds_a_weight_by_any_of_its_names() -> None:
    from fxsplit.codegen.weights import weight_path, weight_tensor
    from fxsplit.cost.build import Weight

    net = Net()
    gm = torch.fx.symbolic_trace(net)
    tied = Weight(("head.weight", "layers.0.weight"), 0, False, ())
    assert weight_tensor(gm, tied) is net.layers[0].weight and weight_path(gm, tied) == "layers.0.weight"
    gone = Weight(("head.weight", "layers.1.bias"), 0, False, ())
    assert weight_tensor(gm, gone) is None and weight_path(gm, gone) is None


def test_codegen_resolves_torch_and_builtin_annotations_only() -> None:
    from fxsplit.codegen.emitter import _annotation

    assert _annotation("torch.Tensor") is torch.Tensor
    assert _annotation("torch.nn.Linear") is nn.Linear
    assert _annotation("int") is int
    assert _annotation("torch") is None and _annotation("torch.nope.Tensor") is None
    assert _annotation("typing.Any") is None


def test_nested_subgraphs_are_graph_modules_or_none() -> None:
    from fxsplit.codegen.nested import _subgraph

    root = nn.Module()
    root.inner = nn.Module()
    root.inner.sub = torch.fx.symbolic_trace(nn.ReLU())
    assert _subgraph(root, "inner.sub") is root.inner.sub
    assert _subgraph(root, "inner") is None and _subgraph(root, "inner.gone") is None


def test_activation_profiling_fakes_the_tensors_get_attr_reads() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxsplit.memory.fakerun import fake_weights

    gm = torch.fx.symbolic_trace(Net())
    graph = torch.fx.Graph()
    graph.output((graph.get_attr("layers.0.weight"), graph.get_attr("layers.1.bias")))
    reads = torch.fx.GraphModule(gm, graph)
    fakes = fake_weights(reads, FakeTensorMode(), training=False)
    assert fakes["layers.0.weight"].shape == (2, 2) and "layers.1.bias" not in fakes


def test_the_cost_model_reads_get_attr_targets_strictly() -> None:
    from fxsplit.cost.build import build_problem

    net = Net()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.mul, (x, graph.get_attr("scale"))))
    gm = torch.fx.GraphModule(net, graph)
    costs = build_problem(gm, net, device_index={"cpu:0": 0})
    assert [w.names for w in costs.weights] == [("scale",)]
    del gm.scale
    with pytest.raises(AttributeError, match="cannot reach 'scale': the root \\(GraphModule\\) has no attribute"):
        build_problem(gm, net, device_index={"cpu:0": 0})
