"""Plans of whole models (fxsplit.planning.build): where every node, weight and copy goes, unread tensors too."""

from __future__ import annotations

import itertools
from typing import Sequence

import pytest
import torch
import torch.fx
import torch.nn as nn
from helpers import split_and_compare

from fxsplit.cost.build import GraphCosts, build_problem
from fxsplit.errors import BudgetError
from fxsplit.options import Budgets
from fxsplit.partition.refine import device_loads
from fxsplit.partition.solve import Partition, partition
from fxsplit.planning.build import make_plan, reads_of, weights_by_node
from fxsplit.planning.unread import unread_weights
from fxsplit.tracing.capture import trace


class WithSpare(nn.Module):
    """Four 256-byte layers in a chain and a 512-byte layer that forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(8, 8, bias=False) for _ in range(4)))
        self.spare = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def some_packing_fits(sizes: list[int], budgets: list[int]) -> bool:
    """Brute force: whether the tensors can be spread over the devices at all."""
    for homes in itertools.product(range(len(budgets)), repeat=len(sizes)):
        loads = [0] * len(budgets)
        for size, home in zip(sizes, homes, strict=True):
            loads[home] += size
        if all(load <= budget for load, budget in zip(loads, budgets, strict=True)):
            return True
    return False


def test_tensors_no_op_reads_are_packed_with_the_rest() -> None:
    """Splitting the layers 2 + 2 (the balanced cut) leaves two 288-byte gaps where the 512-byte spare fits
    neither; 1 + 3 with the spare beside the single layer fits. The spare must not be packed last."""
    model = WithSpare()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    budgets = {"cpu:0": 800, "cpu:1": 800}
    assert some_packing_fits(sizes, list(budgets.values()))
    gm = split_and_compare(model, budgets, (torch.randn(3, 8),))
    plan = gm.meta["fxsplit_plan"]
    for device, budget in budgets.items():
        assert plan.device_bytes[device] <= budget
    assert sum(plan.device_bytes.values()) == sum(sizes)
    assert [c.nbytes for c in plan.cuts if c.kind == "activation"] == [3 * 8 * 4]  # still one cut


class NarrowThenWide(nn.Module):
    """A 32 KiB layer with a narrow output, two 8 KiB layers with a wider one between them, and an unused
    submodule of two 16 KiB layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 32, bias=False)
        self.b = nn.Linear(32, 64, bias=False)
        self.c = nn.Linear(64, 32, bias=False)
        self.aux = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


@pytest.mark.parametrize("trace_mode", ["fx", "export"])
def test_an_unused_submodule_is_packed_with_the_ops_not_into_what_they_leave(trace_mode: str) -> None:
    """Alone, the ops split after 'a' (the narrow output): 32 + 16 KiB, leaving gaps of 8 and 24 KiB where
    one unused 16 KiB layer fits and the other does not; room set aside on the device with the most room
    (16 KiB on each) leaves no device that holds 'a'. Packed together: 'a' and 'b' fill one device, 'c'
    and the unused submodule the other, and b's output (4 x 64 floats) is the one copy. Was refused."""
    model = NarrowThenWide()
    budgets = {"cpu:0": 40 * 1024, "cpu:1": 40 * 1024}
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    assert sum(sizes) == sum(budgets.values())  # no slack at all
    gm = split_and_compare(model, budgets, (torch.randn(4, 256),), trace=trace_mode, mode="weights")
    plan = gm.meta["fxsplit_plan"]
    assert plan.device_bytes == budgets
    assert plan.param_devices["aux.0.weight"] == plan.param_devices["aux.1.weight"] == plan.param_devices["c.weight"]
    assert plan.param_devices["a.weight"] == plan.param_devices["b.weight"] != plan.param_devices["c.weight"]
    assert plan.transfer_bytes == 4 * 64 * 4


# -- make_plan, reads_of, unread_weights on one hand-chosen placement (fxsplit.planning.build) ----------------


