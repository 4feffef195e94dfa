"""``fxsplit.plan(model, dtype=...)`` of a model with real weights plans the model as it runs at the dtype.

A float32 model planned at bf16 used to be traced at float32 and every floating
tensor counted as bf16, so the float32 work of the bf16 model (attention
softmax, norms, the loss) was counted at half its size. Meta tensors of the
dtype now stand in for its weights while it is traced and planned
(:mod:`fxsplit.checkpoint.standin`), so the plan is the one of the model cast
to the dtype, which it applies to, and the model itself is left as it was.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import fxsplit
from fxsplit.checkpoint.cast import cast_floating
from fxsplit.checkpoint.standin import planning_inputs
from fxsplit.planning.fingerprint import describe

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))


SMALL = {  # two layers, eager attention (its float32 softmax), no key/value cache
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "use_cache": False,
    "attn_implementation": "eager",
}


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(intermediate_size=128, num_key_value_heads=2, **SMALL)
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False, attn_implementation="eager"
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _falcon() -> nn.Module:
    """Its forward makes an index tensor from Python values: the graph has that constant on the CPU, not on meta."""
    torch.manual_seed(0)
    return transformers.FalconForCausalLM(transformers.FalconConfig(**SMALL)).eval()


class Attention(nn.Module):
    """Scores in float32 whatever the weights' dtype, as transformers' eager attention computes them."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)).float().softmax(-1).to(x.dtype)
        return self.out(scores @ v)


class Projected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)


class Inverse(Projected):
    """Inverts matrices (``torch.linalg.inv``), which bf16 ones cannot be: it does not run once cast to bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.inv(self.proj(x).view(-1, 4, 4))


def _real_and_on_meta(make: type[nn.Module]) -> tuple[tuple[nn.Module, torch.Tensor], ...]:
    """The model with real weights and an input, then on ``meta`` with a ``meta`` input."""
    x = torch.randn(2, 16)
    with fxsplit.empty_weights():
        on_meta = make()
    return (make(), x), (on_meta, x.to("meta"))


def _state(model: nn.Module) -> list[tuple[str, int, torch.dtype, torch.device, int]]:
    """Each tensor of ``model``: name, object, dtype, device and data: what planning must leave as it was."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [(name, id(t), t.dtype, t.device, t.data_ptr()) for name, t in tensors]


def _cast_copy(model: nn.Module) -> nn.Module:
    """The model as a bf16 checkpoint load holds it: floating parameters and persistent buffers cast."""
    copied = copy.deepcopy(model)
    cast_floating(copied, torch.bfloat16)
    return copied


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("make", [_llama, _gpt2, _falcon], ids=["llama", "gpt2", "falcon"])
def test_a_float32_model_planned_at_bfloat16_gets_the_plan_of_the_bfloat16_model(make: Any, mode: str) -> None:
    model = make()
    cast = _cast_copy(model)
    options: dict[str, Any] = {"example_inputs": (IDS,), "example_kwargs": {"labels": IDS}, "mode": mode}
    options["trace"] = "export"  # (transformers 5.x models do not trace with torch.fx)
    one = fxsplit.plan(cast, {"cpu:0": "1GiB"}, **options).memory["cpu:0"]["total"]
    budgets = {"cpu:0": int(0.85 * one), "cpu:1": int(0.85 * one)}  # split over both
    before = _state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxsplit.FxsplitWarning)
        planned = fxsplit.plan(model, budgets, dtype="bfloat16", **options)
    expected = fxsplit.plan(cast, budgets, **options)
    assert _state(model) == before  # the model's own tensors, untouched
    assert len(set(planned.param_devices.values())) == 2
    assert planned.placement == expected.placement and planned.cuts == expected.cuts
    assert planned.memory == expected.memory
    assert planned.fingerprint == describe(model)[0]  # the float32 model's, which the plan applies to
    assert planned.tied == expected.tied

    split = fxsplit.apply(cast, planned, example_inputs=(IDS,), example_kwargs={"labels": IDS})
    reference = _cast_copy(model)
    torch.testing.assert_close(split(IDS, labels=IDS).loss, reference(IDS, labels=IDS).loss, rtol=0, atol=0)


