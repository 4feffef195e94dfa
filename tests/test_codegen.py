"""The generated code: exact text for a small model, determinism, where copies go, device rewrites."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxsplit
from fxsplit.api import trace_and_plan
from fxsplit.check import DeviceChecker, verify_split
from fxsplit.codegen.emitter import COPY_META, ExportedSplit
from fxsplit.codegen.weights import weights_read
from fxsplit.cost.build import Weight
from fxsplit.planning.build import weights_by_node

# One Linear(4, 4) (80 bytes) per device. These tests are about the code and the copies, so they plan
# with mode="weights": the budgets count parameters only, not activations.
BUDGETS = {"cpu:0": 80, "cpu:1": 80, "cpu:2": 80}


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x))
        return self.c(self.b(h)) + h + y


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 4), torch.randn(2, 4)


EXPECTED_WITH_SHAPES = """
def forward(self, x : torch.Tensor, y : torch.Tensor) -> torch.Tensor:
    to = x.to('cpu:0');  x = None
    a = self.a(to);  to = None
    relu = torch.nn.functional.relu(a, inplace = False);  a = None
    to_1 = relu.to('cpu:1')
    b = self.b(to_1);  to_1 = None
    to_2 = b.to('cpu:2');  b = None
    c = self.c(to_2);  to_2 = None
    to_3 = relu.to('cpu:2');  relu = None
    add = c + to_3;  c = to_3 = None
    to_4 = y.to('cpu:2');  y = None
    add_1 = add + to_4;  add = to_4 = None
    return add_1
"""

# Without example inputs fx knows no shapes: values not known to be tensors go through runtime.move.
EXPECTED_WITHOUT_SHAPES = """
def forward(self, x : torch.Tensor, y : torch.Tensor) -> torch.Tensor:
    move = fxsplit_runtime_move(x, 'cpu:0');  x = None
    a = self.a(move);  move = None
    relu = torch.nn.functional.relu(a, inplace = False);  a = None
    move_1 = fxsplit_runtime_move(relu, 'cpu:1')
    b = self.b(move_1);  move_1 = None
    to = b.to('cpu:2');  b = None
    c = self.c(to);  to = None
    move_2 = fxsplit_runtime_move(relu, 'cpu:2');  relu = None
    add = c + move_2;  c = move_2 = None
    move_3 = fxsplit_runtime_move(y, 'cpu:2');  y = None
    add_1 = add + move_3;  add = move_3 = None
    return add_1
