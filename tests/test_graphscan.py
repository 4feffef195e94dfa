"""The cost model's one-pass readers agree with the per-node functions they replace.

:func:`fxsplit.cost.scan.scan_graph` (ops, labels, tensor reads),
:func:`fxsplit.tracing.writers.writing_ops` (in-place writes, asked only of ops
that can write) and :class:`fxsplit.cost.walk.ModulePaths` (modules found by
path when asked) are fast paths for planning graphs of 100k ops; each is
checked here against the plain definition on models that exercise what it
skips: every kind of in-place write, tied and shared weights, buffers, export
guards, get_attr constants.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxsplit.attrpath import attr_at
from fxsplit.cost.build import model_tensors, tensor_reads
from fxsplit.cost.scan import scan_graph
from fxsplit.cost.walk import ModulePaths, module_table
from fxsplit.tracing.capture import trace
from fxsplit.tracing.graphinfo import is_guard, module_path, mutated_inputs
from fxsplit.tracing.writers import writing_ops
from tests.test_graphinfo import Opaque, WithNorm, Writes
from tests.test_inplace_inputs import MODELS as INPUT_WRITERS
from tests.test_inplace_inputs import _inputs
from tests.test_mutation import ALIASES, WriteThroughAlias


class Shared(nn.Module):
    """A tied weight, a module called twice, a buffer read by a submodule with children, an unused module,
    a constant read by ``get_attr``, positional ``inplace`` and an ``out=`` write."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.spare = nn.Linear(2, 2)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).sum(1)
        h = self.block(h) + self.block(h) * self.scale
        h = F.relu(h, True)
        torch.mul(h.detach(), 2, out=out)
        return self.head(F.gelu(h)) + out.sum()


def _shared_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 10, (3, 5)), torch.zeros(3, 4)


CASES: list[tuple[str, Callable[[], nn.Module], Callable[[], tuple[Any, ...]], str]] = [
    ("writes", Writes, lambda: (torch.randn(3, 4), torch.randn(3, 4)), "fx"),
    ("norm-fx", WithNorm, lambda: (torch.randn(3, 4),), "fx"),
    ("norm-export", WithNorm, lambda: (torch.randn(3, 4),), "export"),
    ("shared-fx", Shared, _shared_inputs, "fx"),
    ("shared-export", Shared, _shared_inputs, "export"),
    *[(f"{m.__name__}-{t}", m, _inputs, t) for m, t in INPUT_WRITERS],
    *[
        (f"alias-{a}-{t}", lambda a=a: WriteThroughAlias(a), lambda: (torch.randn(2, 4),), t)
        for a in ALIASES
        for t in ("fx", "export")
    ],
]


@pytest.fixture(params=CASES, ids=[case[0] for case in CASES])
def traced(request: pytest.FixtureRequest) -> tuple[nn.Module, torch.fx.GraphModule]:
    _, make, inputs, mode = request.param
    model = make().eval() if mode == "export" else make()
    leaves = [Opaque] if make is Writes else []
    return model, trace(model, example_inputs=inputs(), mode=mode, leaf_modules=leaves).graph_module


def test_writing_ops_are_the_ops_that_mutate_an_input(traced: tuple[nn.Module, torch.fx.GraphModule]) -> None:
    _, graph_module = traced
    table = module_table(graph_module)
    ops = [n for n in graph_module.graph.nodes if n.op not in ("placeholder", "get_attr", "output") and not is_guard(n)]
    expected = {node: found for node in ops if (found := mutated_inputs(node, table))}
    assert writing_ops(ops, ModulePaths(graph_module)) == expected


def test_the_scan_finds_what_the_per_node_functions_find(traced: tuple[nn.Module, torch.fx.GraphModule]) -> None:
    model, graph_module = traced
    known = model_tensors(model)
    scan = scan_graph(graph_module, ModulePaths(graph_module), known)
    ops = [n for n in graph_module.graph.nodes if n.op not in ("placeholder", "get_attr", "output") and not is_guard(n)]
    assert scan.ops == ops and scan.index == {node: i for i, node in enumerate(ops)}
    assert scan.labels == tuple(module_path(node) for node in ops)
    assert scan.valued == [n for n in graph_module.graph.nodes if n.op == "placeholder" or n in scan.index]

    expected: dict[int, tuple[list[str], torch.Tensor, bool, set[int], list[str]]] = {}
    buffers = set()
    for node, path, tensor in tensor_reads(graph_module):
        key = id(tensor)
        names, _, is_buffer = known.get(key) or ([path], tensor, not isinstance(tensor, nn.Parameter))
        entry = expected.setdefault(key, (names, tensor, is_buffer, set(), []))
        if node.op == "get_attr":
            entry[3].update(scan.index[u] for u in node.users if u in scan.index)
        else:
            entry[3].add(scan.index[node])
            if not isinstance(tensor, nn.Parameter) and node.op == "call_module":
                buffers.add(key)
        entry[4].append(node.name)
    assert list(scan.read) == list(expected)  # first-read order
    for key, (names, tensor, is_buffer, readers, nodes) in expected.items():
        found = scan.read[key]
        assert (found[0], found[1], found[2], set(found[3]), found[4]) == (names, tensor, is_buffer, readers, nodes)
    assert scan.module_buffers == buffers
    assert scan.known_read == sum(1 for key in expected if key in known)


def test_module_paths_find_every_module_of_the_table_and_refuse_others() -> None:
    model = Shared()
    shared = nn.Linear(2, 2)
    model.add_module("again", shared)
    model.block.add_module("inner", shared)  # one module under two paths: the table lists its first only
    paths = ModulePaths(model)
    table = module_table(model)
    assert all(paths[path] is module for path, module in table.items())
    assert paths["block.inner"] is shared and paths.get("block.inner") is shared
    assert paths.get("block.missing") is None and "embed.weight" not in paths  # a parameter is not a module
    with pytest.raises(KeyError):
        paths["nothing.here"]
    assert dict(paths) == table and len(paths) == len(table)


def test_module_paths_reach_every_attribute_as_attr_at_does() -> None:
    model = Shared()
    model.block[0].register_parameter("extra", None)  # a parameter slot holding None
    model.block[0].plain = torch.ones(2)  # a tensor attribute that is neither parameter nor buffer
    paths = ModulePaths(model)
    names = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()]
    for path in [*names, "block.0.plain", "block.0.extra", "block.0", "block", "scale", "head.weight"]:
        assert paths.attribute(path) is attr_at(model, path), path
    assert paths.attribute("head.weight") is model.embed.weight  # tied: one tensor under both names
    for missing in ("block.0.nothing", "nothing.weight", "block.0.extra.shape"):
        with pytest.raises(AttributeError) as found:
            paths.attribute(missing)
        with pytest.raises(AttributeError) as expected:
            attr_at(model, missing)
        assert str(found.value) == str(expected.value)
