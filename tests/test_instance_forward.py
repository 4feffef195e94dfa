"""A ``forward`` set on the model instance, or a class defining ``__call__``: split as ``model(...)`` runs it, or
refused; never split as the class's ``forward`` alone, silently.

torch.fx traces ``type(model).forward``. Before, a model whose instance held another ``forward`` (Accelerate's
hooks and ``prepare`` set one; so does code wrapping it in a decorator), or whose class wrapped ``forward`` in its
own ``__call__``, was split as its class's forward under ``trace="fx"``, and the split's outputs were not the
model's, with no word.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import TraceError
from fxsplit.tracing.leaftracer import instance_forward

BUDGETS = {"cpu:0": 400, "cpu:1": 400}
X = torch.randn(2, 4)


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _patched(model: Two) -> Two:
    def forward(self: Two, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * 3

    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]
    return model


def _split(model: nn.Module, trace: str) -> nn.Module:
    return fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace)


def test_fx_refuses_a_forward_set_on_the_instance_and_says_what_to_do() -> None:
    torch.manual_seed(0)
    model = _patched(Two().eval())
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(TraceError, match=r"run Two.forward alone: its forward is set on the instance .*_patched.<l"):
        _split(model, "fx")
    with pytest.raises(TraceError, match=r"trace='export' or 'auto'.*del model.forward"):
        fxsplit.plan(model, BUDGETS, example_inputs=(X,), trace="fx")
    assert all(torch.equal(model.state_dict()[name], t) for name, t in before.items())
    assert "forward" in vars(model)  # the model is as it was


@pytest.mark.parametrize("trace", ["export", "auto"])
def test_export_splits_what_the_instance_runs(trace: str) -> None:
    torch.manual_seed(0)
    model = _patched(Two().eval())
    split = _split(model, trace)
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)
        assert not torch.allclose(model(X), Two.forward(model, X))  # the case is not vacuous


def test_the_class_forward_bound_again_is_traced_under_fx() -> None:
    torch.manual_seed(0)
    model = Two().eval()
    model.forward = model.forward  # type: ignore[method-assign]
    assert "forward" in vars(model) and instance_forward(model) is None
    split = _split(model, "fx")
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)


def test_a_wrapping_partial_is_refused_under_fx() -> None:
    """Accelerate's hooks set ``functools.partial(new_forward, module)`` on the instance."""
    model = Two().eval()
    old = model.forward

    def new_forward(module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        return old(*args) + 1

    model.forward = functools.update_wrapper(functools.partial(new_forward, model), old)  # type: ignore[method-assign]
    with pytest.raises(TraceError, match="forward is set on the instance"):
        _split(model, "fx")


def test_accelerate_hooks_on_the_model_are_refused_under_fx() -> None:
    hooks = pytest.importorskip("accelerate.hooks")

    class Scale(hooks.ModelHook):  # type: ignore[misc, name-defined]
        def post_forward(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
            return output * 2

    model = Two().eval()
    hooks.add_hook_to_module(model, Scale())
    with pytest.raises(TraceError, match="remove_hook_from_module"):
        _split(model, "fx")
    split = _split(model, "export")
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)


class Called(Two):
    """A class that defines ``__call__``: ``model(x)`` scales the input and adds one around ``forward``."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x * 2) + 1


def test_fx_refuses_a_class_that_defines_call_and_export_splits_it() -> None:
    torch.manual_seed(0)
    model = Called().eval()
    with pytest.raises(TraceError, match=r"Called defines __call__ .*Called.__call__.*move what __call__ adds"):
        _split(model, "fx")
    for trace in ("export", "auto"):
        split = _split(model, trace)
        with torch.no_grad():
            torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)


class Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.head = inner, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


@pytest.mark.parametrize("inner", ["forward", "__call__"])
def test_a_submodule_with_its_own_forward_or_call_is_traced_as_called_under_fx(inner: str) -> None:
    """fx calls submodules through ``Module.__call__``: what their instance runs is what is traced (no refusal)."""
    torch.manual_seed(0)
    model = Outer(_patched(Two()) if inner == "forward" else Called()).eval()
    split = fxsplit.fxsplit(model, {"cpu:0": 600, "cpu:1": 600}, example_inputs=(X,), trace="fx")
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)


def test_a_split_is_split_again_under_fx() -> None:
    """A GraphModule defines ``__call__`` (torch.fx's own, which runs ``forward``): not refused."""
    torch.manual_seed(0)
    model = Two().eval()
    traced = torch.fx.symbolic_trace(model)
    split = _split(traced, "fx")
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)
