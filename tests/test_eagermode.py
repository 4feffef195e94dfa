"""fxsplit's dispatch modes run the user's compiled code eagerly, see its ops, and leave it compilable after.

Before fxsplit.eagermode, a function compiled with ``torch.compile`` that a leaf module called was reached with
one of fxsplit's dispatch modes active; dynamo skipped its frame and marked it skipped for the rest of the
process: after ``fxsplit.plan`` the user's compiled function ran uncompiled, and ``flex_attention`` (compiled
with ``fullgraph=True`` on every eager call) failed on every later call.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.check import DeviceChecker
from fxsplit.eagermode import EagerDispatchMode
from fxsplit.errors import FxsplitWarning
from fxsplit.memory.measure import measure_forward

BUDGETS = {"cpu:0": 64_000, "cpu:1": 64_000}


class Compiles:
    """A ``torch.compile`` backend that counts the graphs it is given and the runs of what it compiled."""

    def __init__(self) -> None:
        self.graphs = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.runs += 1
            return gm.forward(*args)

        return run


def compiled_leaf(backend: Compiles, compiled: bool = True) -> tuple[nn.Module, type[nn.Module]]:
    """A model whose leaf module calls a compiled function (or the same function, not compiled)."""

    def gate(h: torch.Tensor) -> torch.Tensor:
        return (h.sin() * 2 + h.cos()).tanh() * h

    fn = torch.compile(gate, backend=backend) if compiled else gate

    class Leaf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn(self.lin(x))

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), Leaf(), nn.Linear(32, 32), Leaf()), Leaf


def _plan(model: nn.Module, leaf: type[nn.Module], **options: Any) -> fxsplit.Plan:
    x = torch.randn(4, 32)
    return fxsplit.plan(model, BUDGETS, trace="fx", leaf_modules=[leaf], example_inputs=(x,), **options)


def _split(model: nn.Module, leaf: type[nn.Module]) -> torch.fx.GraphModule:
    budgets = {"cpu:0": 9_000, "cpu:1": 9_000}
    return fxsplit.fxsplit(model, budgets, trace="fx", leaf_modules=[leaf], mode="weights")


def _under_the_device_check(model: nn.Module, leaf: type[nn.Module]) -> None:
    split = _split(model, leaf)
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2
    with DeviceChecker(split.meta["fxsplit_plan"], split) as checker:
        split(torch.randn(4, 32))
    assert checker.ops_checked > 8  # the compiled function's ops, run eagerly, were checked


ROUTES: dict[str, Callable[[nn.Module, type[nn.Module]], Any]] = {
    "plan's activation profile": lambda model, leaf: _plan(model, leaf, mode="inference"),
    "plan at a dtype (mixed dtypes inside leaves)": lambda model, leaf: _plan(model, leaf, dtype="bfloat16"),
    "device check": _under_the_device_check,
    "measured activations": lambda model, leaf: measure_forward(_split(model, leaf), torch.randn(4, 32)),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_compiled_function_inside_a_leaf_compiles_after_fxsplit_ran_it(route: str) -> None:
    torch._dynamo.reset()
    backend = Compiles()
    model, leaf = compiled_leaf(backend)
    ROUTES[route](model, leaf)
    x = torch.randn(4, 32)
    expected = compiled_leaf(Compiles(), compiled=False)[0](x)
    runs = backend.runs
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert backend.runs == runs + 2, "the user's compiled function was left uncompiled for the rest of the process"


def test_a_compiled_function_is_profiled_as_the_ops_it_runs() -> None:
    torch._dynamo.reset()
    compiled, leaf = compiled_leaf(Compiles())
    plain, plain_leaf = compiled_leaf(Compiles(), compiled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)  # no "activations not counted"
        planned = _plan(compiled, leaf, mode="inference")
    assert planned.activations_not_counted is None
    assert sum(row["activations_peak"] for row in planned.memory.values()) > 0
    assert planned.memory == _plan(plain, plain_leaf, mode="inference").memory


class FlexAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v).transpose(1, 2).reshape(b, t, 32)


def test_flex_attention_inside_a_leaf_is_profiled_and_still_runs_after() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), FlexAttention(), nn.Linear(32, 32)).requires_grad_(False)
    x = torch.randn(2, 8, 32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        expected = model(x)
        # before: "activations not counted: ... HigherOrderOperator flex_attention"
        warnings.simplefilter("error", FxsplitWarning)
        planned = fxsplit.plan(
            model, BUDGETS, trace="fx", leaf_modules=[FlexAttention], example_inputs=(x,), mode="inference"
        )
        assert planned.activations_not_counted is None
        # its output and the q, k, v before it at least (the unfused kernel's scores are not seen: see eagermode)
        assert max(row["activations_peak"] for row in planned.memory.values()) >= 4 * x.numel() * 4
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # before: "marked as skipped"
        split = fxsplit.apply(model, planned)
        torch.testing.assert_close(split(x), expected, rtol=0, atol=0)


def test_the_stance_before_the_mode_is_back_after_it_whatever_happens() -> None:
    torch._dynamo.reset()
    backend = Compiles()
    double = torch.compile(lambda t: t * 2, backend=backend)
    with pytest.raises(ValueError), EagerDispatchMode():
        raise ValueError("inside")
    double(torch.ones(2))
    assert backend.runs == 1
    with torch.compiler.set_stance("force_eager"):
        with EagerDispatchMode():
            pass
        double(torch.ones(2))  # still the user's stance: eager
    assert backend.runs == 1
