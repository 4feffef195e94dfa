"""Computed (non-persistent) buffers of a model cast to a dtype: kept at their own dtype unless the cast model
needs them at the dtype (:mod:`fxsplit.checkpoint.computed`).

timm's EVA attention keeps its key bias as a non-persistent zeros buffer and concatenates it with the query and
value biases. Built at float32 and loaded as bf16, that buffer stayed float32, so the projection's bias was
float32 beside bf16 weights: the plan passed (fake kernels do not check dtypes) and the split failed when it
first ran (``self and mat2 must have the same dtype``). A rotary table that the model converts before it meets
the model's tensors still keeps its dtype, as transformers keeps it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import fxsplit
from fxsplit.checkpoint.cast import cast_floating
from fxsplit.checkpoint.computed import kept_buffers, meeting_buffers
from fxsplit.tracing.capture import trace

BUDGETS = {  # about 0.7 of what one device holds, in each mode: a split over both
    "inference": {"cpu:0": 2700, "cpu:1": 2700},
    "training": {"cpu:0": 13400, "cpu:1": 13400},
}


class KeyBias(nn.Module):
    """Attention's projection as timm's EVA builds it: the key's bias a zeros buffer, not a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48, bias=False)
        self.q_bias = nn.Parameter(torch.randn(16))
        self.v_bias = nn.Parameter(torch.randn(16))
        self.register_buffer("k_bias", torch.zeros(16), persistent=False)
        self.angles = Angles()
        self.out = nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = nn.functional.linear(x, self.qkv.weight, torch.cat([self.q_bias, self.k_bias, self.v_bias]))
        return self.out(qkv) * self.angles(x)


class Angles(nn.Module):
    """A table computed in float32 and converted before it meets the model's tensors (a rotary embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.inv_freq.float() * 3.0).cos().to(x.dtype)


def _model() -> KeyBias:
    torch.manual_seed(0)
    return KeyBias()


def _as_it_runs() -> KeyBias:
    """The model as a bf16 checkpoint load should hold it: weights and key bias at bf16, the table at float32."""
    model = _model()
    for tensor in [*model.parameters(), model.k_bias]:
        tensor.data = tensor.data.bfloat16()
    return model


def _checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(_model().state_dict(), str(path))
    return path


def _on_meta() -> KeyBias:
    with fxsplit.empty_weights():  # (buffers stay real, as the model computed them)
        return KeyBias()


X = torch.randn(4, 16)


@pytest.mark.parametrize("trace_mode", ["fx", "export"])
def test_the_buffers_whose_values_meet_the_cast_dtype_are_found(trace_mode: str) -> None:
    model = _model()
    cast_floating(model, torch.bfloat16)  # parameters (and persistent buffers) only
    kept = kept_buffers(model, torch.bfloat16)
    assert set(kept) == {"k_bias", "angles.inv_freq"}
    traced = trace(model, example_inputs=(X.bfloat16(),), mode=trace_mode)
    assert meeting_buffers(traced.graph_module, set(kept), torch.bfloat16) == ["k_bias"]


@pytest.mark.parametrize("trace_mode", ["fx", "export"])
def test_a_checkpoint_split_at_bf16_casts_the_buffer_its_weights_need_and_runs(tmp_path: Path, trace_mode: str) -> None:
    """fxsplit(checkpoint=, dtype=) and fxsplit.apply(checkpoint=) of a plan: the split runs and computes what the
    model with its weights and key bias at bf16 and its table at float32 computes."""
    path = _checkpoint(tmp_path)
    expected = _as_it_runs()(X.bfloat16())
    options = {"dtype": "bfloat16", "trace": trace_mode, "mode": "inference"}
    split = fxsplit.fxsplit(
        _on_meta(), BUDGETS["inference"], checkpoint=path, example_inputs=(X.bfloat16(),), **options
    )
    assert len(set(split.meta["fxsplit_plan"].placement.values())) == 2  # really split
    torch.testing.assert_close(split(X.bfloat16()), expected, rtol=0, atol=0)
    plan = fxsplit.plan(_model(), BUDGETS["inference"], example_inputs=(X,), **options)
    applied = fxsplit.apply(_on_meta(), plan, checkpoint=path, example_inputs=(X.bfloat16(),))
    torch.testing.assert_close(applied(X.bfloat16()), expected, rtol=0, atol=0)
    for gm in (split, applied):
        held = {name: t.dtype for name, t in gm.named_buffers()}
        assert [d for n, d in held.items() if n.endswith("k_bias")] == [torch.bfloat16]
        assert [d for n, d in held.items() if n.endswith("inv_freq")] == [torch.float32]


@pytest.mark.parametrize("trace_mode", ["fx", "export"])
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_float32_model_planned_at_bf16_is_planned_as_it_will_run(trace_mode: str, mode: str) -> None:
    """Stood in for (real weights) or cast (on ``meta``): the plan of the model with the key bias at bf16 and the
    table at float32, which a checkpoint split of it holds; the model is left as it was."""
    model, runs = _model(), _as_it_runs()
    options = {"trace": trace_mode, "mode": mode}
    as_run = fxsplit.plan(runs, BUDGETS[mode], example_inputs=(X.bfloat16(),), **options)
    before = [(n, t.dtype, t.data_ptr()) for n, t in [*model.named_parameters(), *model.named_buffers()]]
    for planned, given in ((model, X), (_on_meta(), X)):
        found = fxsplit.plan(planned, BUDGETS[mode], example_inputs=(given,), dtype="bfloat16", **options)
        assert found.memory == as_run.memory and found.placement == as_run.placement
        assert len(set(found.placement.values())) == 2
    assert [(n, t.dtype, t.data_ptr()) for n, t in [*model.named_parameters(), *model.named_buffers()]] == before


class Promoted(nn.Module):
    """OLMo-2's rotary: a float32 table multiplied with the bf16 query (float32 by promotion) and the result cast
    back. transformers keeps the table float32; cast to bf16, the angles round and the logits differed."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        cos = (self.inv_freq * 3.0).cos()  # float32, not converted
        return self.out((q * cos).to(q.dtype))


