"""Grad-mode regions in forward (no_grad, enable_grad, set_grad_enabled) survive tracing and splitting.

torch.fx used to drop them, so parameters used only under ``no_grad`` got
gradients. Every test compares outputs and each parameter's gradient (None
where eager has none) with the unsplit model, on both trace routes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import CPUS, split_and_compare

import fxsplit
from fxsplit.errors import FxsplitError, TraceError

TRACES = ("fx", "export")


def block(width: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))


class FrozenEncoder(nn.Module):
    """A frozen feature extractor under no_grad, then a trained head: the encoder gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(block(), block())
        self.head = nn.Sequential(block(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = self.encoder(x)
        return self.head(features)


class Nested(nn.Module):
    """enable_grad inside no_grad: only the inner block is trained, and the skip from inside carries none."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = block()
        self.inner = block()
        self.after = block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.frozen(x)
            with torch.enable_grad():
                g = self.inner(h)
            h2 = h * 2 + g  # back under no_grad: no gradient reaches inner through this
        return self.after(g + h2)


class SetGradEnabled(nn.Module):
    """``with torch.set_grad_enabled(False)`` and the bare statement pair."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = block(), block(), block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(False):
            h = self.a(x)
        torch.set_grad_enabled(False)
        h = self.b(h)
        torch.set_grad_enabled(True)
        return self.c(h)


class Decorated(nn.Module):
    """Helper methods decorated with ``@torch.no_grad()`` and ``@torch.no_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = block(), block(), block()

    @torch.no_grad()
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)

    @torch.no_grad
    def refine(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.refine(self.embed(x)) + x)


class ReadInsideAndAfter(nn.Module):
    """A value read under no_grad and again after it, on the same later device.

    A copy made inside the region carries no gradient; reusing it after the
    region would cut the gradient to ``first``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.first = block()
        self.frozen = block()
        self.second = block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        with torch.no_grad():
            side = self.frozen(h)
        return self.second(h) + side


class SpanningRegion(nn.Module):
    """A no_grad region of four blocks, long enough that the cut falls inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = block()
        self.frozen = nn.Sequential(*[block() for _ in range(4)])
        self.head = block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        with torch.no_grad():
            z = self.frozen(h)
        return self.head(z + h)


def _budgets(model: nn.Module, share: int = 2) -> dict[str, int]:
    """Two devices, each holding ``1 / share`` of the parameters and a quarter more."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {d: total // share + total // 4 for d in CPUS[:2]}


def _assert_no_grad_for(model: nn.Module, prefix: str) -> None:
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith(prefix)), prefix


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("make", [FrozenEncoder, Nested, SetGradEnabled, Decorated, ReadInsideAndAfter])
def test_split_matches_eager_outputs_and_gradients(make: type[nn.Module], trace: str) -> None:
    torch.manual_seed(0)
    model = make()
    split_and_compare(model, _budgets(model), (torch.randn(5, 16),), trace=trace, steps=2)


@pytest.mark.parametrize("trace", TRACES)
def test_frozen_encoder_gets_no_gradient(trace: str) -> None:
    torch.manual_seed(0)
    model = FrozenEncoder()
    gm = fxsplit.fxsplit(model, _budgets(model), example_inputs=(torch.randn(3, 16),), trace=trace, mode="weights")
    gm(torch.randn(3, 16)).sum().backward()
    _assert_no_grad_for(model, "encoder.")
    assert all(p.grad is not None for p in model.head.parameters())


def test_region_spanning_the_cut_is_no_grad_on_both_sides() -> None:
    torch.manual_seed(0)
    model = SpanningRegion()
    pins = {"stem": "cpu:0", "frozen.0": "cpu:0", "frozen.3": "cpu:1", "head": "cpu:1"}
    gm = split_and_compare(model, _budgets(model), (torch.randn(4, 16),), trace="fx", pins=pins, steps=2)
    plan = gm.meta["fxsplit_plan"]
    assert {plan.param_devices[f"frozen.{i}.0.weight"] for i in range(4)} == {"cpu:0", "cpu:1"}
    _assert_no_grad_for(model, "frozen.")
    assert gm.code.count("torch._C._set_grad_enabled(") == 2
    saved = next(n for n in gm.graph.nodes if n.target is torch.is_grad_enabled)
    restore = [n for n in gm.graph.nodes if n.target is torch._C._set_grad_enabled][-1]
    assert plan.placement[saved.name] == "cpu:0" and plan.placement[restore.name] == "cpu:1"
    assert restore.args == (saved,)  # the saved mode is a Python bool: read across the cut, never copied
    assert not any(cut.producer == saved.name for cut in plan.cuts)


def test_export_keeps_the_region_as_one_op_on_one_device() -> None:
    """torch.export wraps the region in one higher-order op: the cut falls before or after it, never inside."""
    torch.manual_seed(0)
    model = SpanningRegion()
    gm = split_and_compare(
        model,
        _budgets(model, 1),
        (torch.randn(4, 16),),
        trace="export",
        pins={"stem": "cpu:0", "head": "cpu:1"},
        steps=2,
    )
    plan = gm.meta["fxsplit_plan"]
    regions = [n for n in gm.graph.nodes if "wrap_with_set_grad_enabled" in str(n.target)]
    assert len(regions) == 1 and plan.placement[regions[0].name] in ("cpu:0", "cpu:1")
    _assert_no_grad_for(model, "frozen.")


def test_fx_graph_records_the_region_in_order() -> None:
    gm = fxsplit.fxsplit(FrozenEncoder(), _budgets(FrozenEncoder()), trace="fx", mode="weights")
    lines = [line.strip() for line in gm.code.splitlines()]
    saved = lines.index(next(line for line in lines if "torch.is_grad_enabled()" in line))
    off = lines.index(next(line for line in lines if "_set_grad_enabled(False)" in line))
    first_frozen = lines.index(next(line for line in lines if "self.encoder" in line))
    restore = lines.index(next(line for line in lines if "_set_grad_enabled(is_grad_enabled)" in line))
    first_head = lines.index(next(line for line in lines if "self.head" in line))
    assert saved < off < first_frozen < restore < first_head
    assert not any("grad_enabled" in cut.producer for cut in gm.meta["fxsplit_plan"].cuts)


@pytest.mark.parametrize("trace", TRACES)
def test_called_under_no_grad_stays_no_grad(trace: str) -> None:
    """The region restores the caller's mode, not the mode seen while tracing."""
    model = Nested()
    gm = fxsplit.fxsplit(model, _budgets(model), example_inputs=(torch.randn(2, 16),), trace=trace, mode="weights")
    with torch.no_grad():
        out = gm(torch.randn(2, 16))
        assert not torch.is_grad_enabled()
    expected = copy.deepcopy(model)
    with torch.no_grad():
        reference = expected(torch.randn(2, 16))
    assert out.requires_grad == reference.requires_grad
    assert torch.is_grad_enabled()


def test_tracing_leaves_the_grad_mode_alone() -> None:
    fxsplit.fxsplit(
        SetGradEnabled(), _budgets(SetGradEnabled()), example_inputs=(torch.randn(2, 16),), trace="fx", mode="weights"
    )
    assert torch.is_grad_enabled()


class InferenceMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = block(), block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            h = self.a(x)
        return self.b(h.clone())


@pytest.mark.parametrize("trace", ["fx", "export", "auto"])
def test_inference_mode_is_refused_by_name(trace: str) -> None:
    model = InferenceMode()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(TraceError, match=r"torch\.inference_mode\(True\).*torch\.no_grad\(\)") as caught:
        fxsplit.fxsplit(model, _budgets(model), example_inputs=(torch.randn(2, 16),), trace=trace, mode="weights")
    assert "test_gradmode.py" in str(caught.value)  # names the line of forward()
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_pipeline_refuses_a_region_across_stages() -> None:
    torch.manual_seed(0)
    model = SpanningRegion()
    pins = {"stem": "cpu:0", "frozen.0": "cpu:0", "frozen.3": "cpu:1", "head": "cpu:1"}
    with pytest.raises(FxsplitError, match="grad-mode or autocast region.*spans stages"):
        fxsplit.fxsplit(
            model,
            _budgets(model),
            example_inputs=(torch.randn(4, 16),),
            trace="fx",
            pins=pins,
            mode="weights",
            pipeline=2,
        )


class RaisesInside(nn.Module):
    """An op inside the no_grad region fails on the bad input (a shape mismatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.frozen(x)
        return self.head(h)


def test_an_error_inside_a_region_leaves_the_callers_grad_mode() -> None:
    """As leaving a ``with torch.no_grad()`` by an exception does; else every later step trains nothing."""
    model = RaisesInside()
    gm = fxsplit.fxsplit(model, {"cpu:0": 1200, "cpu:1": 1200}, trace="fx", mode="weights")
    with pytest.raises(RuntimeError):
        gm(torch.randn(2, 8))
    assert torch.is_grad_enabled()
    with pytest.raises(RuntimeError), torch.no_grad():
        gm(torch.randn(2, 8))
    assert torch.is_grad_enabled()
    gm(torch.randn(2, 16)).sum().backward()
    assert model.head.weight.grad is not None and model.frozen.weight.grad is None
