"""dynamic_shapes: torch.export splits that take other batch sizes (or any size), and clear errors when not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from helpers import assert_same_grads, tensor_bytes

import fxsplit
from fxsplit.errors import FxsplitError, InputMismatchError, SpecError, TraceError

transformers = pytest.importorskip("transformers")


class Tokens(nn.Module):
    """(batch, time, features) -> same; a per-token MLP with a residual."""

    def __init__(self, dim: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


class FixedBatch(nn.Module):
    """Adds a (4, 8) tensor: the batch must be 4, whatever the caller asks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.register_buffer("bias", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + self.bias)


def budgets(model: nn.Module) -> dict[str, int]:
    half = tensor_bytes(model) // 2 + 400
    return {"cpu:0": half, "cpu:1": half}


def pair(make: Any = Tokens) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = make()
    reference = make()
    reference.load_state_dict(model.state_dict())
    return model, reference


def assert_same_at_batches(
    split: nn.Module, model: nn.Module, reference: nn.Module, batches: tuple[int, ...], grads_at: int
) -> None:
    """Outputs equal the unsplit model's at every batch size, and gradients at one more."""
    for batch in batches:
        x = torch.randn(batch, 5, 8)
        torch.testing.assert_close(split(x).to("cpu"), reference(x))
    x = torch.randn(grads_at, 5, 8)
    split(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert_same_grads(model, reference)


@pytest.mark.slow  # ~10 s
def test_batch_may_vary_forward_and_backward() -> None:
    model, reference = pair()
    gm = fxsplit.fxsplit(
        model, budgets(model), example_inputs=(torch.randn(4, 5, 8),), mode="weights", dynamic_shapes="batch"
    )
    plan = gm.meta["fxsplit_plan"]
    assert plan.trace == "export" and plan.dynamic_shapes == "batch"
    assert len(set(plan.param_devices.values())) == 2
    assert_same_at_batches(gm, model, reference, (1, 3, 4, 9), grads_at=7)
    with pytest.raises(InputMismatchError, match=r"traced with x: float32\[any, 5, 8\].*dynamic_shapes='all'"):
        gm(torch.randn(3, 6, 8))  # the time dimension stayed fixed


def test_all_sizes_may_vary() -> None:
    model, reference = pair()
    gm = fxsplit.fxsplit(
        model, budgets(model), example_inputs=(torch.randn(4, 5, 8),), mode="weights", dynamic_shapes="all"
    )
    assert gm.meta["fxsplit_plan"].dynamic_shapes == "all"
    for shape in ((2, 3, 8), (6, 11, 8)):
        x = torch.randn(*shape)
        torch.testing.assert_close(gm(x).to("cpu"), reference(x))
    with pytest.raises(InputMismatchError, match="traced with x: float32\\[any, any, 8\\]"):
        gm(torch.randn(2, 3, 9))  # features are fixed by the weights


def test_without_dynamic_shapes_other_sizes_get_a_clear_error() -> None:
    model, _ = pair()
    gm = fxsplit.fxsplit(model, budgets(model), example_inputs=(torch.randn(4, 5, 8),), mode="weights")
    assert gm.meta["fxsplit_plan"].dynamic_shapes is None
    with pytest.raises(InputMismatchError) as caught:
        gm(torch.randn(2, 5, 8))
    message = str(caught.value)
    assert "x.size()[0] == 4" in message and "x: float32[4, 5, 8]" in message
    assert "dynamic_shapes='batch'" in message and "trace='fx'" in message
    assert isinstance(caught.value, ValueError)


class Flagged(Tokens):
    """Tokens with a non-tensor keyword input, like Hugging Face's ``use_cache``."""

    def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
        out = super().forward(x)
        return out * 2 if double else out


def test_a_non_tensor_input_other_than_traced_says_to_split_with_that_value() -> None:
    model, reference = pair(Flagged)
    x = torch.randn(4, 5, 8)
    gm = fxsplit.fxsplit(
        model,
        budgets(model),
        example_inputs=(x,),
        example_kwargs={"double": False},
        mode="weights",
        dynamic_shapes="batch",
    )
    torch.testing.assert_close(gm(x), reference(x))
    with pytest.raises(InputMismatchError) as caught:
        gm(x, double=True)
    message = str(caught.value)
    assert "double == False" in message and "split again with example_kwargs={'double': True}" in message
    assert "dynamic_shapes=" not in message  # no shape spec can vary a value export fixed
    with pytest.raises(InputMismatchError, match="dynamic_shapes='all'"):  # a tensor's size: still dynamic_shapes
        gm(torch.randn(4, 6, 8))


def test_a_batch_the_model_fixes_is_reported_by_input() -> None:
    model, _ = pair(FixedBatch)
    with pytest.raises(TraceError, match=r"kept the batch size fixed for 'x' \(batch 4\).*depends on its value"):
        fxsplit.fxsplit(
            model, budgets(model), example_inputs=(torch.randn(4, 8),), mode="weights", dynamic_shapes="batch"
        )


def test_an_example_batch_of_one_is_refused_with_the_reason() -> None:
    model, _ = pair()
    with pytest.raises(TraceError, match="at least 2"):
        fxsplit.fxsplit(
            model, budgets(model), example_inputs=(torch.randn(1, 5, 8),), mode="weights", dynamic_shapes="batch"
        )


def test_bad_values_are_refused() -> None:
    model, _ = pair()
    with pytest.raises(SpecError, match="dynamic_shapes must be one of batch, all"):
        fxsplit.plan(model, budgets(model), example_inputs=(torch.randn(4, 5, 8),), dynamic_shapes="bach")


def test_fx_graphs_take_any_size_and_record_nothing() -> None:
    model, reference = pair()
    gm = fxsplit.fxsplit(
        model,
        budgets(model),
        example_inputs=(torch.randn(4, 5, 8),),
        mode="weights",
        trace="fx",
        dynamic_shapes="batch",
    )
    assert gm.meta["fxsplit_plan"].dynamic_shapes is None
    x = torch.randn(3, 2, 8)
    torch.testing.assert_close(gm(x).to("cpu"), reference(x))


def test_saved_plans_apply_with_the_same_dynamism() -> None:
    model, reference = pair()
    x = torch.randn(4, 5, 8)
    plan = fxsplit.plan(model, budgets(model), example_inputs=(x,), mode="weights", dynamic_shapes="batch")
    text = plan.to_yaml()
    assert "dynamic_shapes: batch" in text
    loaded = fxsplit.Plan.from_yaml(text)
    assert loaded == plan
    gm = fxsplit.apply(model, loaded, example_inputs=(x,))
    y = torch.randn(6, 5, 8)
    torch.testing.assert_close(gm(y).to("cpu"), reference(y))


def test_custom_specs_must_be_passed_again_to_apply() -> None:
    model, reference = pair()
    x = torch.randn(4, 5, 8)
    spec = {"x": {0: torch.export.Dim("batch", min=1, max=64)}}
    plan = fxsplit.plan(model, budgets(model), example_inputs=(x,), mode="weights", dynamic_shapes=spec)
    assert plan.dynamic_shapes == "custom"
    with pytest.raises(FxsplitError, match="custom dynamic_shapes spec; pass the same"):
        fxsplit.apply(model, plan, example_inputs=(x,))
    gm = fxsplit.apply(model, plan, example_inputs=(x,), dynamic_shapes=spec)
    y = torch.randn(10, 5, 8)
    torch.testing.assert_close(gm(y).to("cpu"), reference(y))
    with pytest.raises(InputMismatchError, match="wider dynamic_shapes spec"):
        gm(torch.randn(65, 5, 8))


def test_spec_files_set_it() -> None:
    model, reference = pair()
    each = budgets(model)["cpu:0"]
    spec = fxsplit.load_spec(f"devices: {{cpu:0: {each}, cpu:1: {each}}}\ndynamic_shapes: batch\nmode: weights\n")
    gm = fxsplit.fxsplit(model, spec=spec, example_inputs=(torch.randn(4, 5, 8),))
    assert gm.meta["fxsplit_plan"].dynamic_shapes == "batch"
    y = torch.randn(2, 5, 8)
    torch.testing.assert_close(gm(y).to("cpu"), reference(y))


@pytest.mark.slow  # GPT-2: ~11 s
def test_gpt2_takes_any_batch_with_its_keyword_inputs() -> None:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=160, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    reference = transformers.GPT2LMHeadModel(config).eval()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 160, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    gm = fxsplit.fxsplit(
        model,
        {"cpu:0": "100KiB", "cpu:1": "100KiB"},
        example_inputs=(ids,),
        example_kwargs={"attention_mask": mask, "use_cache": False},
        dynamic_shapes="batch",
    )
    assert len(set(gm.meta["fxsplit_plan"].param_devices.values())) == 2
    with torch.no_grad():
        for batch in (1, 5):
            ids = torch.randint(0, 160, (batch, 8))
            mask = torch.ones(batch, 8, dtype=torch.long)
            mask[0, :3] = 0
            torch.testing.assert_close(
                gm(ids, attention_mask=mask).logits.to("cpu"),
                reference(ids, attention_mask=mask, use_cache=False).logits,
            )


def test_pipelines_of_a_dynamic_batch_take_any_batch_that_splits_into_chunks() -> None:
    model, reference = pair()
    piped = fxsplit.fxsplit(
        model,
        budgets(model),
        example_inputs=(torch.randn(8, 5, 8),),
        mode="weights",
        pipeline=4,
        dynamic_shapes="batch",
    )
    assert isinstance(piped, fxsplit.Pipeline)
    assert_same_at_batches(piped, model, reference, (8, 16, 10), grads_at=12)  # 10 rows: micro-batches 3, 3, 2, 2


def test_pipelines_of_a_fixed_batch_say_how_to_vary_it() -> None:
    model, _ = pair()
    piped = fxsplit.fxsplit(model, budgets(model), example_inputs=(torch.randn(8, 5, 8),), mode="weights", pipeline=4)
    with pytest.raises(FxsplitError, match="micro-batches of 2 rows.*dynamic_shapes='batch'"):
        piped(torch.randn(16, 5, 8))


class _NormedSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)).softmax(-1)


