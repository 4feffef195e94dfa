"""Running a split node by node: torch.fx.Interpreter and fxsplit.memory.measure on splits with every kind of node."""

from __future__ import annotations

import copy

import torch
from helpers import LiveBytes, Tied, assert_same_grads, budgets_for
from torch import nn

import fxsplit
from fxsplit import runtime
from fxsplit.memory.measure import measure_forward, measure_training


def _tied_split() -> tuple[nn.Module, nn.Module, torch.fx.GraphModule, torch.Tensor]:
    """A split whose head runs away from its tied weight: the head is called with a copy of the weight."""
    torch.manual_seed(0)
    model = Tied()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 40, (3, 7))
    gm = fxsplit.fxsplit(
        model,
        budgets_for(model, 2),
        example_inputs=(ids,),
        trace="fx",
        contiguous=True,
        mode="weights",
        replicate=False,
    )  # replicate=False: copied, not held on both (tests/test_replication.py)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is runtime.call_with_weights]
    assert len(calls) == 1 and [c.kind for c in gm.meta["fxsplit_plan"].cuts].count("parameter") == 1
    return model, reference, gm, ids


def test_split_calling_a_module_with_copied_weights_runs_under_the_interpreter() -> None:
    model, reference, gm, ids = _tied_split()
    out = torch.fx.Interpreter(gm).run(ids)
    expected = reference(ids)
    torch.testing.assert_close(out, expected)
    out.square().mean().backward()
    expected.square().mean().backward()
    assert_same_grads(model, reference)
    torch.testing.assert_close(gm(ids), expected)  # the generated code too


def test_measuring_a_split_that_calls_a_module_with_copied_weights() -> None:
    _, _, gm, ids = _tied_split()
    with torch.no_grad():
        forward = measure_forward(gm, ids)
    assert set(forward) == {"cpu:0", "cpu:1"} and all(forward.values())
    training = measure_training(gm, ids)
    assert all(training[d] >= forward[d] for d in forward)


class _DeadValue(nn.Module):
    """A chain with a value nobody reads: the real forward frees it at once."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y * 2  # noqa: B018 - computed and dropped, as models sometimes do
        return self.c(self.b(torch.relu(y)))


def test_measured_peak_frees_values_nobody_reads() -> None:
    """Two activations of 32 x 64 floats are alive at once on each device, never three."""
    torch.manual_seed(0)
    model, x = _DeadValue().eval(), torch.randn(32, 64)
    two_activations = 2 * 32 * 64 * 4
    for trace in ("fx", "export"):
        gm = fxsplit.fxsplit(
            model, {"cpu:0": "64KiB", "cpu:1": "64KiB"}, example_inputs=(x,), trace=trace, mode="inference"
        )
        assert len(set(gm.meta["fxsplit_plan"].placement.values())) == 2
        assert measure_forward(gm, x) == {"cpu:0": two_activations, "cpu:1": two_activations}, trace


def test_measured_peak_matches_an_independent_meter_on_the_real_forward() -> None:
    torch.manual_seed(0)
    model, x = _DeadValue().eval(), torch.randn(32, 64)
    gm = fxsplit.fxsplit(model, {"cpu:0": "1MiB"}, example_inputs=(x,), trace="fx", mode="inference")
    meter = LiveBytes([*gm.parameters(), *gm.buffers(), x])
    with torch.no_grad(), meter:
        gm(x)  # the generated code, not an interpreter
    assert meter.peak == 2 * 32 * 64 * 4
    assert measure_forward(gm, x) == {"cpu:0": meter.peak}