def test_the_float32_work_of_a_bfloat16_model_counts_at_float32() -> None:
    """torch.fx and torch.export alike; the float32 inputs are fed as bf16, as the bf16 model is."""
    model = nn.Sequential(Attention(), nn.ReLU(), Attention())
    x = torch.randn(4, 16, 32)
    for trace in ("fx", "export"):
        planned = fxsplit.plan(model, {"cpu:0": "1MiB"}, example_inputs=(x,), dtype="bfloat16", trace=trace)
        cast = fxsplit.plan(model.to(torch.bfloat16), {"cpu:0": "1MiB"}, example_inputs=(x.bfloat16(),), trace=trace)
        model.float()
        assert planned.memory == cast.memory
        as_float32 = fxsplit.plan(model, {"cpu:0": "1MiB"}, example_inputs=(x,), trace=trace).memory["cpu:0"]
        # the float32 scores (4 x 16 x 16 x 4 B) are more than half the float32 model's
        assert planned.memory["cpu:0"]["activations_peak"] > as_float32["activations_peak"] // 2
        assert all(p.dtype == torch.float32 and not p.is_meta for p in model.parameters())


class Normed(nn.Module):
    """A bf16 layer norm keeps its mean and reciprocal deviation for the backward: bf16 on the CPU, float32 on
    ``meta`` (the CUDA kernel's choice)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.proj(x))
        return nn.functional.mse_loss(y, torch.zeros_like(y))


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_meta_weights_are_sized_with_the_kernels_of_the_inputs_device(trace: str) -> None:
    """Stood in for (real weights) or built on ``meta``, the weights run as fakes on the inputs' device, so a
    training plan counts the layer norm's statistics as the CPU keeps them, as for the cast model: fx once ran
    them on ``meta``, at float32 (seed 50035 of ``tests/standin_fuzz.py``)."""
    torch.manual_seed(0)
    model = Normed().train()
    x = torch.randn(8, 6, 32)
    options = {"mode": "training", "optimizer": "sgd", "trace": trace}
    as_cast = fxsplit.plan(_cast_copy(model), {"cpu:0": "1MiB"}, example_inputs=(x.bfloat16(),), **options)
    stood_in = fxsplit.plan(model, {"cpu:0": "1MiB"}, example_inputs=(x,), dtype="bfloat16", **options)
    with fxsplit.empty_weights():
        on_meta = Normed().train().bfloat16()
    built_on_meta = fxsplit.plan(on_meta, {"cpu:0": "1MiB"}, example_inputs=(x.bfloat16(),), **options)
    assert stood_in.memory == as_cast.memory == built_on_meta.memory


def test_a_model_that_does_not_run_at_the_dtype_is_planned_as_given_and_says_so() -> None:
    """bf16 matrices have no inverse in torch: with meta parameters (cast) or real
    ones (stood in for), the plan falls back to the model as given, its floating tensors counted as bf16, and
    says so; the model is left as it was."""
    for model, given in _real_and_on_meta(Inverse):
        before = _state(model)
        for trace in ("fx", "export"):
            with pytest.warns(fxsplit.FxsplitWarning, match="the model cast to bfloat16 could not be traced"):
                fallback = fxsplit.plan(
                    model, {"cpu:0": "1MiB"}, example_inputs=(given,), dtype="bfloat16", trace=trace
                )
            as_float32 = fxsplit.plan(model, {"cpu:0": "1MiB"}, example_inputs=(given,), trace=trace).memory["cpu:0"]
            assert fallback.memory["cpu:0"]["params"] * 2 == as_float32["params"]
            assert 0 < fallback.memory["cpu:0"]["activations_peak"] < as_float32["activations_peak"]  # (int pivots)
            assert _state(model) == before


class Branches(Projected):
    """Branches on its input's values in Python: no trace can follow that, at any dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y.relu() if y.sum() > 0 else -y


def test_a_model_that_traces_at_no_dtype_gets_its_trace_error_alone() -> None:
    """The fallback is for a model that does not run at the dtype: one that fails as given too is refused with
    its own error, and no warning that it was planned as given (it was not planned at all)."""
    for model, given in _real_and_on_meta(Branches):
        before = _state(model)
        for trace in ("fx", "export"):
            with warnings.catch_warnings(record=True) as caught, pytest.raises(fxsplit.TraceError):
                warnings.simplefilter("always")
                fxsplit.plan(model, {"cpu:0": "1MiB"}, example_inputs=(given,), dtype="bfloat16", trace=trace)
            assert not [w for w in caught if issubclass(w.category, fxsplit.FxsplitWarning)], trace
            assert _state(model) == before


