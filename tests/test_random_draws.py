"""A model whose graph depends on what its code draws from ``random`` or ``numpy.random`` is refused, not fixed.

LayerDrop (wav2vec2's adapter, MusicGen, VITS, ...) draws in ``forward`` and skips a layer in training when the
draw is under ``layerdrop``. Before, a split traced in ``train()`` mode kept the one trace's draws: it skipped
the same layers on every call, on fx and on export, with no word (3 of 6 layers with ``layerdrop=0.5``). Draws
the graph does not depend on (in ``eval()`` mode, or with ``layerdrop=0``) leave the model planned as before.
"""

from __future__ import annotations

import importlib
import random
import re
import sys
from pathlib import Path
from random import Random
from random import uniform as bound_uniform
from types import SimpleNamespace
from typing import Any, Callable

import boundcode
import numpy as np
import pytest
import torch
import torch.nn as nn
from numpy.random import random as bound_np_random

import fxsplit
from fxsplit.errors import TraceError
from fxsplit.tracing.drawsources import StandIn, watching
from fxsplit.tracing.randomdraws import WATCHED, recording_draws

BUDGETS = {"cpu:0": 4000, "cpu:1": 4000}
X = torch.randn(2, 16)


class LayerDrop(nn.Module):
    """Skips each layer, in training, when ``draw()`` is under ``layerdrop`` (MusicGen's decoder loop)."""

    def __init__(
        self, layerdrop: float = 0.5, draw: Callable[[], float] = lambda: random.uniform(0, 1), layers: int = 6
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(layers))
        self.layerdrop, self.draw = layerdrop, draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            p = self.draw()
            if self.training and p < self.layerdrop:
                continue
            x = layer(x)
        return x


class Keeps(LayerDrop):
    """wav2vec2's adapter: draws in any mode, keeps the layer when not training or when the draw is over
    ``layerdrop`` (with ``layerdrop=0``, every layer: a draw of exactly 0.0 is the only other outcome)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            p = np.random.random()
            if not self.training or p > self.layerdrop:
                x = layer(x)
        return x


class Scaled(nn.Module):
    """A random scale in training, made a constant by the trace (a number, or an array turned into a tensor)."""

    def __init__(self, as_array: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.as_array = nn.Linear(16, 16), nn.Linear(16, 16), as_array

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if self.training:
            scale = torch.from_numpy(np.random.rand(16).astype("float32")) if self.as_array else random.uniform(0.5, 2)
            x = x * scale
        return self.b(x)


class Encoder(nn.Module):
    """A model whose submodule draws (so the message can name it as a leaf module)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = LayerDrop()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _split(model: nn.Module, trace: str, budgets: Any = BUDGETS, **options: Any) -> torch.nn.Module:
    return fxsplit.fxsplit(model, budgets, example_inputs=(X,), trace=trace, mode="weights", **options)


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize(
    "draw",
    [lambda: random.uniform(0, 1), lambda: random.random(), lambda: np.random.random(), lambda: np.random.rand()],
    ids=["random.uniform", "random.random", "np.random.random", "np.random.rand"],
)
def test_layerdrop_in_training_is_refused_naming_the_draws(trace: str, draw: Callable[[], float]) -> None:
    torch.manual_seed(0)
    model = LayerDrop(draw=draw).train()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(TraceError) as refused:
        _split(model, trace)
    said = str(refused.value)
    assert "draws random numbers" in said and "test_random_draws.py" in said
    assert "eval()" in said and "layerdrop=0" in said
    state = model.state_dict()
    assert all(torch.equal(state[name], t) for name, t in before.items())  # nothing of the model changed


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("as_array", [False, True], ids=["number", "array"])
def test_a_random_scale_in_training_is_refused(trace: str, as_array: bool) -> None:
    with pytest.raises(TraceError, match="draws random numbers"):
        _split(Scaled(as_array).train(), trace)


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("kind", [LayerDrop, Keeps, Scaled])
def test_draws_the_graph_does_not_use_leave_the_model_planned(trace: str, kind: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = kind().eval()
    split = _split(model, trace)
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_layerdrop_zero_in_training_is_planned(trace: str) -> None:
    torch.manual_seed(0)
    for model in (LayerDrop(layerdrop=0.0).train(), Keeps(layerdrop=0.0).train()):
        split = _split(model, trace)
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)


