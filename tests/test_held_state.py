"""State kept on objects a model's modules hold: put back after tracing, refused when a trace stored in it
(fxsplit/tracing/heldstate.py); tensors ``forward`` assigns to module attributes, said (pythonstate.py).

Before, a running value kept on a plain object (``self.state.h = self.state.h * 0.5 + ...``) was split without a
word under both tracers: each call of the split started from the traced value, so its outputs differed from the
model's from the second call on, and the object held the trace's proxy or fake tensor afterwards. A Hugging Face
Falcon-H1 wrapped for export with a static cache, whose Mamba layers make their states at the first call, gave
wrong tokens the same way. A tensor held there that the trace wrote for real (the cache's ``cumulative_length``)
kept the write: ``fxsplit.plan`` changed the model.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import FxsplitWarning, TraceError

BUDGETS = {"cpu:0": 200_000, "cpu:1": 200_000}
X = torch.randn(2, 4)


class State:
    """A plain object a module holds, as a Hugging Face cache is held by its wrapper."""

    def __init__(self) -> None:
        self.h = torch.zeros(4)
        self.keys: torch.Tensor | None = None
        self.ready = False
        self.maps: list[torch.Tensor] = []
        self.count = torch.zeros((), dtype=torch.long)
        self.table = torch.zeros(20_000)  # 80 kB: more than fxsplit copies before a trace
        self.history = [torch.zeros(4)]
        self.last = [torch.zeros(2, 4)]


class Holding(nn.Module):
    """Keeps state on ``self.state`` as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 4), how
        self.state = State()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        state = self.state
        if self.how == "running":  # read, and replaced by a new value
            state.h = state.h * 0.5 + y.sum(0)
            y = y + state.h
        elif self.how == "lazy":  # made at the first call, then written in place (a static cache)
            if not state.ready:
                state.keys, state.ready = torch.zeros(3, 4), True
            state.keys.index_add_(0, torch.tensor([1]), y[:1])  # the sum of the calls' values so far
            y = y + state.keys.sum(0)
        elif self.how == "history":  # a list entry read, and replaced by a new value
            state.history[0] = state.history[0] * 0.5 + y.sum(0)
            y = y + state.history[0]
        elif self.how == "slot":  # a list entry replaced, not read: the latest output recorded
            state.last[0] = y
        elif self.how == "appended":  # a record of the call, cleared at its start
            state.maps.clear()
            state.maps.append(y)
        elif self.how == "counted":  # an in-place op on a tensor reached through the object: runs for real
            state.count.add_(1)
        elif self.how == "filled":
            state.table.fill_(1.0)
        return self.b(y)


