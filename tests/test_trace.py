"""Tracing: fx and export, automatic choice and fallback, leaf modules, concrete_args, no mutation."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers import WithBatchNorm, split_and_compare

import fxsplit
from fxsplit.errors import TraceError
from fxsplit.tracing.capture import trace


class DataDependent(nn.Module):
    """Python control flow on a tensor's shape: fx cannot trace it; export specialises it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.gate = Gate()
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.gate(self.a(x)))


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1000:
            return x
        return x * self.scale


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
        h = self.a(x)
        if double:
            h = h * 2
        return self.b(h)


def test_fx_without_examples_has_no_shapes() -> None:
    traced = trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert traced.method == "fx" and traced.has_shapes is False and traced.notes == ()
    assert [n.op for n in traced.graph_module.graph.nodes] == ["placeholder", "call_module", "call_module", "output"]


def test_fx_with_examples_propagates_shapes() -> None:
    traced = trace(nn.Sequential(nn.Linear(4, 6), nn.ReLU()), example_inputs=(torch.randn(3, 4),), mode="fx")
    assert traced.method == "fx" and traced.has_shapes
    shapes = [tuple(n.meta["val"].shape) for n in traced.graph_module.graph.nodes if n.op == "call_module"]
    assert shapes == [(3, 6), (3, 6)]


def test_auto_picks_export_with_examples() -> None:
    traced = trace(nn.Sequential(nn.Linear(4, 4)), example_inputs=(torch.randn(2, 4),))
    assert traced.method == "export" and traced.has_shapes


def test_auto_falls_back_to_fx_with_a_note() -> None:
    with pytest.warns(fxsplit.FxsplitWarning, match="fxsplit traced it with torch.fx instead"):
        traced = trace(WithBatchNorm(cumulative=True), example_inputs=(torch.randn(4, 8),))
    assert traced.method == "fx"
    assert len(traced.notes) == 1 and traced.notes[0].startswith("torch.export failed, used torch.fx:")