class TiedWithSpare(nn.Module):
    """Embedding and head share a weight; 'spare' is never called; forward also returns a size."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.spare = nn.Linear(3, 3)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        h = self.embed(ids)
        return self.head(torch.tanh(self.body(h))), h.shape[0]


DEVICES = ["cpu:0", "cpu:1"]
ROOMY = {"cpu:0": 10**6, "cpu:1": 10**6}


def costs_and_graph(trace_mode: str = "fx") -> tuple[GraphCosts, torch.fx.GraphModule]:
    model = TiedWithSpare()
    traced = trace(model, example_inputs=(torch.randint(0, 10, (2, 3)),), mode=trace_mode)
    return build_problem(traced.graph_module, model, device_index={}), traced.graph_module


def placed(costs: GraphCosts, op_devices: list[int]) -> Partition:
    return Partition(tuple(op_devices), 0, tuple(device_loads(costs.problem, op_devices, 2)))


def test_make_plan_places_every_node_and_names_each_copy_once() -> None:
    costs, graph_module = costs_and_graph()
    assert [op.name for op in costs.ops] == ["embed", "body", "tanh", "head", "getattr_1", "getitem"]
    plan = make_plan(
        costs,
        graph_module,
        placed(costs, [0, 0, 0, 1, 0, 0]),
        Budgets(ROOMY),
        output_device=None,
        trace="fx",
        objective="min_transfer",
    )
    assert set(plan.placement) == {node.name for node in graph_module.graph.nodes}
    assert plan.placement["ids"] == "cpu:0"  # an input goes where its first reader runs
    assert plan.output_device == plan.placement["output"] == "cpu:0"  # by default, the last op's device
    assert plan.param_devices["embed.weight"] == plan.param_devices["head.weight"] == "cpu:0"  # tied: one home
    assert plan.param_devices["spare.weight"] in DEVICES  # read by nothing, placed all the same
    assert plan.device_bytes == {"cpu:0": 10 * 4 * 4 + 16 * 4 + 4 * 4 + 12 * 4, "cpu:1": 0}
    assert [(c.producer, c.source, c.destination, c.nbytes, c.kind) for c in plan.cuts] == [
        ("tanh", "cpu:0", "cpu:1", 2 * 3 * 4 * 4, "activation"),
        ("embed.weight", "cpu:0", "cpu:1", 10 * 4 * 4, "parameter"),  # the head reads the tied weight there
        ("head", "cpu:1", "cpu:0", 2 * 3 * 10 * 4, "output"),  # back to the output device
    ]
    assert plan.modules == {"cpu:0": ("embed", "body"), "cpu:1": ("head",)}


def test_make_plan_copies_outputs_to_the_output_device() -> None:
    costs, graph_module = costs_and_graph("export")
    plan = make_plan(
        costs,
        graph_module,
        placed(costs, [0, 0, 1, 1]),
        Budgets(ROOMY),
        output_device="cpu:0",
        trace="export",
        objective="min_transfer",
    )
    assert plan.placement["_guards_fn"] == plan.placement["ids"] == "cpu:0"  # export's input check: with the inputs
    assert plan.placement["output"] == "cpu:0"
    assert [(c.producer, c.kind) for c in plan.cuts] == [
        ("linear", "activation"),
        ("embed.weight", "parameter"),
        ("linear_1", "output"),
    ]


def test_reads_of_lists_tensors_and_the_weights_a_module_call_reads() -> None:
    costs, graph_module = costs_and_graph()
    nodes = {node.name: node for node in graph_module.graph.nodes}
    by_node = weights_by_node(costs)
    assert [(r.key, r.kind, r.node is None) for r in reads_of(nodes["head"], by_node)] == [
        ("tanh", "activation", False),
        ("embed.weight", "parameter", True),  # through the module: no graph node to name
    ]
    assert [(r.key, r.kind) for r in reads_of(nodes["embed"], by_node)] == [
        ("ids", "input"),
        ("embed.weight", "parameter"),
    ]
    assert [(r.key, r.kind) for r in reads_of(nodes["output"], by_node)] == [("head", "output")]  # the int is no copy
    export_costs, export_graph = costs_and_graph("export")
    guard = next(node for node in export_graph.graph.nodes if node.name == "_guards_fn")
    assert reads_of(guard, weights_by_node(export_costs)) == []


def test_tensors_no_op_reads_that_fit_nowhere_are_named() -> None:
    costs, graph_module = costs_and_graph()
    assert [w.names for w in unread_weights(costs)] == [("spare.weight",), ("spare.bias",)]
    solution = placed(costs, [0, 0, 0, 1, 0, 0])
    tight = {"cpu:0": solution.device_weights[0] + 10, "cpu:1": solution.device_weights[1] + 10}
    with pytest.raises(BudgetError) as info:
        make_plan(costs, graph_module, solution, Budgets(tight), output_device=None, trace="fx", objective="balanced")
    assert str(info.value) == (
        "the tensors no op of the graph reads (48 B: 'spare.weight' 36 B, 'spare.bias' 12 B) do not fit what the "
        "budgets leave ('cpu:0' 10 B, 'cpu:1' 10 B); raise a budget by 36 B or more, or delete the unused tensors"
    )


def test_room_is_set_aside_for_tensors_no_op_reads_when_a_repartition_is_allowed() -> None:
    costs, graph_module = costs_and_graph()
    solution = placed(costs, [0, 1, 1, 1, 1, 1])  # the embedding (160 B) on cpu:0, the body (80 B) on cpu:1
    budgets = {"cpu:0": 190, "cpu:1": 110}  # 30 B left on each: the spare's 36 B weight fits neither gap
    asked: list[list[int]] = []

    def repartition(room: Sequence[int]) -> Partition:
        asked.append(list(room))
        return partition(costs.problem, room)

    with pytest.raises(BudgetError) as info:
        make_plan(
            costs,
            graph_module,
            solution,
            Budgets(budgets),
            output_device=None,
            trace="fx",
            objective="min_transfer",
            repartition=repartition,
        )
    # room for the spare (36 + 12 B) set aside three distinct ways, the ops partitioned into what is left each
    # time: the weight where there is most room and the bias into a gap; both where there is most room; both on
    # cpu:1 first (cpu:0 first is the same as the second)
    assert asked == [[190 - 36, 110 - 12], [190 - 48, 110], [190, 110 - 48]]
    assert str(info.value).startswith(
        "the ops fit the budgets only if the 48 B of tensors no op reads ('spare.weight' 36 B, 'spare.bias' 12 B) "
        "are left out; with room set aside for them first: "
    )


class TwoTowers(nn.Module):
    """Two towers, each returning its states: the first's are 64 times the second's."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Sequential(nn.Linear(16, 256), nn.Linear(256, 256))
        self.small = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.big(x), self.small(x)