"""


def test_expected_code_with_shapes() -> None:
    gm = fxsplit.fxsplit(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="fx")
    assert gm.code.strip() == EXPECTED_WITH_SHAPES.strip()
    plan = gm.meta["fxsplit_plan"]
    assert [(c.producer, c.source, c.destination, c.nbytes, c.kind) for c in plan.cuts] == [
        ("relu", "cpu:0", "cpu:1", 32, "activation"),
        ("b", "cpu:1", "cpu:2", 32, "activation"),
        ("relu", "cpu:0", "cpu:2", 32, "activation"),
    ]
    assert plan.transfer_bytes == 96
    assert str(plan).splitlines()[4] == "cuts: 3, transfer per forward: 96 B; outputs on cpu:2"  # then memory


def test_expected_code_without_shapes() -> None:
    gm = fxsplit.fxsplit(Small(), BUDGETS, mode="weights", trace="fx")
    assert gm.code.strip() == EXPECTED_WITHOUT_SHAPES.strip()
    assert all(c.nbytes is None for c in gm.meta["fxsplit_plan"].cuts)
    verify_split(gm)


def test_string_annotations_print_as_types_and_the_split_pickles() -> None:
    # this file has `from __future__ import annotations`: fx saw 'torch.Tensor' as a string, printed it as
    # `x : _torch_Tensor_` and could not pickle the split
    torch.manual_seed(0)
    model, (x, y) = Small(), inputs()
    reference = Small()
    reference.load_state_dict(model.state_dict())
    gm = fxsplit.fxsplit(model, BUDGETS, mode="weights", example_inputs=(x, y), trace="fx")
    assert "_torch_Tensor_" not in gm.code
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    out, expected = loaded(x, y), reference(x, y)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    grads = dict(reference.named_parameters())
    for name, parameter in loaded.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name].grad)


def test_an_annotation_fx_cannot_name_is_dropped() -> None:
    class Hinted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: Optional[torch.Tensor]) -> tuple[torch.Tensor, int]:  # noqa: UP045 - a string here
            return self.b(self.a(x)), 1

    gm = fxsplit.fxsplit(Hinted(), {"cpu:0": 80, "cpu:1": 80}, mode="weights", trace="fx")
    assert gm.code.split("\n", 4)[3] == "def forward(self, x):"
    torch.save(gm, io.BytesIO())


def test_plan_table() -> None:
    plan = fxsplit.plan(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="fx")
    assert str(plan).splitlines()[:4] == [
        "device  budget  weights  % budget  modules  in    out",
        "cpu:0   80 B    80 B     100.0     a        0 B   64 B",
        "cpu:1   80 B    80 B     100.0     b        32 B  32 B",
        "cpu:2   80 B    80 B     100.0     c        64 B  0 B",
    ]


def test_plan_says_why_devices_are_empty_and_which_option_spreads_the_model() -> None:
    roomy = {"cpu:0": "1KiB", "cpu:1": "1KiB", "cpu:2": "1KiB"}
    plan = fxsplit.plan(Small(), roomy, mode="weights", example_inputs=inputs(), trace="fx")
    assert set(plan.placement.values()) == {"cpu:0"}
    assert (
        "empty: cpu:1, cpu:2: the model fits on the other device(s), and leaving them empty copies the fewest "
        "bytes; objective='balanced' spreads the model over every device, objective='throughput' makes the "
        "fastest pipeline of them"
    ) in str(plan).splitlines()
    spread = fxsplit.plan(Small(), roomy, mode="weights", example_inputs=inputs(), trace="fx", objective="balanced")
    assert len(set(spread.placement.values())) == 3 and "empty:" not in str(spread)
    assert "empty:" not in str(fxsplit.plan(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="fx"))


def test_memory_percentages_are_of_what_planning_could_use() -> None:
    budgets = {"cpu:0": "1KiB", "cpu:1": "1KiB"}
    plan = fxsplit.plan(Small(), budgets, example_inputs=inputs(), trace="fx", reserve="50%")
    header, *rows = str(plan).split("memory", 1)[1].splitlines()
    assert header.split("  ")[-1] == "% usable"
    for row in rows:
        device, *_, percent = row.split()
        assert plan.memory[device]["total"] == 0 or float(percent) == pytest.approx(
            100 * plan.memory[device]["total"] / 512, abs=0.05
        )


def test_same_input_same_code_and_plan() -> None:
    first = fxsplit.fxsplit(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="fx")
    second = fxsplit.fxsplit(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="fx")
    assert first.code == second.code
    assert first.meta["fxsplit_plan"] == second.meta["fxsplit_plan"]
    for trace in ("export", "fx"):
        one = fxsplit.plan(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace=trace)
        two = fxsplit.plan(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace=trace)
        assert one == two and one.to_dict() == two.to_dict()
        assert fxsplit.Plan.from_dict(json.loads(json.dumps(one.to_dict()))) == one  # plain data, round trip


_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    import fxsplit
    from test_codegen import BUDGETS, Small, inputs
    gm = fxsplit.fxsplit(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="fx")
    print(json.dumps({{"code": gm.code, "plan": gm.meta["fxsplit_plan"].to_dict()}}))
    """
)


@pytest.mark.slow  # fresh interpreters: ~15 s
def test_deterministic_across_processes() -> None:
    """Another interpreter with another hash seed makes byte-identical code and plan."""
    here = fxsplit.fxsplit(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="fx")
    script = _SCRIPT.format(tests=os.path.dirname(__file__))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert there["code"] == here.code
    assert there["plan"] == json.loads(json.dumps(here.meta["fxsplit_plan"].to_dict()))


def test_copies_sit_right_before_their_first_reader() -> None:
    gm = fxsplit.fxsplit(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="fx")
    nodes = list(gm.graph.nodes)
    for i, node in enumerate(nodes):
        if COPY_META not in node.meta:
            continue
        first_user = min(nodes.index(u) for u in node.users)
        between = nodes[i + 1 : first_user]
        assert all(COPY_META in n.meta for n in between), (node.name, [n.name for n in between])


def test_input_goes_to_the_device_of_its_first_use() -> None:
    gm = fxsplit.fxsplit(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="fx")
    plan = gm.meta["fxsplit_plan"]
    assert plan.placement["x"] == "cpu:0" and plan.placement["y"] == "cpu:2"
    copies = {n.meta[COPY_META] for n in gm.graph.nodes if COPY_META in n.meta}
    assert ("y", None, "cpu:2") in copies  # straight there, not through cpu:0


def test_an_input_read_on_two_devices_is_copied_from_its_first_device() -> None:
    class TwoUses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) * x

    gm = fxsplit.fxsplit(
        TwoUses(), {"cpu:0": 80, "cpu:1": 80}, mode="weights", example_inputs=(torch.randn(2, 4),), trace="fx"
    )
    copies = [n.meta[COPY_META] for n in gm.graph.nodes if COPY_META in n.meta]
    assert copies == [("x", None, "cpu:0"), ("a", "cpu:0", "cpu:1"), ("x", "cpu:0", "cpu:1")]
    assert [(c.producer, c.source, c.destination) for c in copies] == copies  # CopyRecords, read by field name
    assert [(c.producer, c.kind) for c in gm.meta["fxsplit_plan"].cuts] == [("a", "activation"), ("x", "input")]
    verify_split(gm)