@pytest.mark.parametrize("trace_mode", ["fx", "export"])
def test_a_table_met_in_an_op_that_promotes_keeps_its_dtype(tmp_path: Path, trace_mode: str) -> None:
    torch.manual_seed(0)
    model = Promoted()
    cast_floating(model, torch.bfloat16)
    traced = trace(model, example_inputs=(X.bfloat16(),), mode=trace_mode)
    assert meeting_buffers(traced.graph_module, {"inv_freq"}, torch.bfloat16) == []
    torch.manual_seed(0)
    path = tmp_path / "model.safetensors"
    save_file(Promoted().state_dict(), str(path))
    with fxsplit.empty_weights():
        empty = Promoted()
    split = fxsplit.fxsplit(
        empty, {"cpu:0": "1KiB", "cpu:1": "1KiB"}, checkpoint=path, example_inputs=(X.bfloat16(),),
        dtype="bfloat16", trace=trace_mode, mode="weights",
    )  # fmt: skip
    torch.manual_seed(0)
    expected = Promoted()
    for parameter in expected.parameters():
        parameter.data = parameter.data.bfloat16()
    assert dict(split.named_buffers())["inv_freq"].dtype == torch.float32
    torch.testing.assert_close(split(X.bfloat16()), expected(X.bfloat16()), rtol=0, atol=0)


class Masked(nn.Module):
    """OpenAI-GPT's attention: a causal mask made at the default dtype (float32 in a model built at float32, bf16
    in one ``from_pretrained`` builds at bf16), mixed into the scores by promotion before a matmul with ``v``: kept
    float32 beside bf16 weights, the scores are float32 and the matmul fails, so no graph shows where it meets."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        n = x.shape[-2]
        w = q @ k.transpose(-1, -2)
        w = w * self.mask[:n, :n] - 1e4 * (1 - self.mask[:n, :n])
        return w.softmax(-1) @ v


def _masked() -> nn.Sequential:
    return nn.Sequential(Masked(), Masked(), Masked())


@pytest.mark.parametrize("trace_mode", ["fx", "export"])
def test_a_model_that_traces_only_with_its_masks_cast_gets_them_cast_and_says_so(
    tmp_path: Path, trace_mode: str
) -> None:
    torch.manual_seed(0)
    given = _masked()
    path = tmp_path / "model.safetensors"
    save_file(given.state_dict(), str(path))
    expected = _masked()
    expected.load_state_dict(given.state_dict())
    expected.to(torch.bfloat16)  # masks too: as a model built at bf16 makes them
    x = torch.randn(2, 8, 16)
    budgets = {"cpu:0": "6KiB", "cpu:1": "6KiB"}
    options = {"dtype": "bfloat16", "trace": trace_mode}
    masks = r"'0\.mask', '1\.mask', '2\.mask' were cast"
    with fxsplit.empty_weights():
        empty = _masked()
    with pytest.warns(fxsplit.FxsplitWarning, match=masks):
        split = fxsplit.fxsplit(empty, budgets, checkpoint=path, example_inputs=(x,), **options)
    assert len(set(split.meta["fxsplit_plan"].placement.values())) == 2
    assert {t.dtype for t in split.buffers()} == {torch.bfloat16}
    torch.testing.assert_close(split(x.bfloat16()), expected(x.bfloat16()), rtol=0, atol=0)
    with fxsplit.empty_weights():
        on_meta = _masked()
    for planned in (_masked(), on_meta):  # stood in for, and cast on meta
        with pytest.warns(fxsplit.FxsplitWarning, match=masks):
            plan = fxsplit.plan(planned, budgets, example_inputs=(x,), **options)
        assert plan.placement == split.meta["fxsplit_plan"].placement
        assert plan.memory == split.meta["fxsplit_plan"].memory
        assert {t.dtype for t in planned.buffers()} == {torch.float32}  # the model is as it was
    with fxsplit.empty_weights():
        again = _masked()
    with pytest.warns(fxsplit.FxsplitWarning, match=masks):
        applied = fxsplit.apply(again, plan, checkpoint=path, example_inputs=(x,))
    torch.testing.assert_close(applied(x.bfloat16()), expected(x.bfloat16()), rtol=0, atol=0)


@pytest.mark.slow
def test_openai_gpt_split_at_bf16_from_its_checkpoint_is_the_model_transformers_loads(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.OpenAIGPTConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=2, n_positions=32)
    torch.manual_seed(0)
    transformers.OpenAIGPTLMHeadModel(config).save_pretrained(tmp_path)
    loaded = transformers.OpenAIGPTLMHeadModel.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with fxsplit.empty_weights():
        empty = transformers.OpenAIGPTLMHeadModel(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxsplit.FxsplitWarning)  # its class built at bf16 says the mask is bf16
        split = fxsplit.fxsplit(
            empty, {"cpu:0": "200KiB", "cpu:1": "200KiB"}, example_inputs=(ids,), checkpoint=tmp_path, dtype="bfloat16"
        )
    assert {t.dtype for t in split.buffers() if t.is_floating_point()} == {torch.bfloat16}
    assert len(set(split.meta["fxsplit_plan"].placement.values())) == 2
    torch.testing.assert_close(split(ids)["logits"], loaded(input_ids=ids).logits, rtol=0, atol=0)