class Signed(nn.Module):
    """Branches on its input's sign in Python: export stops there (a data-dependent guard); fx, told to keep it
    whole (a leaf module), traces around it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("signed: called", file=sys.stderr)  # the model's own output: kept
        return x.relu() if x.sum() > 0 else -x


def test_a_failed_export_prints_no_partial_graph(capfd: pytest.CaptureFixture[str]) -> None:
    """torch prints the partial graph of an export that stops on a data-dependent guard; fxsplit says what
    failed itself, and here traces with fx after: the dump would read as a crash of a call that worked."""
    model = nn.Sequential(nn.Linear(4, 4), Signed(), nn.Linear(4, 4))
    x = torch.ones(2, 4)
    with pytest.warns(fxsplit.FxsplitWarning, match="fxsplit traced it with torch.fx instead"):
        traced = trace(model, example_inputs=(x,), leaf_modules=[Signed])
    assert traced.method == "fx"
    with pytest.raises(TraceError, match="Python control flow on a tensor's value"):
        trace(model, example_inputs=(x,), mode="export")
    err = capfd.readouterr().err
    assert "def forward" not in err and "aten.sum" not in err
    assert err.count("signed: called") >= 2  # what the model printed while exported, each time


def test_trace_never_mutates_the_model() -> None:
    model = WithBatchNorm().train()
    before = copy.deepcopy(model.state_dict())
    params = dict(model.named_parameters())
    for mode in ("fx", "export"):
        traced = trace(model, example_inputs=(torch.randn(4, 8),), mode=mode)
        assert {id(p) for p in traced.graph_module.parameters()} <= {id(p) for p in params.values()}
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert dict(model.named_parameters()) == params and model.training


def test_leaf_module_by_type_and_by_name() -> None:
    torch.manual_seed(0)
    for leaves in ([Gate], ["gate"]):
        traced = trace(DataDependent(), leaf_modules=leaves)
        calls = [str(n.target) for n in traced.graph_module.graph.nodes if n.op == "call_module"]
        assert calls == ["a", "gate", "b"]
    model = DataDependent()
    gm = split_and_compare(model, {"cpu:0": 80, "cpu:1": 96}, (torch.randn(2, 4),), leaf_modules=[Gate])
    assert gm.meta["fxsplit_plan"].param_devices["gate.scale"] in ("cpu:0", "cpu:1")


def test_shape_dependent_model_exports_and_not_fx() -> None:
    with pytest.raises(TraceError, match="leaf_modules"):
        trace(DataDependent())
    torch.manual_seed(0)
    split_and_compare(DataDependent(), {"cpu:0": 80, "cpu:1": 96}, (torch.randn(2, 4),), trace="export")


def test_concrete_args_fix_control_flow() -> None:
    torch.manual_seed(0)
    with pytest.raises(TraceError):
        trace(Flagged())
    model = Flagged()
    reference = copy.deepcopy(model)
    gm = fxsplit.fxsplit(model, {"cpu:0": 80, "cpu:1": 80}, concrete_args={"double": True})
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x, True), reference(x, True))  # fx: pass the value it was traced with
    assert len(set(gm.meta["fxsplit_plan"].param_devices.values())) == 2


def test_bad_mode_and_bad_model() -> None:
    with pytest.raises(TraceError, match="trace mode must be one of auto, fx, export"):
        trace(nn.Linear(2, 2), mode="jit")
    with pytest.raises(TraceError, match=r"model must be a torch.nn.Module \(got function\)"):
        trace(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(TraceError, match="trace mode 'export' needs example_inputs"):
        trace(nn.Linear(2, 2), mode="export")


@pytest.mark.parametrize("route", ["auto", "fx"])
def test_a_model_on_meta_traces_with_real_example_inputs(route: str, tmp_path: Path) -> None:
    # The big-model recipe: weights on meta, example inputs as the user has them (real). Export cannot mix
    # the two and fake shape propagation neither, so both trace with the inputs' meta twins: no fallback,
    # sizes and activations counted, and the split, once loaded, computes what the model does.
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))

    reference = build()
    torch.save(reference.state_dict(), tmp_path / "model.pt")
    with fxsplit.empty_weights():
        model = build()
    x = torch.randn(2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxsplit.FxsplitWarning)
        gm = fxsplit.fxsplit(
            model,
            {"cpu:0": "2KiB", "cpu:1": "2KiB"},
            example_inputs=(x,),
            trace=route,
            checkpoint=tmp_path / "model.pt",
        )
    plan = gm.meta["fxsplit_plan"]
    assert plan.trace == ("export" if route == "auto" else "fx")
    assert plan.activations_not_counted is None and all(row["activations_peak"] > 0 for row in plan.memory.values())
    assert x.device.type == "cpu"  # the caller's inputs were not moved
    torch.testing.assert_close(gm(x), reference(x))


class Counter(nn.Module):
    """``self.steps += 1`` on a buffer: fx runs it as an assignment of a Proxy to the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.lin(x) * self.steps


@pytest.mark.parametrize("call", ["plan", "fxsplit"])
def test_fx_assigning_to_a_buffer_is_refused_and_the_model_kept(call: str) -> None:
    model = Counter()
    steps, x = model.steps, torch.randn(2, 4)
    with pytest.raises(TraceError, match=r"assigns to 'steps' .*self.steps.add_\(1\).*trace='export'"):
        getattr(fxsplit, call)(model, {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(x,), trace="fx")
    assert model.steps is steps and float(model.steps) == 0.0  # not a Proxy left behind
    split = fxsplit.fxsplit(model, {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(x,), trace="export")
    reference = Counter()
    reference.load_state_dict(model.state_dict())
    for _ in range(2):
        torch.testing.assert_close(split(x), reference(x))
    assert float(model.steps) == 2.0


class LayerDrop(nn.Module):
    """Skips its layer at random in train() mode, as wav2vec2's LayerDrop does."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.rand(()) < 0.1:
            return x
        return self.layer(x)


def test_random_control_flow_in_train_mode_gets_a_hint_that_names_it() -> None:
    """Found by an outside check: wav2vec2 in train() mode failed to export with a hint about the inputs'
    signature; the cause is Python control flow on a random tensor's value (LayerDrop)."""
    with pytest.raises(TraceError, match=r"control flow on a tensor's value.*eval\(\) mode") as info:
        trace(LayerDrop().train(), example_inputs=(torch.randn(2, 8),), mode="export")
    assert "test_trace.py" in str(info.value)  # the line that branches
    trace(LayerDrop().eval(), example_inputs=(torch.randn(2, 8),), mode="export")  # the fix it names works


class _Scriptable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.l(x))


@pytest.mark.parametrize("trace_mode", ["fx", "auto"])  # (torch.export cannot call a scripted module: auto falls back)
def test_a_model_holding_a_scripted_module_is_split(trace_mode: str) -> None:
    """A ``torch.jit.script`` submodule's parameter table has no ``get``: fx's trace crashed putting weights back."""
    torch.manual_seed(0)
    model = nn.Sequential(torch.jit.script(_Scriptable()), nn.Linear(8, 8), _Scriptable()).eval()
    x = torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxsplit.FxsplitWarning)  # auto: export failed, fx traced it
        split = fxsplit.fxsplit(
            model, {"cpu:0": 600, "cpu:1": 600}, example_inputs=(x,), trace=trace_mode, mode="weights"
        )
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2
    torch.testing.assert_close(split(x), model(x), rtol=0, atol=0)