class Float32Head(nn.Module):
    """Its head is fed float32 (``h.float()``): once its weights are bf16, that matmul does not run."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).float())


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_model_that_mixes_dtypes_at_the_dtype_is_planned_with_a_warning_that_names_the_op(trace: str) -> None:
    """Fake kernels do not check dtypes, so the model traces at bf16 and is planned; it would fail when it runs,
    and the plan says where. A model that converts its float32 work back (Attention) gets no such warning."""
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="dtype"):
        _cast_copy(Float32Head())(x.bfloat16())  # what the split would meet
    said = r"kernels need one: '(head|linear_1)' takes bfloat16 and float32( \(at .*test_plan_dtype.*\))?;"
    for model, given in _real_and_on_meta(Float32Head):
        with pytest.warns(fxsplit.FxsplitWarning, match=said):
            fxsplit.plan(model, {"cpu:0": "1MiB"}, example_inputs=(given,), dtype="bfloat16", trace=trace)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxsplit.FxsplitWarning)
        fxsplit.plan(
            Attention(), {"cpu:0": "1MiB"}, example_inputs=(torch.randn(2, 8, 32),), dtype="bfloat16", trace=trace
        )


class NormOfUpcast(nn.Module):
    """A norm of a value the model upcasts to float32: its weights, cast to bf16, no longer match the input."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.body, self.norm, self.bn = nn.Linear(8, 8), nn.LayerNorm(8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x).float()
        if self.functional:
            return nn.functional.layer_norm(h, (8,), self.norm.weight, self.norm.bias)
        return self.bn(h)


class IndexWrite(nn.Module):
    """``x[idx] = y`` of a bf16 value into a float32 tensor (refused), or of a 0-d one under a mask (runs)."""

    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.masked = masked
        self.body = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        out = torch.zeros(4, 8)
        if self.masked:
            return out.index_put((out >= 0,), h[0, 0])
        return out.index_put((torch.tensor([0, 1]),), h[:2])


class NormsThatRun(nn.Module):
    """Mixes that the kernels take: a bf16 input beside float32 norm weights, rms_norm, elementwise ops."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        low = nn.functional.layer_norm(h, (8,), self.norm.weight.float(), self.norm.bias.float())
        return nn.functional.rms_norm(h.float(), (8,), self.norm.weight) + low * h.float()


REFUSED = [  # a model, and the op whose mixed dtypes its cast copy's kernels refuse (None: it runs)
    (lambda: NormOfUpcast(functional=True), "layer_norm"),
    (lambda: NormOfUpcast(functional=False), "bn|batch_norm"),
    (lambda: IndexWrite(masked=False), "index_put"),
    (lambda: IndexWrite(masked=True), None),
    (NormsThatRun, None),
]
REFUSED_IDS = ["layer_norm", "batch_norm", "index_put", "masked_fill", "runs"]


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize(("make", "refused"), REFUSED, ids=REFUSED_IDS)
def test_norms_and_index_writes_warn_exactly_when_the_cast_model_fails(
    make: Any, refused: str | None, trace: str
) -> None:
    """Norms take a bf16 input beside float32 weights but not the other way round; ``index_put`` takes one dtype
    unless it is a masked fill of a 0-d value. Each warning stands for a failure of the cast model, and each
    model without one runs."""
    x = torch.randn(4, 8)
    cast = _cast_copy(make().eval())
    if refused is None:
        cast(x.bfloat16())
    else:
        with pytest.raises(RuntimeError, match="dtype|scalar type"):
            cast(x.bfloat16())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fxsplit.plan(make().eval(), {"cpu:0": "1MiB"}, example_inputs=(x,), dtype="bfloat16", trace=trace)
    said = [str(w.message) for w in seen if issubclass(w.category, fxsplit.FxsplitWarning)]
    if refused is None:
        assert said == []
    else:
        assert len(said) == 1
        assert re.search(rf"kernels need one: '({refused})(_\d+)?' takes bfloat16 and float32", said[0]), said[0]


class Outer(nn.Module):
    """A layer before ``inner``, which torch.fx is told to keep whole (a leaf): the graph holds one op for it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.pre, self.inner = nn.Linear(8, 8), inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.pre(x))


_INSIDE = {"layer_norm": "native_layer_norm", "bn|batch_norm": "native_batch_norm", "index_put": "index_put"}


