"""Module hooks run in the split as in the model, or the split is refused (fxsplit/tracing/modulehooks.py).

Before, a split silently dropped three kinds: the root's forward hooks and pre-hooks under torch.fx (it traces
``forward`` itself), and backward hooks of any module whose ops the graph holds instead of a call (every module
under torch.export, all but leaf modules under torch.fx): outputs or gradients differed from the model's.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import FxsplitWarning, TraceError

BUDGETS = {"cpu:0": 3000, "cpu:1": 3000}
X = torch.randn(2, 16)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(16, 4))


class Calls:
    """Hooks that change what they see (so that a dropped one shows), counting their calls."""

    def __init__(self) -> None:
        self.count = 0

    def scale(self, factor: float) -> Callable[..., Any]:
        def hook(*args: Any) -> Any:
            self.count += 1
            backward = len(args) == 3 and isinstance(args[2], tuple)  # (module, grad_input, grad_output)
            last = args[1] if backward else args[-1]
            if isinstance(last, tuple):  # gradients (a backward hook returns grad_input's), or a pre-hook's inputs
                return tuple(t * factor if isinstance(t, torch.Tensor) else t for t in last)
            return last * factor

        return hook


# kind -> (registers its hooks on a model, whether its ops are on a submodule the split must call)
HOOKS: dict[str, Callable[[nn.Module, Calls], Any]] = {
    "root forward hook": lambda m, c: m.register_forward_hook(c.scale(2.0)),
    "root forward pre-hook": lambda m, c: m.register_forward_pre_hook(c.scale(1.5)),
    "root forward hook with kwargs": lambda m, c: m.register_forward_hook(
        lambda mod, args, kwargs, out: c.scale(2.0)(out), with_kwargs=True
    ),
    "root full backward hook": lambda m, c: m.register_full_backward_hook(c.scale(3.0)),
    "root backward pre-hook": lambda m, c: m.register_full_backward_pre_hook(c.scale(3.0)),
    "block full backward hook": lambda m, c: m[1].register_full_backward_hook(c.scale(3.0)),
    "block backward pre-hook": lambda m, c: m[1].register_full_backward_pre_hook(c.scale(3.0)),
    "Linear full backward hook": lambda m, c: m[1].a.register_full_backward_hook(c.scale(3.0)),
    "block and its Linear": lambda m, c: (
        m[0].register_full_backward_hook(c.scale(3.0)),
        m[0].b.register_full_backward_pre_hook(c.scale(0.5)),
    ),
}
SUBMODULE = {"block full backward hook", "block backward pre-hook", "Linear full backward hook", "block and its Linear"}
WRAPPED = {"block full backward hook": "'1'", "block backward pre-hook": "'1'", "block and its Linear": "'0'"}


def _run(
    m: nn.Module, x: torch.Tensor, weights: nn.Module | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Outputs, the gradients of ``weights``' parameters (``m``'s) by name, and the input's gradient."""
    x = x.clone().requires_grad_()
    out = m(x)
    (out * torch.arange(1.0, 1.0 + out.numel()).view_as(out)).sum().backward()
    named = (weights or m).named_parameters()
    return out.detach(), {n: p.grad for n, p in named if p.grad is not None}, x.grad


@pytest.mark.parametrize("trace", ["fx", "export", "auto"])
@pytest.mark.parametrize("kind", sorted(HOOKS))
def test_hooks_run_in_the_split_as_in_the_model(kind: str, trace: str) -> None:
    eager, eager_calls = model(), Calls()
    HOOKS[kind](eager, eager_calls)
    out, grads, x_grad = _run(eager, X)
    m, calls = model(), Calls()
    HOOKS[kind](m, calls)
    split_it = lambda: fxsplit.fxsplit(m, BUDGETS, example_inputs=(X,), trace=trace, mode="weights")  # noqa: E731
    if trace == "export" and kind in SUBMODULE:
        with pytest.raises(TraceError, match="backward hooks, which torch.export drops"):
            split_it()
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = split_it()
    said = [str(w.message) for w in caught if issubclass(w.category, FxsplitWarning) and "hooks" in str(w.message)]
    if kind in WRAPPED or (trace == "auto" and kind in SUBMODULE):
        (message,) = said
        assert "backward hooks" in message and (trace == "fx") == ("traced with torch.fx" not in message)
        assert kind not in WRAPPED or f"keeping {WRAPPED[kind]} whole" in message
    else:
        assert said == []
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2
    calls.count = 0
    split_out, split_grads, split_x_grad = _run(split, X)
    torch.testing.assert_close(split_out, out, rtol=0, atol=0)
    torch.testing.assert_close(split_grads, grads)
    torch.testing.assert_close(split_x_grad, x_grad)
    if trace == "fx" or "forward" not in kind:  # (torch.export traces the root's forward hooks into its graph)
        assert calls.count == eager_calls.count  # each hook ran as often as in the model