def test_export_of_a_model_holding_a_scripted_module_names_it() -> None:
    """torch.export fails there with "forward() takes 2 positional arguments but 3 were given", which reads as
    wrong example inputs; the error (and auto's fallback warning) name the scripted module."""
    model = nn.Sequential(nn.Linear(8, 8), torch.jit.script(_Scriptable())).eval()
    x = torch.randn(2, 8)
    budgets = {"cpu:0": 600, "cpu:1": 600}
    with pytest.raises(fxsplit.TraceError, match=r"holds torch.jit.script modules \('1'\), which torch.export cannot"):
        fxsplit.plan(model, budgets, example_inputs=(x,), trace="export", mode="weights")
    with pytest.warns(fxsplit.FxsplitWarning, match=r"holds torch.jit.script modules \('1'\)"):
        fxsplit.plan(model, budgets, example_inputs=(x,), mode="weights")


class RoutedExperts(nn.Module):
    """A mixture-of-experts layer that runs only the experts its router picked, as Hugging Face's ``eager``
    experts implementation does (``for expert_idx in expert_hit:``)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picked = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        expert_hit = torch.unique(picked)
        for expert_idx in expert_hit:
            rows = picked == expert_idx
            out[rows] = self.experts[int(expert_idx)](x[rows])
        return out


def test_a_loop_over_the_experts_a_router_picked_gets_a_hint_that_names_it() -> None:
    """Found by a sweep of Hugging Face architectures: a mixture-of-experts model built with
    ``experts_implementation='eager'`` failed to export with the LayerDrop hint (plan in eval() mode), which does not
    apply: its loop depends on the routing in eval() mode too. The hint names the implementations that compute every
    expert in one graph."""
    with pytest.raises(TraceError, match=r"mixture-of-experts.*experts_implementation='grouped_mm'") as info:
        trace(RoutedExperts().eval(), example_inputs=(torch.randn(6, 8),), mode="export")
    assert "LayerDrop" not in str(info.value)
    assert "test_trace.py" in str(info.value)  # the line that loops


class WritesThroughData(nn.Module):
    """Writes a tensor it made through ``.data`` (diffusers' CogVideoX patch embedding builds its positional table
    so): torch.export lifts it as a constant it cannot follow, and refuses the model."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("table", torch.zeros(1, 6, 8), persistent=False)  # unread at these sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        joint = h.new_zeros(1, 6, 8)
        joint.data[:, 2:].copy_(torch.arange(32, dtype=h.dtype).reshape(4, 8))
        return h + joint[:, 2:]


@pytest.mark.parametrize("weights", ["real", "meta"])
def test_a_constant_export_cannot_follow_is_refused_on_meta_weights_as_on_real_ones(weights: str) -> None:
    """Before, the model built on ``meta`` (to be loaded from a checkpoint) got a RuntimeError from deep inside the
    cost model ("Cannot access data pointer of Tensor (e.g. FakeTensor...)"): export, run on fake weights, kept the
    fake constant that it refuses on real ones."""
    if weights == "meta":
        with fxsplit.empty_weights():
            model = WritesThroughData()
    else:
        model = WritesThroughData()
    with pytest.raises(
        TraceError, match=r"torch.export could not trace the model[\s\S]*fake tensor[\s\S]*written through .data"
    ):
        fxsplit.plan(model, {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(torch.randn(2, 4, 8),), trace="export")
