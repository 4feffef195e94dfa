"""Property-based reliability: random models with grad-mode regions and in-place updates, split or re-applied.

Each random model is a DAG of equal-width linear layers. It may run a span
of layers under ``torch.no_grad()``, ``torch.set_grad_enabled(False)``, a
``@torch.no_grad()`` method, ``no_grad`` with an ``enable_grad`` block
inside, or ``torch.autocast`` turned on (bfloat16) or off, or only while
``torch.is_grad_enabled()`` scale its input, or skip each layer of the span on a draw of
``random.random()`` in training (LayerDrop: refused unless ``layerdrop`` is 0); under torch.fx it may be called
under the caller's autocast, and it may be called once more under
``torch.no_grad()`` (where the grad-mode branch must be refused). It may have hooks that change what
they see: its own forward hook or backward pre-hook, or a layer's backward hook (which
torch.export refuses). It may update its second input (a cache the caller passes) and a
buffer in place, and read them afterwards. It is split with torch.fx or
torch.export, either directly or through a saved plan
(``plan.to_yaml()`` -> ``Plan.from_yaml`` -> ``fxsplit.apply``), and called
twice next to the unsplit model: outputs, the caller's cache, every
parameter's gradient (None where eager has none) and the buffers must agree,
and no op may mix devices.

CI runs a few hundred examples; ``FXSPLIT_NIGHTLY=1`` runs a few thousand.
Each example has a time limit (hypothesis ``deadline``).
"""

from __future__ import annotations

import copy
import os
import random
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.nn as nn
from helpers import CPUS, assert_same_grads, assert_same_state, default_loss, tensor_bytes
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import fxsplit
from fxsplit.check import DeviceChecker, verify_split

pytestmark = [
    pytest.mark.slow,  # random models against eager, ~70 s
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),  # a layer's hook, no input needing gradients
]

NIGHTLY = os.environ.get("FXSPLIT_NIGHTLY") == "1"
REGIONS = (
    None,
    "no_grad",
    "set_grad_enabled",
    "decorated",
    "nested",
    "autocast_on",
    "autocast_off",
    "grad_branch",
    "layerdrop",
)
HOOKS = (None, "forward", "backward", "layer_backward")


def _scaled(factor: float) -> Any:
    """A backward hook that scales the gradients it hands on."""
    return lambda module, grad_input, grad_output: tuple(None if g is None else g * factor for g in grad_input)


def limits(ci_examples: int, nightly_examples: int) -> settings:
    """``ci_examples`` in CI, the same ones each run; ``nightly_examples`` new ones under FXSPLIT_NIGHTLY=1."""
    return settings(
        max_examples=nightly_examples if NIGHTLY else ci_examples,
        deadline=timedelta(seconds=20),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=not NIGHTLY,
    )