def test_a_named_leaf_with_backward_hooks_plans_without_a_warning_and_applies() -> None:
    m, calls = model(), Calls()
    m[1].register_full_backward_hook(calls.scale(3.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        planned = fxsplit.plan(m, BUDGETS, example_inputs=(X,), trace="fx", leaf_modules=["1"], mode="weights")
    eager, eager_calls = model(), Calls()
    eager[1].register_full_backward_hook(eager_calls.scale(3.0))
    expected = _run(eager, X)
    split = fxsplit.apply(m, planned, example_inputs=(X,))
    got = _run(split, X)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    assert calls.count == eager_calls.count == 1


def test_a_pipeline_runs_the_models_own_hooks_once_per_call() -> None:
    eager, eager_calls = model(), Calls()
    eager.register_forward_hook(eager_calls.scale(2.0))
    eager.register_full_backward_hook(eager_calls.scale(3.0))
    x = torch.randn(4, 16)
    expected = _run(eager, x)
    m, calls = model(), Calls()
    m.register_forward_hook(calls.scale(2.0))
    m.register_full_backward_hook(calls.scale(3.0))
    config = fxsplit.PipelineConfig(chunks=2)
    pipeline = fxsplit.fxsplit(m, BUDGETS, example_inputs=(x,), trace="fx", mode="weights", pipeline=config)
    assert isinstance(pipeline, fxsplit.Pipeline)
    got = _run(pipeline, x, weights=m)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    assert calls.count == eager_calls.count == 2


def test_pipeline_stages_say_that_they_do_not_run_the_models_own_hooks() -> None:
    m = model()
    m.register_forward_hook(lambda mod, args, out: out * 2)
    with pytest.warns(FxsplitWarning, match="the stages do not run them"):
        fxsplit.pipeline_stages(m, BUDGETS, example_inputs=(torch.randn(4, 16),), chunks=2, trace="fx")


def test_a_forward_hook_that_stores_an_output_runs_in_the_split_where_the_module_is_a_leaf() -> None:
    eager, seen = model(), {}
    eager[1].register_forward_hook(lambda mod, args, out: seen.__setitem__("block", out.detach()))
    eager(X)
    m, stored = model(), {}
    m[1].register_forward_hook(lambda mod, args, out: stored.__setitem__("block", out))
    split = fxsplit.fxsplit(m, BUDGETS, example_inputs=(X,), trace="fx", leaf_modules=["1"], mode="weights")
    stored.clear()
    split(X)
    torch.testing.assert_close(stored["block"].detach(), seen["block"], rtol=0, atol=0)


@pytest.mark.parametrize(
    "register",
    [
        torch.nn.modules.module.register_module_forward_hook,
        torch.nn.modules.module.register_module_full_backward_hook,
    ],
)
def test_global_hooks_are_named_in_a_warning(register: Callable[..., Any]) -> None:
    """They run for every module call; the split calls only its leaf modules."""
    handle = register(lambda *args: None)
    try:
        with pytest.warns(FxsplitWarning, match=rf"global module hooks are registered \({register.__name__}\)"):
            fxsplit.plan(model(), BUDGETS, example_inputs=(X,), trace="fx", mode="weights")
    finally:
        handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        fxsplit.plan(model(), BUDGETS, example_inputs=(X,), trace="fx", mode="weights")