def test_a_drawing_submodule_is_named_and_runs_as_a_leaf_module() -> None:
    torch.manual_seed(0)
    model = Encoder().train()
    with pytest.raises(TraceError, match=r"leaf_modules=\['encoder'\]"):
        _split(model, "fx")
    # as a leaf, the split calls it: it draws on every call
    split = _split(model, "fx", {"cpu:0": 8000, "cpu:1": 8000}, leaf_modules=["encoder"])
    for seed in range(3):
        random.seed(seed)
        expected = model(X)
        random.seed(seed)
        torch.testing.assert_close(split(X), expected, rtol=0, atol=0)


class Scripted(nn.Module):
    """torch.export fails on the scripted module, and trace='auto' falls back to fx: the draws of the failed
    export come first, so the draws of the fx trace are not those a second trace would repeat. One layer dropped:
    a check that compared a second trace's draws with the first's would miss it about one time in two."""

    def __init__(self) -> None:
        super().__init__()
        self.scripted = torch.jit.script(nn.Linear(16, 16))
        self.drop = LayerDrop(layers=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.scripted(x))


@pytest.mark.parametrize("seed", range(8))
def test_layerdrop_is_refused_after_export_fell_back_to_fx(seed: int) -> None:
    torch.manual_seed(0)
    random.seed(seed)
    with pytest.warns(fxsplit.FxsplitWarning, match="traced it with torch.fx"):
        with pytest.raises(TraceError, match="draws random numbers"):
            _split(Scripted().train(), "auto", {"cpu:0": 8000, "cpu:1": 8000})


class Counted(Keeps):
    runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Counted.runs += 1
        return super().forward(x)