@pytest.mark.parametrize(("make", "refused"), REFUSED, ids=REFUSED_IDS)
def test_ops_inside_a_leaf_module_warn_exactly_when_the_cast_model_fails(make: Any, refused: str | None) -> None:
    """A module fx keeps whole hides its ops from the graph: the shape propagation looks inside it with the same
    rules, and the warning names the module's op, the aten op and the line of the module's code that mixes."""
    x = torch.randn(4, 8)
    cast = _cast_copy(Outer(make()).eval())
    if refused is None:
        cast(x.bfloat16())
    else:
        with pytest.raises(RuntimeError, match="dtype|scalar type"):
            cast(x.bfloat16())
    model = Outer(make()).eval()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        planned = fxsplit.plan(
            model,
            {"cpu:0": "1MiB"},
            example_inputs=(x,),
            dtype="bfloat16",
            trace="fx",
            leaf_modules=[type(model.inner)],
        )
    assert planned.placement["inner"] == "cpu:0"  # one op: the module was kept whole
    said = [str(w.message) for w in seen if issubclass(w.category, fxsplit.FxsplitWarning)]
    if refused is None:
        assert said == []
    else:
        assert len(said) == 1
        inside = rf"'inner' takes bfloat16 and float32 inside its module \(aten\.{_INSIDE[refused]}\.\w+ at "
        assert re.search(inside + r'"[^"]*test_plan_dtype\.py", line \d+, in forward: ', said[0]), said[0]


def test_a_model_planned_at_its_own_dtype_or_without_inputs_is_not_stood_in_for() -> None:
    """Nothing to cast, or no inputs (no activations to count): a model with real weights is traced as it is; a
    meta one is cast (free) and planned without a warning."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    seen: list[bool] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module[0].weight.is_meta))
    fxsplit.plan(model, {"cpu:0": "1MiB"}, dtype="float32", example_inputs=(torch.randn(2, 8),), trace="export")
    weights = fxsplit.plan(model, {"cpu:0": "1MiB"}, dtype="bfloat16", trace="fx", mode="weights")
    assert seen and not any(seen) and weights.memory["cpu:0"]["params"] == (64 + 8) * 2 * 2
    with fxsplit.empty_weights():
        on_meta = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with warnings.catch_warnings():  # cast without inputs: the graph has no sizes, which says nothing of the cast
        warnings.simplefilter("error", fxsplit.FxsplitWarning)
        cast = fxsplit.plan(on_meta, {"cpu:0": "1MiB"}, dtype="bfloat16", trace="fx", mode="weights")
    assert cast.memory == weights.memory and all(p.dtype == torch.float32 for p in on_meta.parameters())


def test_planning_inputs_keep_one_tensor_one_and_its_gradient() -> None:
    ids = torch.arange(6).view(2, 3)
    x = torch.randn(2, 3, requires_grad=True)
    (a, b, c, d), kwargs = planning_inputs(((ids, x, 1.5, x), {"labels": ids, "mask": None}), torch.bfloat16)
    assert a is ids and kwargs["labels"] is ids and c == 1.5 and kwargs["mask"] is None
    assert b is d and b.dtype == torch.bfloat16 and b.requires_grad and b.is_leaf and x.dtype == torch.float32
    half = x.detach().bfloat16()
    assert planning_inputs((half,), torch.bfloat16)[0] is half


class PatchEmbed(nn.Module):
    """A persistent buffer registered as a view (``table.float().unsqueeze(0)``: diffusers' patch embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(4, 8, 2, stride=2)
        self.register_buffer("pos_embed", torch.arange(128.0).reshape(16, 8).float().unsqueeze(0))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x).flatten(2).transpose(1, 2) + self.pos_embed)


def test_a_buffer_that_is_a_view_is_cast_for_a_checkpoint_at_the_dtype(tmp_path: Any) -> None:
    """Before, cast as a view (new data, its base left float32), torch's fake tensors refused it, and a model built
    empty and loaded from a checkpoint at bfloat16 was refused (diffusers sweep: PixArt)."""
    torch.manual_seed(0)
    reference = PatchEmbed()
    assert reference.pos_embed._base is not None
    torch.save(reference.state_dict(), tmp_path / "model.pt")
    x = torch.randn(2, 4, 8, 8, dtype=torch.bfloat16)
    with fxsplit.empty_weights():
        empty = PatchEmbed()
    held = empty.pos_embed
    plan = fxsplit.plan(empty, {"cpu:0": 1 << 20}, example_inputs=(x,), trace="export", dtype="bfloat16")
    assert plan.dtype == "bfloat16" and empty.pos_embed is held and held.dtype == torch.float32  # put back
    split = fxsplit.fxsplit(
        empty,
        {"cpu:0": 1 << 20},
        example_inputs=(x,),
        trace="export",
        dtype="bfloat16",
        checkpoint=tmp_path / "model.pt",
    )
    torch.testing.assert_close(split(x), reference.to(torch.bfloat16)(x), rtol=0, atol=0)