def _contents(state: State) -> dict[str, object]:
    return {
        k: (v.clone() if isinstance(v, torch.Tensor) else list(v) if isinstance(v, list) else v)
        for k, v in vars(state).items()
    }


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in ((a[k], b[k]) for k in a)
    )


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("how", ["running", "lazy", "history"])
def test_state_a_trace_stores_on_a_held_object_is_refused_and_put_back(trace: str, how: str) -> None:
    torch.manual_seed(0)
    model = Holding(how)
    state, before = model.state, _contents(model.state)
    objects = {k: id(v) for k, v in vars(state).items()}
    with pytest.raises(TraceError) as caught:
        fxsplit.plan(model, BUDGETS, example_inputs=(X,), trace=trace)
    where = {"running": "state.h", "lazy": "state.keys", "history": "state.history[0]"}[how]
    message = str(caught.value)
    if (how, trace) == ("lazy", "fx"):  # the graph writes it: refused as a tensor written outside the buffers
        assert f"forward writes in place {where}, a tensor the model holds outside" in message
    else:
        assert f"holds outside its modules: {where}." in message
    assert "register it as" in message.lower()
    assert model.state is state and _same(_contents(state), before)
    assert {k: id(v) for k, v in vars(state).items()} == objects  # the very objects, not copies
    model(X)  # the model still runs as before: no proxy or fake tensor was left in its state


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_what_a_trace_appends_to_a_held_list_is_taken_out_without_a_refusal(trace: str) -> None:
    """A record of the call (outputs appended to a list it clears first) is made anew at each call: the split is
    right, and the list is put back as it was. The list was empty, so the trace's entry is also what a cache made
    at the first call would be: said (the split does not fill it), not refused."""
    torch.manual_seed(0)
    model = Holding("appended")
    maps = model.state.maps
    with pytest.warns(FxsplitWarning, match=r"held none: state\.maps\[0\]"):
        split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace)
    assert model.state.maps is maps and maps == []
    assert torch.equal(split(X), model(X))
    maps.append(torch.zeros(2, 4))  # after a call of the model (the record of it): replaced, not read, no word
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_list_entry_replaced_but_not_read_is_a_record_and_plans(trace: str) -> None:
    """The entry the trace replaced held a tensor it did not read (the latest output, kept for the user): no
    state, no refusal; the split's outputs equal the model's at every call, and the list holds its old tensor."""
    torch.manual_seed(0)
    model = Holding("slot")
    last, old = model.state.last, model.state.last[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace)
    assert model.state.last is last and last[0] is old
    for _ in range(3):
        assert torch.equal(split(X), model(X))


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_small_held_tensor_the_trace_writes_for_real_gets_its_value_back(trace: str) -> None:
    """The write is not in the graph: under torch.fx (which would also run reads of it for real) it is said; the
    export graph reads nothing of it, so nothing is said."""
    model = Holding("counted")
    count = model.state.count
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace)
    said = [
        str(w.message) for w in caught if issubclass(w.category, FxsplitWarning) and "state.count" in str(w.message)
    ]
    assert len(said) == (trace == "fx"), said
    assert model.state.count is count and int(count) == 0
    assert torch.equal(split(X), model(X))


class Counting(nn.Module):
    """Reads a step counter it keeps on a plain object, and adds one to it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.state = State()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x) * self.state.count  # read by the graph
        self.state.count.add_(1)  # no traced input: runs for real while tracing, not in the graph
        return self.b(y)


def test_a_held_tensor_a_fx_trace_writes_for_real_and_the_graph_reads_is_refused_export_splits_it() -> None:
    """torch.fx ran ``count.add_(1)`` once, for real, and kept no op of it: the split multiplied by 0 at every
    call, the model by 0, 1, 2, ...; torch.export records the write in its graph."""
    torch.manual_seed(0)
    model = Counting()
    twin = copy.deepcopy(model)
    with pytest.raises(TraceError, match=r"forward writes state\.count in place, .* and the graph reads them"):
        fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="fx")
    assert int(model.state.count) == 0
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="export")
    assert int(model.state.count) == 0
    for _ in range(3):
        assert torch.equal(split(X), twin(X))


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_large_held_tensor_the_trace_writes_for_real_is_said(trace: str) -> None:
    model = Holding("filled")
    with pytest.warns(FxsplitWarning, match=r"to tensors the model holds outside its modules: state\.table"):
        fxsplit.plan(model, BUDGETS, example_inputs=(X,), trace=trace)


class Attribute(nn.Module):
    """A running value kept in a plain tensor attribute (``how="running"``: read, then replaced), or the latest
    output kept for the user (``"latest"``: replaced, not read)."""

    def __init__(self, how: str = "running") -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(4, 4), nn.Linear(4, 4), how
        self.h = torch.zeros(4)  # a plain attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if self.how == "latest":
            self.h = y.sum(0)
            return self.b(y)
        self.h = self.h * 0.5 + y.sum(0)
        return self.b(y + self.h)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_tensor_attribute_forward_reads_and_replaces_is_refused_and_put_back(trace: str) -> None:
    """Before, only said: the split started from the traced value at each call, where the model reads what its
    last call left, so the outputs differed from the second call on (as with a global or a held object's)."""
    model = Attribute()
    h = model.h
    with pytest.raises(TraceError, match=r"binds them anew to tensors it computes: the attribute self\.h \(a tensor"):
        fxsplit.plan(model, BUDGETS, example_inputs=(X,), trace=trace)
    assert model.h is h and not h.any()


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_tensor_attribute_replaced_but_not_read_is_said_and_put_back(trace: str) -> None:
    model = Attribute("latest")
    h = model.h
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace)
    said = [str(w.message) for w in caught if issubclass(w.category, FxsplitWarning) and "assigns" in str(w.message)]
    assert len(said) == 1 and "self.h (a tensor of shape (4,) -> a tensor it computes)" in said[0], said
    assert model.h is h and not h.any()
    eager = copy.deepcopy(model)
    for _ in range(2):
        x = torch.randn(2, 4)
        torch.testing.assert_close(split(x), eager(x))


