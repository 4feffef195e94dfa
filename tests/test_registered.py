"""What ``forward`` registers while it is traced (a buffer or a submodule made on the first call) is taken out
after, and refused, with what to do, when torch.export made it of fake tensors.

Before, under torch.export (the default with example inputs) the model was left with a fake buffer, or a
submodule of fake parameters, and planning failed with ``RuntimeError: Cannot access data pointer of Tensor``
from inside torch; under torch.fx, ``fxsplit.plan`` left the new buffer on the model, and a trace that failed left
the new submodule.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import TraceError

BUDGETS = {"cpu:0": 400, "cpu:1": 400}
X = torch.randn(2, 4)


class FirstCall(nn.Module):
    """Makes, on its first call, a buffer (``how="buffer"``), a parameter or a submodule."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 4), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.how == "buffer":
            if not hasattr(self, "pos"):
                self.register_buffer("pos", torch.arange(4.0) * 0.5, persistent=False)
            return self.b(h + self.pos)
        if self.how == "parameter":
            if not hasattr(self, "scale"):
                self.scale = nn.Parameter(torch.full((4,), 2.0))
            return self.b(h * self.scale)
        if not hasattr(self, "extra"):
            self.extra = nn.Linear(4, 4)
        return self.b(self.extra(h))


def _structure(model: nn.Module) -> tuple[list[str], list[str]]:
    return sorted(model.state_dict(keep_vars=True)), [path for path, _ in model.named_modules()]


@pytest.mark.parametrize("how", ["buffer", "parameter", "submodule"])
def test_export_refuses_what_forward_registers_and_leaves_the_model_as_it_was(how: str) -> None:
    model = FirstCall(how).eval()
    before = _structure(model)
    name = {"buffer": "pos", "parameter": "scale", "submodule": "extra"}[how]
    with pytest.raises(TraceError, match=rf"forward registers '{name}' while it is traced.*Make it in __init__"):
        fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="export")
    assert _structure(model) == before
    assert not hasattr(model, name)


@pytest.mark.parametrize("how", ["buffer", "parameter", "submodule"])
def test_called_once_first_the_model_is_split_equal(how: str) -> None:
    """The fix the message gives: call the model once, so that what it makes exists before it is split."""
    torch.manual_seed(0)
    model = FirstCall(how).eval()
    with torch.no_grad():
        expected = model(X)
    split = fxsplit.fxsplit(model, {"cpu:0": 600, "cpu:1": 600}, example_inputs=(X,), trace="export")
    with torch.no_grad():
        torch.testing.assert_close(split(X), expected, rtol=0, atol=0)


def test_fx_plans_a_buffer_made_on_the_first_call_without_registering_it_on_the_model() -> None:
    """torch.fx makes the buffer of real values: the split holds its own, and ``plan`` leaves the model as it was
    (its own first call makes it, as before)."""
    torch.manual_seed(0)
    model = FirstCall("buffer").eval()
    before = _structure(model)
    fxsplit.plan(model, BUDGETS, example_inputs=(X,), trace="fx")
    assert _structure(model) == before and not hasattr(model, "pos")
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="fx")
    assert not hasattr(model, "pos")
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)
    assert hasattr(model, "pos")  # the model's own first call


def test_a_failed_fx_trace_leaves_no_submodule_behind() -> None:
    model = FirstCall("submodule").eval()
    before = _structure(model)
    with pytest.raises(TraceError, match="not installed as a submodule"):
        fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="fx")
    assert _structure(model) == before


def test_a_submodules_registration_is_named_by_its_path() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = FirstCall("buffer")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    with pytest.raises(TraceError, match=r"forward registers 'inner.pos' while"):
        fxsplit.fxsplit(Outer().eval(), BUDGETS, example_inputs=(X,), trace="export")


class RecordsOnFirstCall(nn.Module):
    """Registers forward hooks on its layers on its first call and sets a flag saying so, as transformers 5 does to
    record each layer's output (``output_capturing``); the hooks append to a list its forward returns."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.recorded: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not getattr(self, "_hooks_installed", False):
            for layer in self.layers:
                layer.register_forward_hook(lambda module, args, out: self.recorded.append(out))
            self._hooks_installed = True
        self.recorded.clear()
        for layer in self.layers:
            x = torch.relu(layer(x))
        return (x, *self.recorded)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_hooks_forward_registers_while_traced_are_taken_off_with_their_flag(trace: str) -> None:
    """Before, the flag was put back and the hooks stayed: the model's next call registered them again and
    recorded every output twice (a Segformer's head then fed one stage's features to another's projection)."""
    torch.manual_seed(0)
    model = RecordsOnFirstCall()
    fxsplit.plan(model, {"cpu:0": "1GiB"}, example_inputs=(X,), trace=trace, mode="weights")
    assert not any(layer._forward_hooks for layer in model.layers) and "_hooks_installed" not in vars(model)
    assert len(model(X)) == 4  # the output and one record per layer, not two
    fxsplit.plan(model, {"cpu:0": "1GiB"}, example_inputs=(X,), trace=trace, mode="weights")  # its hooks are its own
    assert all(len(layer._forward_hooks) == 1 for layer in model.layers) and len(model(X)) == 4


def test_a_hugging_face_model_computes_as_before_after_it_was_planned() -> None:
    """Segformer's head reads the hidden states transformers records with its hooks (found by a sweep of Hugging
    Face checkpoints: after ``plan()``, the model's own call failed, and planning it again did too)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.SegformerConfig(
        hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_attention_heads=[1, 1, 2, 2], decoder_hidden_size=32
    )
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = transformers.SegformerForSemanticSegmentation(config).eval()
    with torch.no_grad():  # (a copy: the model is first called by its trace, which hooks its modules)
        before = copy.deepcopy(model)(pixel_values=pixels).logits
    for _ in range(2):
        fxsplit.plan(model, {"cpu:0": "1GiB"}, example_kwargs={"pixel_values": pixels}, mode="weights")
        with torch.no_grad():
            assert torch.equal(model(pixel_values=pixels).logits, before)
