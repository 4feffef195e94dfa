"""Devices inside higher-order ops' subgraphs follow the device of the op that calls them."""

from __future__ import annotations

import torch
import torch.fx

from fxsplit.codegen.nested import pin_subgraph_devices


def call(subgraph: torch.fx.GraphModule, x: torch.Tensor) -> torch.Tensor:
    return subgraph(x)


def _subgraph() -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ones = graph.call_function(torch.ones, (2,), {"device": torch.device("meta")})
    moved = graph.call_method("to", (x, torch.device("meta")))
    graph.output(graph.call_function(torch.add, (moved, ones)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _devices(subgraph: torch.fx.GraphModule) -> list[str]:
    found = [str(n.kwargs["device"]) for n in subgraph.graph.nodes if "device" in n.kwargs]
    return found + [str(n.args[1]) for n in subgraph.graph.nodes if n.op == "call_method"]


def test_a_subgraph_shared_by_ops_on_two_devices_gets_a_copy_per_device() -> None:
    root = torch.nn.Module()
    root.sub = _subgraph()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(call, (graph.get_attr("sub"), x))
    second = graph.call_function(call, (graph.get_attr("sub"), first))
    graph.output(second)
    module = torch.fx.GraphModule(root, graph)
    pin_subgraph_devices(module, {first.name: "cpu:0", second.name: "cpu:1"})
    module.recompile()
    targets = [
        a.target for n in module.graph.nodes if n.op == "call_function" for a in n.all_input_nodes if a.op == "get_attr"
    ]
    assert targets[0] == "sub" and targets[1] != "sub"
    assert _devices(module.sub) == ["cpu:0", "cpu:0"]
    assert _devices(getattr(module, targets[1])) == ["cpu:1", "cpu:1"]
    torch.testing.assert_close(module(torch.zeros(2)), torch.full((2,), 2.0))