def test_the_activation_profile_of_a_dynamic_batch_counts_plain_bytes() -> None:
    """Bytes of tensors whose batch is symbolic were SymInts; the fit loop hashed budgets made from them and
    planning GPT-2 as a pipeline over a dynamic batch failed with torch's "unhashable type: non-nested SymInt"."""
    from fxsplit.cost.build import build_problem
    from fxsplit.memory.activations import profile_activations
    from fxsplit.tracing.capture import trace

    model = _NormedSoftmax()
    traced = trace(model, example_inputs=(torch.randn(4, 16),), mode="export", dynamic_shapes="batch")
    costs = build_problem(traced.graph_module, model, device_index={"cpu:0": 0})
    profile = profile_activations(traced.graph_module, costs, training=True)
    assert profile is not None
    counts = [*profile.storage_bytes.values(), *(v.nbytes for v in profile.values.values())]
    counts += [n for kind in ("internal", "backward_internal", "internal_saved") for n in profile.per_op(kind)]
    assert counts and all(type(n) is int for n in counts)
    fixed = profile_activations(
        trace(model, example_inputs=(torch.randn(4, 16),), mode="export").graph_module, costs, training=True
    )
    assert fixed is not None and profile.storage_bytes == fixed.storage_bytes  # the example's batch, as if fixed