class RandomNet(nn.Module):
    """Layer i reads layer i-1 plus random earlier values; see the module docstring for the rest."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = spec
        width = spec["width"]
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in spec["layers"])
        self.register_buffer("running", torch.zeros(width))
        if spec["hook"] == "forward":
            self.register_forward_hook(lambda module, args, out: out * 1.5)
        elif spec["hook"] == "backward":  # (a pre-hook: the inputs need no gradient, the output's is scaled)
            self.register_full_backward_pre_hook(lambda module, grads: tuple(g * 0.5 for g in grads))
        elif spec["hook"] == "layer_backward":
            self.layers[spec["hook_layer"] % len(self.layers)].register_full_backward_hook(_scaled(2.0))

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        values = [x]
        start, end = self.spec["region_span"]
        self._run(values, cache, 0, start)
        region = self.spec["region"]
        if region == "no_grad":
            with torch.no_grad():
                self._run(values, cache, start, end)
        elif region == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                self._run(values, cache, start, end)
        elif region == "decorated":
            self._frozen(values, cache, start, end)
        elif region == "nested":
            middle = (start + end) // 2
            with torch.no_grad():
                self._run(values, cache, start, middle)
                with torch.enable_grad():
                    self._run(values, cache, middle, end)
        elif region == "autocast_on":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                self._run(values, cache, start, end)
            values[-1] = values[-1].float()
        elif region == "autocast_off":  # float32 code under the caller's autocast
            with torch.autocast("cpu", enabled=False):
                values[-1] = values[-1].float()
                self._run(values, cache, start, end)
        elif region == "grad_branch":  # a branch on the grad mode: the split refuses the other mode
            if torch.is_grad_enabled():
                values[-1] = values[-1] * 1.25
            self._run(values, cache, start, end)
        elif region == "layerdrop":  # each layer skipped on a draw, in training: refused unless layerdrop is 0
            for i in range(start, end):
                if self.training and random.random() < self.spec["layerdrop"]:
                    values.append(values[-1])
                else:
                    self._run(values, cache, i, i + 1)
        else:
            self._run(values, cache, start, end)
        self._run(values, cache, end, len(self.layers))
        out = values[-1]
        if self.spec["read_buffer"]:
            out = out + self.running
        return out

    @torch.no_grad()
    def _frozen(self, values: list[torch.Tensor], cache: torch.Tensor, start: int, end: int) -> None:
        self._run(values, cache, start, end)

    def _run(self, values: list[torch.Tensor], cache: torch.Tensor, start: int, end: int) -> None:
        for i in range(start, end):
            skips, act = self.spec["layers"][i]
            h = self.layers[i](values[-1])
            for s in skips:
                h = h + values[s]
            h = torch.tanh(h) if act == "tanh" else torch.relu(h) if act == "relu" else h
            if i == self.spec["cache_write"]:
                cache.mul_(0.5).add_(h.detach())
            if i == self.spec["buffer_write"]:
                self.running.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
            if i == self.spec["cache_read"]:
                h = h + cache  # a sum saves nothing for backward, so a later write to cache is fine
            values.append(h)


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(2, 6))
    layers = []
    for i in range(n):
        skips = tuple(sorted(draw(st.sets(st.integers(0, i), max_size=2)) - {i}))
        layers.append((skips, draw(st.sampled_from(["tanh", "relu", "none"]))))
    start = draw(st.integers(0, n - 1))
    end = draw(st.integers(start + 1, n))
    maybe_layer = st.none() | st.integers(0, n - 1)
    return {
        "width": draw(st.integers(2, 8)),
        "layers": tuple(layers),
        "region": draw(st.sampled_from(REGIONS)),
        "region_span": (start, end),
        "cache_write": draw(maybe_layer),
        "cache_read": draw(maybe_layer),
        "buffer_write": draw(maybe_layer),
        "read_buffer": draw(st.booleans()),
        "outer_autocast": draw(st.booleans()),
        "call_no_grad": draw(st.booleans()),  # (torch.fx only: an export graph fixes the autocast it saw)
        "hook": draw(st.sampled_from(HOOKS)),
        "hook_layer": draw(st.integers(0, n - 1)),
        "layerdrop": draw(st.sampled_from([0.0, 0.5])),
    }


def _inputs(spec: dict[str, Any], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(3, spec["width"], generator=generator) for _ in range(2))  # type: ignore[return-value]


def _split(
    model: nn.Module, budgets: dict[str, int], example: tuple[torch.Tensor, ...], trace: str, saved: bool
) -> torch.fx.GraphModule:
    if not saved:
        return fxsplit.fxsplit(model, budgets, example_inputs=example, trace=trace, mode="weights")
    plan = fxsplit.plan(model, budgets, example_inputs=example, trace=trace, mode="weights")
    loaded = fxsplit.Plan.from_yaml(plan.to_yaml())
    assert loaded == plan
    return fxsplit.apply(model, loaded, example_inputs=example)


def check_against_eager(spec: dict[str, Any], trace: str, fractions: list[float], seed: int, saved: bool) -> None:
    torch.manual_seed(seed)
    model = RandomNet(spec)
    reference = copy.deepcopy(model)
    total = tensor_bytes(model)
    budgets = {d: int(f * total) for d, f in zip(CPUS, fractions, strict=False)}
    example = tuple(t.clone() for t in _inputs(spec, seed))
    try:
        gm = _split(model, budgets, example, trace, saved)
    except fxsplit.BudgetError:
        event("does not fit")
        return
    except fxsplit.TraceError as error:
        if spec["region"] == "layerdrop" and spec["layerdrop"] and "draws random numbers" in str(error):
            event("refuses a graph that keeps one run's draws")
            return
        assert trace == "export" and spec["hook"] == "layer_backward", error
        assert "backward hooks, which torch.export drops" in str(error)
        event("export refuses a layer's backward hook")
        return
    assert not (spec["region"] == "layerdrop" and spec["layerdrop"]), "a split kept one run's LayerDrop draws"
    event(f"hook: {spec['hook']}")
    plan = gm.meta["fxsplit_plan"]
    verify_split(gm)
    event(
        f"{trace}{' saved' if saved else ''}: {len(set(plan.param_devices.values()))} device(s), "
        f"region {spec['region']}"
    )
    event(f"cache written: {spec['cache_write'] is not None}, buffer written: {spec['buffer_write'] is not None}")
    split_args, eager_args = _inputs(spec, seed), _inputs(spec, seed)
    outer = spec["outer_autocast"] and trace == "fx"
    event(f"under the caller's autocast: {outer}")
    for _ in range(2):
        with DeviceChecker(plan, gm, model), torch.autocast("cpu", dtype=torch.bfloat16, enabled=outer):
            out = gm(*split_args)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=outer):
            expected = reference(*eager_args)
        assert out.dtype == expected.dtype
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(split_args[1], eager_args[1], msg=lambda m: f"caller's cache: {m}")
        assert out.requires_grad == expected.requires_grad
        if expected.requires_grad:
            default_loss(out).backward()
            default_loss(expected).backward()
    if spec["call_no_grad"]:  # then once without gradients
        with torch.no_grad():
            if spec["region"] == "grad_branch":
                with pytest.raises(
                    fxsplit.FxsplitError,
                    match=r"traced with gradients on \(torch.enable_grad\(\)\), and the model's code read that mode",
                ):
                    gm(*split_args)
                event("refuses the grad mode it was not traced under")
            else:
                torch.testing.assert_close(gm(*split_args), reference(*eager_args))
    assert_same_grads(model, reference)
    assert_same_state(model, reference)


@limits(250, 2000)
@given(
    spec=specs(),
    trace=st.sampled_from(["fx", "export"]),
    fractions=st.lists(st.floats(0.5, 1.0), min_size=2, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_random_models_match_eager(spec: dict[str, Any], trace: str, fractions: list[float], seed: int) -> None:
    check_against_eager(spec, trace, fractions, seed, saved=False)


@limits(100, 1000)
@given(
    spec=specs(),
    trace=st.sampled_from(["fx", "export"]),
    fractions=st.lists(st.floats(0.5, 1.0), min_size=2, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_saved_plans_match_eager(spec: dict[str, Any], trace: str, fractions: list[float], seed: int) -> None:
    check_against_eager(spec, trace, fractions, seed, saved=True)