def test_export_input_goes_straight_to_the_device_of_its_first_real_use() -> None:
    plan = fxsplit.plan(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="export")
    fx_plan = fxsplit.plan(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="fx")
    assert plan.placement["y"] == "cpu:2"
    assert plan.transfer_bytes == fx_plan.transfer_bytes == 96


class CudaInside(nn.Module):
    """Moves to the GPU and back inside forward; the split must run on its own devices instead."""

    def __init__(self, use_cuda: bool) -> None:
        super().__init__()
        self.use_cuda = use_cuda
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h.cuda() if self.use_cuda else h
        h = self.b(h).cpu() + torch.ones(4, device=h.device)
        return self.c(h.to(device="cpu"))


def test_hard_coded_devices_are_rewritten_to_the_stage() -> None:
    torch.manual_seed(0)
    model = CudaInside(use_cuda=True)
    reference = CudaInside(use_cuda=False)
    reference.load_state_dict(model.state_dict())
    gm = fxsplit.fxsplit(model, BUDGETS, mode="weights", example_inputs=(torch.randn(2, 4),), trace="fx")
    assert ".cuda(" not in gm.code and ".cpu(" not in gm.code
    assert re.search(r"'cpu'(?!, index=)", gm.code) is None, gm.code  # no bare 'cpu' left
    assert "torch.ones(4, device = device(type='cpu', index=1))" in gm.code
    assert "cuda = a.to('cpu:0')" in gm.code  # .cuda() on the first stage
    assert "to = add.to(device = 'cpu:1')" in gm.code  # .to(device="cpu") on the second
    verify_split(gm)
    x = torch.randn(2, 4)
    with DeviceChecker(gm.meta["fxsplit_plan"], gm):
        out = gm(x)
    torch.testing.assert_close(out, reference(x))


def test_export_split_is_an_exported_split_and_lints() -> None:
    gm = fxsplit.fxsplit(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="export")
    assert isinstance(gm, ExportedSplit)
    gm.graph.lint()
    verify_split(gm)
    fx_gm = fxsplit.fxsplit(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="fx")
    assert isinstance(fx_gm, torch.fx.GraphModule) and not isinstance(fx_gm, ExportedSplit)
    assert fx_gm.meta["fxsplit_plan"].param_devices == gm.meta["fxsplit_plan"].param_devices


class SharedTable(nn.Module):
    """One tensor under three names; its canonical (first) name is a module the graph never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.mid = nn.Linear(4, 4)
        self.embed = nn.Embedding(10, 4)
        self.embed.weight = self.shared.weight
        self.head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.embed(ids))))


def _named(by_node: dict[str, list[Weight]]) -> dict[str, list[tuple[tuple[str, ...], tuple[str, ...]]]]:
    return {node: [(w.names, w.nodes) for w in weights] for node, weights in by_node.items()}


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_the_graph_and_the_plan_alone_say_which_weights_each_node_reads(trace: str) -> None:
    ids = torch.randint(0, 10, (8, 6))  # activations larger than the table: the table is copied to the head
    budgets = {"cpu:0": 200, "cpu:1": 200}
    planned = trace_and_plan(SharedTable(), budgets, (ids,), {"trace": trace, "mode": "weights"})
    read = weights_read(planned.traced.graph_module, planned.plan)
    assert _named(read) == _named(weights_by_node(planned.costs))  # what the costs the plan was made from say
    assert {w.names for ws in read.values() for w in ws} >= {("shared.weight", "head.weight", "embed.weight")}
    model = SharedTable()
    gm = fxsplit.fxsplit(model, budgets, example_inputs=(ids,), trace=trace, mode="weights", check=True)
    torch.testing.assert_close(gm(ids), model(ids))
    cuts = [(c.producer, c.kind) for c in gm.meta["fxsplit_plan"].cuts]
    assert ("shared.weight", "parameter") in cuts  # check=True: the code's copy has the key the plan's cut has


def test_deep_copy_of_an_export_split_is_quiet_and_equal() -> None:
    gm = fxsplit.fxsplit(Small(), BUDGETS, mode="weights", example_inputs=inputs(), trace="export")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's pytree spec warned (FutureWarning, LeafSpec) when copied
        copied = copy.deepcopy(gm)
    assert type(copied).__mro__[1] is type(gm).__mro__[1]  # still an ExportedSplit (its train() guard kept)
    x, y = inputs()
    torch.testing.assert_close(copied(x, y), gm(x, y))


def test_a_plan_without_sizes_says_its_transfer_is_unknown_not_zero() -> None:
    plan = fxsplit.plan(Small(), BUDGETS, mode="weights", trace="fx")  # no example inputs: no sizes
    assert any(cut.nbytes is None for cut in plan.cuts)
    line = next(line for line in str(plan).splitlines() if line.startswith("cuts:"))
    assert "transfer per forward: unknown (" in line and "0 B" not in line