class Cached(nn.Module):
    """A cache made at the first call: in a module attribute that held None (``where="attribute"``), one that was
    not there (``"unset"``), a list entry that held None (``"list"``), one appended (``"appended"``), or a key
    added to a dict (``"dict"``)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.a, self.b, self.where = nn.Linear(4, 4), nn.Linear(4, 4), where
        if where == "attribute":
            self.cache = None
        self.slots: list[torch.Tensor | None] = [None] if where == "list" else []
        self.table: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where in ("list", "appended"):
            if not self.slots or self.slots[0] is None:
                self.slots[:1] = [self.a(x)]
            return self.b(self.slots[0] + x)
        if self.where == "dict":
            if "h" not in self.table:
                self.table["h"] = self.a(x)
            return self.b(self.table["h"] + x)
        if getattr(self, "cache", None) is None:
            self.cache = self.a(x)
        return self.b(self.cache + x)


@pytest.mark.parametrize("where", ["attribute", "unset", "list", "appended", "dict"])
@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_cache_made_at_the_first_call_is_said_and_put_back(trace: str, where: str) -> None:
    """Before, the split computed the cache anew at every call, where the model reads the first call's from the
    second call on: other outputs, and no word (the attribute, or the list entry, was put back silently)."""
    model = Cached(where)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace)
    said = [str(w.message) for w in caught if issubclass(w.category, FxsplitWarning)]
    expected = {
        "attribute": "self.cache (None -> a tensor it computes)",
        "unset": "self.cache (unset -> a tensor it computes)",
        "list": "held none: slots[0] (put back as they were",
        "appended": "held none: slots[0] (put back as they were",
        "dict": "held none: table['h'] (put back as they were",
    }[where]
    assert len(said) == 1 and expected in said[0], said
    assert [w.filename for w in caught if issubclass(w.category, FxsplitWarning)] == [__file__]
    assert model.slots == ([None] if where == "list" else []) and model.table == {}
    assert getattr(model, "cache", None) is None
    assert where != "unset" or "cache" not in vars(model)
    eager = copy.deepcopy(model)
    first, second = torch.randn(2, 4), torch.randn(2, 4)
    torch.testing.assert_close(split(first), eager(first))  # what the warning is about: the second call differs
    assert not torch.allclose(split(second), eager(second))


class Reset(Cached):
    """Sets its attribute to None before making it anew: no state from one call to the next (HF RecurrentGemma's
    recurrent_states, without a cache)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache = None
        return super().forward(x)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_an_attribute_forward_sets_to_none_before_making_it_is_no_cache(trace: str) -> None:
    model = Reset("attribute")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace)
    assert model.cache is None
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(split(x), model(x))


