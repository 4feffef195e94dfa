"""A split whose model code branched on the grad mode or on autocast refuses other modes than it was traced under.

Both tracers run ``forward`` once and keep the branch of the modes they ran under. Before, a split traced with
gradients on and called under ``torch.no_grad()`` (or the other way), or traced without autocast and called under
it (the cast that Nemotron's, GPT-Neo's and Falcon's layer norms make ``if torch.is_autocast_enabled()``),
silently computed the other branch, on both routes. Reads that change nothing, and the reads of torch's and
fxsplit's own machinery, leave the split free.
"""

from __future__ import annotations

import copy
import re

import boundcode
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import is_grad_enabled as grad_is_on

import fxsplit
from fxsplit.errors import FxsplitError
from fxsplit.tracing.modereads import MODE_READS

BUDGETS = {"cpu:0": 2000, "cpu:1": 2000}
X = torch.randn(4, 16)
CALLS: list[str] = []


class Scaled(nn.Module):
    """Doubles its output only while gradients are on (a branch fx and export both fix)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS.append("Scaled")
        h = self.a(x)
        if torch.is_grad_enabled():
            h = h * 2
        return torch.relu(h)


class ScaledByName(Scaled):
    """The same branch, through ``from torch import is_grad_enabled`` (a name of this module's own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if grad_is_on():
            h = h * 2
        return torch.relu(h)


class ScaledThroughHelper(Scaled):
    """The same branch, through a helper module's function that reads the mode by its own name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if boundcode.grad_on():
            h = h * 2
        return torch.relu(h)


def _cast_if_autocast_enabled(*args: object) -> tuple[object, ...]:
    """Nemotron's helper (there for CUDA, which ``torch.is_autocast_enabled()`` without a device asks of)."""
    if not torch.is_autocast_enabled("cpu"):
        return args
    return torch.amp.autocast_mode._cast(args, "cpu", torch.get_autocast_dtype("cpu"))


class CastNorm(nn.Module):
    """Nemotron's LayerNorm1P: inputs cast to the autocast dtype, then a layer norm with autocast off."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.weight = nn.Parameter(torch.randn(16))
        self.bias = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if torch.is_autocast_enabled("cpu"):
            h, weight, bias = _cast_if_autocast_enabled(h, self.weight + 1.0, self.bias)
        else:
            weight, bias = self.weight + 1.0, self.bias
        with torch.autocast("cpu", enabled=False):
            return F.layer_norm(h, (16,), weight, bias)


class Indifferent(nn.Module):
    """Reads the grad mode, and computes the same in both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS.append("Indifferent")
        checkpointing = torch.is_grad_enabled() and False
        return torch.relu(self.a(x)) if not checkpointing else self.a(x)


class NoGradRegion(nn.Module):
    """A ``torch.no_grad()`` block and an autocast region: torch's own code reads the modes, the model's does not."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS.append("NoGradRegion")
        with torch.no_grad():
            scale = self.a.weight.abs().mean()
        with torch.autocast("cpu", enabled=False):
            return torch.relu(self.a(x)) * scale


def model(kind: type[nn.Module] = Scaled) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(kind(), kind(), nn.Linear(16, 4))


def _split(m: nn.Module, trace: str, **options: object) -> torch.nn.Module:
    split = fxsplit.fxsplit(m, BUDGETS, example_inputs=(X,), trace=trace, mode="weights", **options)
    plan = getattr(split, "plan", None) or split.meta["fxsplit_plan"]
    assert len(set(plan.param_devices.values())) == 2
    return split


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("traced_with_grad", [True, False])
def test_a_split_refuses_the_grad_mode_it_was_not_traced_under(trace: str, traced_with_grad: bool) -> None:
    m = model()
    with torch.set_grad_enabled(traced_with_grad):
        split = _split(m, trace)
        torch.testing.assert_close(split(X), m(X), rtol=0, atol=0)
    traced = "on (torch.enable_grad())" if traced_with_grad else "off (torch.no_grad())"
    with torch.set_grad_enabled(not traced_with_grad):
        with pytest.raises(FxsplitError, match=rf"traced with gradients {re.escape(traced)}, and the") as raised:
            split(X)
    message = str(raised.value)
    assert "read that mode (Scaled.forward at test_mode_reads.py:" in message
    assert "split the model under the mode you call it in" in message
    if trace == "fx":
        assert "leaf_modules=['0', '1']" in message


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_split_traced_without_autocast_refuses_to_run_under_it(trace: str) -> None:
    m = model(CastNorm)
    split = _split(m, trace)
    torch.testing.assert_close(split(X), m(X), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = m(X)  # the model casts its layer norms' inputs to bfloat16; the graph has no cast
        with pytest.raises(FxsplitError, match=r"traced with autocast for cpu off, and the model's code read that"):
            split(X)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        traced_under = _split(m, "export") if trace == "export" else None
    if traced_under is not None:  # (torch.fx cannot trace the cast: `_cast` iterates over a proxy)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(traced_under(X), expected, rtol=0, atol=0)
        with torch.autocast("cpu", dtype=torch.float16), pytest.raises(FxsplitError, match="on at bfloat16"):
            traced_under(X)  # the dtype it cast to is fixed too
        with pytest.raises(FxsplitError, match="autocast for cpu on at bfloat16"):
            traced_under(X)


def test_the_split_computes_the_model_s_gradients_in_the_mode_it_was_traced_under() -> None:
    m, twin = model(), model()
    split = _split(twin, "fx")
    split(X).square().sum().backward()
    m(X).square().sum().backward()
    for (name, p), q in zip(m.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", [Scaled, CastNorm])
def test_leaf_modules_read_the_modes_as_they_run(kind: type[nn.Module]) -> None:
    m = model(kind)
    split = _split(m, "fx", leaf_modules=["0", "1"])
    assert MODE_READS not in split.meta
    for grad in (True, False):
        for autocast in (False, True):
            with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                torch.testing.assert_close(split(X), m(X), rtol=0, atol=0)


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("kind", [Indifferent, NoGradRegion])
def test_reads_that_change_nothing_leave_the_split_free(trace: str, kind: type[nn.Module]) -> None:
    m = model(kind)
    split = _split(m, trace)
    assert MODE_READS not in split.meta
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(split(X), m(X), rtol=0, atol=0)


class ReadsAndMakesAConstant(nn.Module):
    """Reads the grad mode without branching on it, and makes a tensor in forward: torch.fx sets it on the model
    as ``_tensor_constant0``, so the second trace (while the first one's is still set) named it
    ``_tensor_constant1``, and the code differed for the same graph (the split refused ``torch.no_grad()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.is_grad_enabled()
        return self.a(x) * torch.tensor([2.0])


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_constant_made_in_forward_is_the_same_graph_traced_again(trace: str) -> None:
    m = model(ReadsAndMakesAConstant)
    split = _split(m, trace)
    assert MODE_READS not in split.meta
    with torch.no_grad():
        torch.testing.assert_close(split(X), m(X), rtol=0, atol=0)
    assert not [name for name in vars(m) if "constant" in name]  # the model keeps no trace of the trace
    assert not [name for block in m for name in vars(block) if "constant" in name]


def test_a_model_that_reads_nothing_is_traced_once() -> None:
    CALLS.clear()
    _split(model(NoGradRegion), "fx")
    traced_once = len(CALLS)
    CALLS.clear()
    _split(model(Scaled), "fx")
    assert traced_once == 2  # each block's forward, once
    assert len(CALLS) == 2 * traced_once  # read: traced again under the other mode, to compare


def test_a_pipeline_refuses_other_modes_too() -> None:
    m = model()
    pipeline = _split(m, "fx", pipeline=fxsplit.PipelineConfig(chunks=2))
    per_micro_batch = torch.cat([m(rows) for rows in X.chunk(2)])  # each micro-batch's rows, as the stages see them
    torch.testing.assert_close(pipeline(X), per_micro_batch, rtol=0, atol=0)
    with torch.no_grad(), pytest.raises(FxsplitError, match="this pipeline was traced with gradients on"):
        pipeline(X)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_copy_of_the_split_refuses_them_too(trace: str) -> None:
    split = copy.deepcopy(_split(model(), trace))
    with torch.no_grad(), pytest.raises(FxsplitError, match="traced with gradients on"):
        split(X)


def test_the_modes_are_the_callers_after_tracing() -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        _split(model(CastNorm), "export")
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
        assert torch.is_grad_enabled()
    assert not torch.is_autocast_enabled("cpu")
    assert torch.is_autocast_enabled is torch._C.is_autocast_enabled  # torch's own functions, put back
    assert torch.is_grad_enabled is torch._C.is_grad_enabled


def test_pipeline_stages_say_which_modes_they_compute_under() -> None:
    with pytest.warns(fxsplit.FxsplitWarning, match=r"fixed what it found then \(gradients on \(torch.enable_grad"):
        fxsplit.pipeline_stages(model(), {"cpu:0": 3000, "cpu:1": 3000}, example_inputs=(X,), chunks=2, trace="fx")


@pytest.mark.parametrize(
    ("kind", "where"),
    [(ScaledByName, "ScaledByName.forward at test_mode_reads.py:"), (ScaledThroughHelper, "grad_on at boundcode.py:")],
    ids=["own name", "helper module's name"],
)
@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_mode_read_through_a_name_the_code_binds_is_seen(trace: str, kind: type[nn.Module], where: str) -> None:
    """``from torch import is_grad_enabled`` in the model's module, or in a helper module its code calls (before,
    the split kept the gradients-on branch under ``torch.no_grad()``, silently)."""
    m = model(kind)
    split = _split(m, trace)
    torch.testing.assert_close(split(X), m(X), rtol=0, atol=0)
    with torch.no_grad():
        with pytest.raises(FxsplitError, match=rf"read that mode \({re.escape(where)}"):
            split(X)
    assert grad_is_on is torch.is_grad_enabled and boundcode.is_grad_enabled is torch.is_grad_enabled  # put back