@pytest.mark.parametrize("trace_mode", ["fx", "export"])
def test_outputs_go_where_most_of_their_bytes_already_are(trace_mode: str) -> None:
    """Found by an outside check on CLIP: the outputs went to the last op's device, so the first tower's states
    were copied there (8,704 B a forward on CLIP, where 256 B crossed between the ops). By default they now go
    where the ops put most of their bytes; stages in order (contiguous=True, pipelines) still return them from
    the last."""
    import fxsplit

    model, x = TwoTowers().eval(), torch.randn(8, 16)
    budgets = {"cpu:0": "1MiB", "cpu:1": "1MiB"}
    pins = {"big": "cpu:0", "small": "cpu:1"}
    free = fxsplit.plan(model, budgets, example_inputs=(x,), trace=trace_mode, pins=pins, mode="weights")
    assert free.output_device == free.placement["output"] == "cpu:0"
    assert [(c.kind, c.nbytes) for c in free.cuts if c.kind == "output"] == [("output", 8 * 4 * 4)]
    in_order = fxsplit.plan(
        model, budgets, example_inputs=(x,), trace=trace_mode, pins=pins, mode="weights", contiguous=True
    )
    assert in_order.output_device == "cpu:1"
    assert [(c.kind, c.nbytes) for c in in_order.cuts if c.kind == "output"] == [("output", 8 * 256 * 4)]
    split_and_compare(model, budgets, (x,), trace=trace_mode, pins=pins, mode="weights")