def _static_cache_wrapper(kind: str) -> tuple[nn.Module, nn.Module]:
    """A tiny Falcon-H1 (Mamba and attention layers) or Llama, random weights, and Hugging Face's static-cache
    export wrapper of it (16 positions)."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    torch.manual_seed(0)
    sizes = dict(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip
    if kind == "falcon_h1":
        mamba = dict(mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8)
        model = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**sizes, **mamba)).eval()
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.eos_token_id = None  # random weights: always the tokens asked for
    return model, TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=16)


def _plan_one_token(wrapped: nn.Module, budgets: dict[str, int] | None = None) -> nn.Module:
    with torch.no_grad():
        return fxsplit.fxsplit(
            wrapped,
            budgets or {"cpu:0": 10**7, "cpu:1": 10**7},
            example_inputs=(torch.tensor([[5]]),),
            example_kwargs={"cache_position": torch.tensor([0])},
            mode="weights",
        )


def test_falcon_h1_with_a_static_cache_made_lazily_is_refused_and_left_as_it_was() -> None:
    _, wrapped = _static_cache_wrapper("falcon_h1")
    layers = wrapped.static_cache.layers
    before = [dict(vars(layer)) for layer in layers]
    with pytest.raises(TraceError, match=r"static_cache\.layers\[0\]\.keys") as refused:
        _plan_one_token(wrapped)
    assert "call the model once" in str(refused.value)  # the fix the message gives: tested below
    assert [dict(vars(layer)) for layer in layers] == before  # None where it was None, the flags False
    assert all(int(layer.cumulative_length) == 0 for layer in layers)  # written for real while traced, put back


def test_falcon_h1_called_once_before_planning_generates_the_models_tokens_over_two_devices() -> None:
    """The fix the refusal gives: one call makes the cache for real, and the split carries it as state it writes
    in place, on the devices of the layers that use it. Greedy tokens equal ``model.generate``'s."""
    model, wrapped = _static_cache_wrapper("falcon_h1")
    prompt = torch.tensor([[5, 17, 42, 7]])
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    with torch.no_grad():
        wrapped(torch.tensor([[5]]), cache_position=torch.tensor([0]))
    split = _plan_one_token(wrapped, {"cpu:0": 80_000, "cpu:1": 80_000})
    plan = split.meta["fxsplit_plan"]
    assert set(plan.param_devices.values()) == {"cpu:0", "cpu:1"} and plan.mutated  # split, with its state
    tokens: list[int] = []
    with torch.no_grad():
        for position in range(4 + 6 - 1):  # one token per call, as traced: the prompt, then each new token
            token = prompt[:, position : position + 1] if position < 4 else torch.tensor([[tokens[-1]]])
            logits = split(token, cache_position=torch.tensor([position]))
            if position >= 3:
                tokens.append(int(logits[0, -1].argmax()))
    assert tokens == expected


def test_a_llama_static_cache_wrapper_plans_and_its_cumulative_lengths_stay_zero() -> None:
    _, wrapped = _static_cache_wrapper("llama")
    _plan_one_token(wrapped)
    assert all(int(layer.cumulative_length) == 0 for layer in wrapped.static_cache.layers)


class Biases(nn.Module):
    """A table made at the first call from the module's own parameter, as timm's LeViT caches its attention biases
    in a dict (its key, under torch.fx, made from a proxy of the input's device), and read from the second on."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.a, self.table, self.where = nn.Linear(4, 4), nn.Parameter(torch.randn(4)), where
        self.biases: dict[str, torch.Tensor] = {}
        self.slots: list[torch.Tensor] = []
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "dict":
            key = str(x.device)
            if key not in self.biases:
                self.biases[key] = self.table * 2
            bias = self.biases[key]
        elif self.where == "appended":
            if not self.slots:
                self.slots.append(self.table * 2)
            bias = self.slots[0]
        else:
            if self.cache is None:
                self.cache = self.table * 2
            bias = self.cache
        return self.a(x) + bias


@pytest.mark.parametrize("where", ["dict", "appended", "attribute"])
def test_a_cache_made_from_the_models_own_tensors_is_not_said_under_fx(where: str) -> None:
    """The split computes such a cache at every call from the same parameters: the model's outputs, so no warning
    (timm's LeViT and EfficientFormer-V2 were warned of, with outputs equal). Under torch.export, where a value
    does not say what it was computed from, and for a cache made from the inputs (``Cached`` above), it is said."""
    model = Biases(where).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="fx")
    assert model.biases == {} and model.slots == [] and model.cache is None
    eager = copy.deepcopy(model)
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(split(x), eager(x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxsplit.fxsplit(Biases(where).eval(), BUDGETS, example_inputs=(X,), trace="export")
    assert any("put" in str(w.message) and issubclass(w.category, FxsplitWarning) for w in caught)