def test_the_generators_and_functions_are_the_callers_after_tracing() -> None:
    originals = [random.uniform, random.random, np.random.random, np.random.rand]
    np.random.seed(1)
    Counted.runs = 0
    _split(Counted().eval(), "fx")
    after = np.random.random()
    assert Counted.runs % 3 == 0  # run (on the example inputs, and traced) three times: traced twice again
    np.random.seed(1)
    for _ in range(6 * (Counted.runs // 3)):  # six draws a run, and the later traces' are given back
        np.random.random()
    assert np.random.random() == after
    with pytest.raises(TraceError):
        _split(LayerDrop().train(), "export")
    assert [random.uniform, random.random, np.random.random, np.random.rand] == originals


def _drawing(expression: Callable[[], Any], middle: float) -> nn.Module:
    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            return x * 2 if float(np.mean(expression())) > middle else x

    return Branches()


DRAWS = {
    "random.random": (lambda: random.random(), 0.5),
    "random.uniform": (lambda: random.uniform(2, 4), 3.0),
    "random.randint": (lambda: random.randint(0, 9), 4.5),
    "random.randrange": (lambda: random.randrange(10), 4.5),
    "random.choice": (lambda: random.choice([0, 1, 2, 3]), 1.5),
    "random.gauss": (lambda: random.gauss(0, 1), 0.0),
    "random.normalvariate": (lambda: random.normalvariate(0, 1), 0.0),
    "numpy.random.random": (lambda: np.random.random(), 0.5),
    "numpy.random.random_sample": (lambda: np.random.random_sample(), 0.5),
    "numpy.random.rand": (lambda: np.random.rand(), 0.5),
    "numpy.random.uniform": (lambda: np.random.uniform(2, 4), 3.0),
    "numpy.random.randint": (lambda: np.random.randint(10), 4.5),
    "numpy.random.normal": (lambda: np.random.normal(0, 1), 0.0),
    "numpy.random.randn": (lambda: np.random.randn(), 0.0),
    "numpy.random.standard_normal": (lambda: np.random.standard_normal(), 0.0),
    "Random.random": (lambda: PY_RNG.random(), 0.5),
    "Random.uniform": (lambda: PY_RNG.uniform(2, 4), 3.0),
    "Random.randint": (lambda: PY_RNG.randint(0, 9), 4.5),
    "Random.randrange": (lambda: PY_RNG.randrange(10), 4.5),
    "Random.choice": (lambda: PY_RNG.choice([0, 1, 2, 3]), 1.5),
    "Random.gauss": (lambda: PY_RNG.gauss(0, 1), 0.0),
    "Random.normalvariate": (lambda: PY_RNG.normalvariate(0, 1), 0.0),
    "RandomState.random": (lambda: NP_STATE.random(), 0.5),
    "RandomState.random_sample": (lambda: NP_STATE.random_sample(), 0.5),
    "RandomState.rand": (lambda: NP_STATE.rand(), 0.5),
    "RandomState.uniform": (lambda: NP_STATE.uniform(2, 4), 3.0),
    "RandomState.randint": (lambda: NP_STATE.randint(10), 4.5),
    "RandomState.normal": (lambda: NP_STATE.normal(0, 1), 0.0),
    "RandomState.randn": (lambda: NP_STATE.randn(), 0.0),
    "RandomState.standard_normal": (lambda: NP_STATE.standard_normal(), 0.0),
    "Generator.random": (lambda: NP_GEN.random(), 0.5),
    "Generator.uniform": (lambda: NP_GEN.uniform(2, 4), 3.0),
    "Generator.integers": (lambda: NP_GEN.integers(10), 4.5),
    "Generator.normal": (lambda: NP_GEN.normal(0, 1), 0.0),
    "Generator.standard_normal": (lambda: NP_GEN.standard_normal(), 0.0),
}
PY_RNG, NP_STATE, NP_GEN = random.Random(0), np.random.RandomState(0), np.random.default_rng(0)  # held by this code


def test_every_watched_function_has_a_case() -> None:
    assert sorted(DRAWS) == sorted(WATCHED)


@pytest.mark.parametrize("name", sorted(DRAWS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_branch_on_any_watched_draw_is_refused(name: str, seed: int) -> None:
    expression, middle = DRAWS[name]
    random.seed(seed)
    np.random.seed(seed)
    with pytest.raises(TraceError, match="draws random numbers"):
        _split(_drawing(expression, middle), "fx")


def test_musicgen_with_layerdrop_is_refused_in_training_and_planned_in_eval() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MusicgenDecoderConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        ffn_dim=64,
        num_codebooks=2,
        max_position_embeddings=64,
        layerdrop=0.5,
        pad_token_id=0,
        bos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.MusicgenForCausalLM(config)
    ids = torch.randint(0, 32, (4, 5))  # (batch 2) x 2 codebooks
    budgets = {"cpu:0": "2MiB", "cpu:1": "2MiB"}
    options: dict[str, Any] = {"example_inputs": (ids,), "example_kwargs": {"use_cache": False}, "mode": "weights"}
    with pytest.raises(TraceError, match=r"random.uniform\(\): MusicgenDecoder.forward at modeling_musicgen.py"):
        fxsplit.fxsplit(model.train(), budgets, **options)
    split = fxsplit.fxsplit(model.eval(), budgets, **options)
    with torch.no_grad():
        torch.testing.assert_close(split(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_generator_methods_are_pinned_inside_their_ranges() -> None:
    """``Generator.integers`` with ``endpoint=True`` includes ``high``; without, it stops before."""
    from fxsplit.tracing.drawsources import _GENERATOR

    pin = _GENERATOR["integers"]
    assert [pin(5, end, 2, 9) for end in (0, 1)] == [2, 8]
    assert [pin(5, end, 2, 9, endpoint=True) for end in (0, 1)] == [2, 9]
    assert [pin(5, end, 7) for end in (0, 1)] == [0, 6]
    assert all(0.0 < _GENERATOR["random"](0.5, end) < 1.0 for end in (0, 1))


class Held(nn.Module):
    """LayerDrop on a generator object the module holds (``self.rng``), or on a function bound by name."""

    def __init__(self, how: str, layerdrop: float = 0.5, layers: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(layers))
        self.how, self.layerdrop = how, layerdrop
        self.rng: Any = {
            "default_rng": np.random.default_rng(0),
            "Random": random.Random(0),
            "RandomState": np.random.RandomState(0),
        }.get(how)

    def draw(self) -> float:
        if self.how == "bound_uniform":
            return bound_uniform(0, 1)
        if self.how == "bound_np_random":
            return float(bound_np_random())
        if self.how == "RandomState":
            return float(self.rng.random_sample())
        return float(self.rng.random())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and self.draw() < self.layerdrop:
                continue
            x = layer(x)
        return x


HOW = ["default_rng", "Random", "RandomState", "bound_uniform", "bound_np_random"]


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("how", HOW)
def test_layerdrop_on_a_held_generator_or_a_bound_function_is_refused(trace: str, how: str) -> None:
    """Before, each of these split with no word, keeping the one trace's draws (2 to 5 of 6 layers)."""
    torch.manual_seed(0)
    model = Held(how).train()
    held = model.rng
    with pytest.raises(TraceError, match="draws random numbers") as refused:
        _split(model, trace, {"cpu:0": 8000, "cpu:1": 8000})
    label = {"bound_uniform": "random.uniform", "bound_np_random": "np.random.random"}.get(how, f"Held.rng.{how}")
    if how in ("default_rng", "Random"):
        assert "Held.rng.random()" in str(refused.value)
    elif how == "RandomState":
        assert "Held.rng.random_sample()" in str(refused.value)
    else:
        assert f"{label}()" in str(refused.value)
    assert model.rng is held  # the model's own object is back
    assert bound_uniform is random.uniform and bound_np_random is np.random.random


DRAWN: list[int] = []  # the draws of HeldAlways (not on the model: torch.export runs forward on copies of its lists)


class HeldAlways(Held):
    """Draws before each layer in any mode (wav2vec2's adapter), noting each draw in :data:`DRAWN`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            p = self.draw()
            DRAWN.append(1)
            if not self.training or p > self.layerdrop:
                x = layer(x)
        return x


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("how", ["default_rng", "Random", "RandomState"])
def test_a_held_generator_in_eval_is_planned_and_given_back_as_it_was(trace: str, how: str) -> None:
    """In eval() the draws decide nothing: planned equal to the model. The pinned traces' draws are given back: the
    generator is where the first trace left it (fx runs forward twice for it, export once; then again at each end)."""
    torch.manual_seed(0)
    DRAWN.clear()
    model = HeldAlways(how).eval()
    held = model.rng
    split = _split(model, trace, {"cpu:0": 8000, "cpu:1": 8000})
    assert model.rng is held and not isinstance(model.rng, StandIn)
    runs = {"fx": 2, "export": 1}[trace]
    assert len(DRAWN) == 3 * runs * len(model.layers)
    fresh = Held(how)
    for _ in range(runs * len(model.layers)):
        fresh.draw()
    assert [fresh.draw() for _ in range(3)] == [model.draw() for _ in range(3)]
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)


def test_a_held_generator_in_a_leaf_module_draws_on_every_call() -> None:
    """As a leaf module under fx, the split calls the module: its own generator draws per call, as eager."""
    torch.manual_seed(0)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.head = Held("default_rng"), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x))

    model = Outer().train()
    with pytest.raises(TraceError, match=r"leaf_modules=\['encoder'\]"):
        _split(model, "fx")
    split = _split(model, "fx", {"cpu:0": 8000, "cpu:1": 8000}, leaf_modules=["encoder"])
    for seed in range(3):
        model.encoder.rng = np.random.default_rng(seed)
        expected = model(X)
        model.encoder.rng = np.random.default_rng(seed)
        torch.testing.assert_close(split(X), expected, rtol=0, atol=0)


def test_a_generator_the_model_replaces_while_traced_is_put_back() -> None:
    """``forward`` that makes itself a new generator: as with any attribute ``forward`` assigns while traced, the
    model holds the one it had before (its own object, not the stand-in that was there while it was traced)."""

    class Reseeds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.rng = nn.Linear(16, 16), np.random.default_rng(0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.rng = np.random.default_rng(1)
            return self.a(x)

    model = Reseeds().eval()
    first = model.rng
    _split(model, "fx")
    assert model.rng is first


class MadeInForward(nn.Module):
    """LayerDrop on a generator made in ``forward`` (seeded from the OS), by ``np.random.default_rng()``, or the
    generator classes themselves."""

    def __init__(self, layerdrop: float = 0.5, how: str = "np.random.default_rng()") -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.layerdrop, self.how = layerdrop, how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "np.random.default_rng()":
            rng = np.random.default_rng()
        elif self.how == "random.Random()":
            rng = random.Random()
        elif self.how == "np.random.RandomState()":
            rng = np.random.RandomState()
        elif self.how == "np.random.Generator()":
            rng = np.random.Generator(np.random.PCG64())  # from a bit generator, as default_rng() makes one
        else:
            rng = Random()  # bound by name in this module: ``from random import Random``
        for layer in self.layers:
            if self.training and rng.random() < self.layerdrop:
                continue
            x = layer(x)
        return x


@pytest.mark.parametrize(
    "how", ["np.random.default_rng()", "random.Random()", "np.random.RandomState()", "np.random.Generator()"]
)
@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_generator_made_in_forward_is_watched(trace: str, how: str) -> None:
    torch.manual_seed(0)
    with pytest.raises(TraceError, match=rf"{re.escape(how)}.random\(\): MadeInForward.forward"):
        _split(MadeInForward(how=how).train(), trace, {"cpu:0": 8000, "cpu:1": 8000})
    model = MadeInForward(how=how).eval()
    split = _split(model, trace, {"cpu:0": 8000, "cpu:1": 8000})
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)
    assert np.random.default_rng is not None and isinstance(np.random.default_rng(), np.random.Generator)
    assert random.Random is Random and type(random.Random(0)) is Random  # the classes, put back
    assert type(np.random.RandomState(0)) is np.random.RandomState
    assert type(np.random.Generator(np.random.PCG64(0))) is np.random.Generator


def test_a_generator_class_bound_by_name_is_watched_and_isinstance_still_holds() -> None:
    """``from random import Random``; while traced, ``isinstance`` of a generator the model holds still holds."""
    torch.manual_seed(0)
    with pytest.raises(TraceError, match=r"random.Random\(\).random\(\): MadeInForward.forward"):
        _split(MadeInForward(how="Random()").train(), "fx", {"cpu:0": 8000, "cpu:1": 8000})
    assert Random is random.Random


def test_while_watched_a_generator_made_before_is_still_an_instance_of_its_class() -> None:
    made_before, state_before = random.Random(0), np.random.RandomState(0)
    with watching(nn.Linear(2, 2), lambda original, label, pinned: original):
        assert random.Random is not Random  # the watched stand-in for the class
        assert isinstance(made_before, random.Random) and isinstance(state_before, np.random.RandomState)
        assert issubclass(random.SystemRandom, random.Random) and not isinstance(made_before, np.random.RandomState)
        assert isinstance(random.Random(1), StandIn)  # made meanwhile by code that is not torch's: watched
    assert random.Random is Random


class OnItsConfig(nn.Module):
    """LayerDrop on a generator its config object holds (``self.config.rng``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        rng = {"default_rng": np.random.default_rng(0), "Random": random.Random(0)}[how]
        self.config = SimpleNamespace(layerdrop=0.5, rng=rng)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and self.config.rng.random() < self.config.layerdrop:
                continue
            x = layer(x)
        return x


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("how", ["default_rng", "Random"])
def test_a_generator_on_the_model_s_config_object_is_watched(trace: str, how: str) -> None:
    """Before, the split kept the one trace's layers, silently."""
    torch.manual_seed(0)
    model = OnItsConfig(how).train()
    held = model.config.rng
    with pytest.raises(TraceError, match=r"OnItsConfig.config.rng.random\(\)"):
        _split(model, trace, {"cpu:0": 8000, "cpu:1": 8000})
    assert model.config.rng is held  # the config's own generator is back
    model.eval()
    split = _split(model, trace, {"cpu:0": 8000, "cpu:1": 8000})
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)


class DropsThroughHelper(nn.Module):
    """LayerDrop through a helper module's function, which draws by its own name (``from random import uniform``)."""

    def __init__(self, layerdrop: float = 0.5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and boundcode.dropped(self.layerdrop):
                continue
            x = layer(x)
        return x


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_draw_through_a_helper_module_s_name_is_watched(trace: str) -> None:
    """Before, the split kept the one trace's layers (2 to 5 of 6), silently."""
    torch.manual_seed(0)
    with pytest.raises(TraceError, match=r"draws random numbers[\s\S]*random.uniform\(\)"):
        _split(DropsThroughHelper().train(), trace, {"cpu:0": 8000, "cpu:1": 8000})
    assert boundcode.uniform is random.uniform  # put back
    model = DropsThroughHelper().eval()
    split = _split(model, trace, {"cpu:0": 8000, "cpu:1": 8000})
    with torch.no_grad():
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)


class ImportsWhileTraced(nn.Module):
    """Imports a module the first time it runs, whose own code makes a generator and draws (sympy's ``Dummy``
    class, imported by torch's shape code during a trace, does)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.a, self.name = nn.Linear(16, 16), name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        importlib.import_module(self.name)
        return self.a(x)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_generator_a_module_makes_while_imported_is_its_own(trace: str, tmp_path: Path) -> None:
    name = f"imported_while_traced_{trace}"
    (tmp_path / f"{name}.py").write_text(
        "import random\nimport numpy as np\n"
        "RNG = random.Random()\nFIRST = RNG.randint(0, 9) + random.uniform(0, 1)\n"
        "STATE = np.random.RandomState()\nGEN = np.random.default_rng()\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(ImportsWhileTraced(name), nn.Linear(16, 4)).train()
        split = _split(model, trace, {"cpu:0": 1200, "cpu:1": 1200})
        imported = sys.modules[name]
        assert type(imported.RNG) is random.Random and type(imported.STATE) is np.random.RandomState
        assert type(imported.GEN) is np.random.Generator
        torch.testing.assert_close(split(X), model(X), rtol=0, atol=0)
        sys.modules.pop(name)
        with recording_draws(model) as draws:  # its draws, at import, are not the model's
            model(X)
        assert not draws.where and "random.uniform" in (tmp_path / f"{name}.py").read_text()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)