def test_gpt2_pipeline_over_a_dynamic_batch_says_what_does_not_fit() -> None:
    """The benchmarks' GPT-2 at 0.7 of its parameters per device needs the fit loop's second round, whose caps
    came from those SymInt bytes: a TypeError from inside the partitioner, not the BudgetError that says why."""
    from benchmarks.models import case_by_name

    case = case_by_name("gpt2")
    model, (ids,) = case.build(), case.inputs()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    budgets = {"cpu:0": int(total * 0.7), "cpu:1": int(total * 0.7)}
    with pytest.raises(fxsplit.BudgetError, match=r"'cpu:1' needs .* short by"):
        fxsplit.plan(
            model, budgets, example_inputs=(torch.cat([ids, ids]),), trace="export", dynamic_shapes="batch", pipeline=2
        )


class _PicksRows(nn.Module):
    """As many rows as the data says: a size torch.export leaves without a value (as a router's tokens per expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h[h[:, 0] > 0]).sum(0)


def test_a_size_the_data_decides_is_said_so_without_blaming_the_inputs() -> None:
    """Found by a sweep of Hugging Face models (JetMoE, X-MOD): the warning said to pass example inputs the model
    runs on, which it did; no other inputs would give such a size a value."""
    with pytest.warns(fxsplit.FxsplitWarning, match=r"depends on the values of the data") as caught:
        fxsplit.plan(_PicksRows(), {"cpu:0": "1MiB"}, example_inputs=(torch.randn(16, 8),), mode="inference")
    said = " ".join(str(w.message) for w in caught)
    assert "activations not counted" in said and "pass example_inputs the model runs on" not in said
