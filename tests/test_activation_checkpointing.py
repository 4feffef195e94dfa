"""Models that call ``torch.utils.checkpoint``: the split keeps each call of a module whole and checkpoints it
again (:mod:`fxsplit.tracing.keptcheckpoint`), so it computes the model's values and gradients and holds what eager
checkpointing holds, which the plan counts to the byte; a call it cannot keep is traced as a plain call, with a
warning in training.

Before :mod:`fxsplit.tracing.checkpoints`, a reentrant checkpoint (``use_reentrant=True``) was traced as its
``no_grad`` forward by both tracers: the checkpointed block's parameters got no gradient and the layers before
it got one that missed the block's path, with no error when another path carried the loss
(:class:`Skip` below). Non-reentrant checkpointing (and Hugging Face's ``gradient_checkpointing_enable``) was
dropped without a word.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import fxsplit
from fxsplit import FxsplitWarning, PipelineConfig
from fxsplit.check import DeviceChecker
from fxsplit.tracing import trace as fxsplit_trace
from fxsplit.tracing.checkpoints import checkpointing_message, plain_checkpoints
from tests.helpers import split_and_compare

TRACES = ("fx", "export")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 48), nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Skip(nn.Module):
    """``head(h) + checkpoint(block, h)`` per block: the loss reaches ``pre`` around each block too, so a block
    traced under no_grad still gives a backward that runs, with wrong gradients."""

    def __init__(self, reentrant: bool, blocks: int = 4) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.pre = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


class Sequential(nn.Module):
    """``checkpoint_sequential`` over four blocks in two segments, and a plain function checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.body = nn.Sequential(*(Block() for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint_sequential(self.body, 2, self.pre(x), use_reentrant=True)
        return checkpoint(_scaled_tanh, h, use_reentrant=False)


def _scaled_tanh(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * 2


def _budgets(model: nn.Module) -> dict[str, int]:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"cpu:0": 6 * total, "cpu:1": 6 * total}  # room for gradients, Adam state and activations


PINS = {"pre": "cpu:0", "blocks.2": "cpu:1"}


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_blocks_are_kept_whole_with_the_models_gradients(trace: str, reentrant: bool) -> None:
    """torch.export: one op per call; torch.fx: the call traced, then its nodes folded into one call."""
    torch.manual_seed(0)
    model = Skip(reentrant)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        gm = split_and_compare(model, _budgets(model), (torch.randn(8, 16),), mode="training", pins=PINS, trace=trace)
    assert all(p.grad is not None for p in model.blocks.parameters())  # split_and_compare compared them
    kept = "torch.ops.fxsplit_functions.checkpointed.default(" if trace == "export" else "fxsplit_checkpointed_blocks_"
    assert gm.code.count(kept) == 4
    placement = gm.meta["fxsplit_plan"].param_devices
    assert placement["blocks.2.up.weight"] == placement["blocks.2.down.bias"] == "cpu:1"  # pinned by its path
    assert issubclass(torch_checkpoint.CheckpointFunction, torch.autograd.Function)  # put back


class ReturnsNone(nn.Module):
    """Each checkpointed block returns ``(h, None)``, as Hugging Face layers return an unused attention map: the
    ``None`` is a leaf of the result beside the tensor (under export, stop 39's code took it for a tensor's place and
    failed with an empty ``StopIteration``: Falcon, T5, DeBERTa-v2 and Swin with gradient checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(_Pair() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        for block in self.blocks:
            h, nothing = checkpoint(block, h, use_reentrant=False)
            assert nothing is None
        return h


class _Pair(Block):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return x + super().forward(x), None


class Chained(nn.Module):
    """``h = checkpoint(block, h)``, call after call: each call reads what the one before returned (under torch.fx,
    stop 39's code folded the first call, then gave the second its erased result node: a KeyError from deep in
    planning)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return h


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("make", [ReturnsNone, Chained], ids=["returns-none", "chained"])
def test_checkpointed_blocks_chained_or_returning_none_beside_their_tensor(make: type, trace: str) -> None:
    torch.manual_seed(0)
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        gm = split_and_compare(model, _budgets(model), (torch.randn(8, 16),), mode="training", pins=PINS, trace=trace)
    kept = "torch.ops.fxsplit_functions.checkpointed.default(" if trace == "export" else "fxsplit_checkpointed_blocks_"
    assert gm.code.count(kept) == 4


class Wide(nn.Module):
    """Six blocks of 64 -> 256 -> 64 on a batch of 32, each checkpointed (or not), with a residual."""

    def __init__(self, reentrant: bool | None, blocks: int = 6) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.pre = nn.Linear(64, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(6))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        for block in self.blocks:
            h = h + (block(h) if self.reentrant is None else checkpoint(block, h, use_reentrant=self.reentrant))
        return self.head(h)


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_the_plan_covers_what_the_allocator_holds_and_less_than_without_checkpoints(
    trace: str, reentrant: bool
) -> None:
    """Each block's input and the generator state it stashes are held to its backward, which recomputes it (and
    copies the generator's state while it does): the plan is the allocator's peak per device, or above it by at
    most that copy where it is not at the peak, and well below the same model's without checkpointing."""
    from fxsplit.memory.allocmeter import allocated_peaks

    x = torch.randn(32, 64)
    peaks = {}
    for how in (reentrant, None):
        torch.manual_seed(0)
        model = Wide(how).train()
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        budgets = {"cpu:0": 8 * total, "cpu:1": 8 * total}
        options = {
            "mode": "training",
            "optimizer": "sgd",
            "trace": trace,
            "pins": {"pre": "cpu:0", "blocks.3": "cpu:1"},
        }
        gm = fxsplit.fxsplit(model, budgets, example_inputs=(x,), **options)
        planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
        allocated = allocated_peaks(gm, x, backward=True, internal=True)
        assert allocated.keys() == planned.keys()
        for device, nbytes in allocated.items():
            assert nbytes <= planned[device] <= nbytes + torch.get_rng_state().numel(), (planned, allocated)
        peaks[how] = planned
    for device, nbytes in peaks[reentrant].items():
        assert nbytes < 0.8 * peaks[None][device], peaks


@pytest.mark.parametrize("trace", TRACES)
def test_checkpoint_sequential_and_a_checkpointed_function(trace: str) -> None:
    """``checkpoint_sequential``'s segments run two blocks each: the first is kept, reading those blocks' weights
    (torch runs the last one plainly); the plain function is kept too (it runs no module)."""
    torch.manual_seed(0)
    model = Sequential()
    pins = {"pre": "cpu:0", "body.2": "cpu:1"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        split_and_compare(model, _budgets(model), (torch.randn(8, 16),), trace=trace, mode="training", pins=pins)
    traced = fxsplit_trace(model, example_inputs=(torch.randn(8, 16),), mode=trace)
    # torch runs the last segment plainly
    assert traced.checkpoint_kept == ("body.0, body.1", "_scaled_tanh") and not traced.checkpointed


def checkpoint_seq(functions: nn.Sequential, x: torch.Tensor, every: int = 1) -> torch.Tensor:
    """timm's ``checkpoint_seq`` (``model.set_grad_checkpointing()`` in ViT, ConvNeXt, ...), distilled: each segment
    runs modules ``start`` to ``end`` of the whole tuple its runner closes over."""

    def run_function(start: int, end: int, functions: tuple[nn.Module, ...]) -> Any:
        def forward(h: torch.Tensor) -> torch.Tensor:
            for j in range(start, end + 1):
                h = functions[j](h)
            return h

        return forward

    modules = tuple(functions.children())
    for start in range(0, len(modules), every):
        end = min(start + every - 1, len(modules) - 1)
        x = checkpoint(run_function(start, end, modules), x, use_reentrant=False)
    return x


class TimmStyle(Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_seq(self.body, self.pre(x), every=2)


@pytest.mark.parametrize("trace", TRACES)
def test_timm_s_checkpoint_seq_segments_read_their_own_blocks_weights(trace: str) -> None:
    """Before, each kept segment read every block's weights (the runner closes over all of them), so a model with
    timm's gradient checkpointing on could not be split under budgets its plain twin splits under (timm sweep)."""
    torch.manual_seed(0)
    model = TimmStyle()
    traced = fxsplit_trace(model, example_inputs=(torch.randn(8, 16),), mode=trace)
    assert traced.checkpoint_kept == ("body.0, body.1", "body.2, body.3")
    x = torch.randn(8, 16)
    whole = fxsplit.plan(model, {"cpu:0": 1 << 30}, example_inputs=(x,), trace=trace, mode="training")
    need = whole.memory["cpu:0"]["total"]  # one device's; each of two gets 70% of it
    split = split_and_compare(
        model, {"cpu:0": need * 7 // 10, "cpu:1": need * 7 // 10}, (x,), trace=trace, mode="training"
    )
    homes = split.meta["fxsplit_plan"].param_devices
    assert [homes[f"body.{k}.up.weight"] for k in range(4)] == ["cpu:0", "cpu:0", "cpu:1", "cpu:1"]


@pytest.mark.parametrize("trace", TRACES)
def test_a_call_whose_closure_holds_a_tensor_is_traced_plainly_with_a_warning(trace: str) -> None:
    class Closes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre, self.block, self.head = nn.Linear(16, 16), Block(), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.pre(x)
            return self.head(checkpoint(lambda t: self.block(t) * h, h, use_reentrant=False))

    torch.manual_seed(0)
    model = Closes()
    pins = {"pre": "cpu:0", "head": "cpu:1"}
    with pytest.warns(FxsplitWarning, match=r"1 call: 'the model'") as caught:
        split_and_compare(model, _budgets(model), (torch.randn(8, 16),), trace=trace, mode="training", pins=pins)
    said = str(next(w.message for w in caught if issubclass(w.category, FxsplitWarning)))
    assert "recomputing" in said and "argument" in said and "PipelineConfig(checkpoint='always')" in said


@pytest.mark.parametrize("mode", ["inference", "weights"])
def test_no_warning_where_nothing_is_recomputed(mode: str) -> None:
    model = Skip(True).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        gm = fxsplit.fxsplit(model, _budgets(model), example_inputs=(torch.randn(8, 16),), mode=mode, pins=PINS)
    x = torch.randn(8, 16)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


def test_under_no_grad_a_call_is_traced_plainly() -> None:
    """Without grad mode there is nothing to recompute: the blocks' ops are in the graph, to place one by one."""
    with torch.no_grad():
        traced = fxsplit_trace(Skip(False), example_inputs=(torch.randn(8, 16),), mode="export")
    assert not traced.checkpoint_kept and len(traced.checkpointed) == 4


def test_a_pipeline_that_recomputes_its_stages_too() -> None:
    torch.manual_seed(0)
    model = Skip(False)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        pipe = fxsplit.fxsplit(
            model,
            _budgets(model),
            example_inputs=(x,),
            mode="training",
            pins=PINS,
            pipeline=PipelineConfig(chunks=2, checkpoint="always"),
        )
    pipe(x).sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"grad of {n}: {m}")


def test_torch_checkpoint_is_restored_after_a_failed_trace() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(lambda t: t.reshape(7, -1), x, use_reentrant=True)

    before = (torch_checkpoint.CheckpointFunction, torch_checkpoint._checkpoint_without_reentrant_generator)
    with pytest.raises(fxsplit.FxsplitError):
        fxsplit.fxsplit(Fails(), {"cpu:0": "1MiB"}, example_inputs=(torch.randn(4, 4),), trace="export")
    assert (torch_checkpoint.CheckpointFunction, torch_checkpoint._checkpoint_without_reentrant_generator) == before
    caught = vars(torch_checkpoint.checkpoint.__wrapped__).get("__dynamo_disable")  # what a kept call goes through
    assert caught is None or "keeping_checkpoints" not in caught.__qualname__


def test_eager_checkpointing_recomputes_after_tracing() -> None:
    """Outside a trace the model's own checkpoint is untouched: its block runs again in backward."""
    calls: list[int] = []
    block = Block()
    block.register_forward_hook(lambda *_: calls.append(1))
    model = nn.Sequential(block)
    with plain_checkpoints(model) as met:
        checkpoint(block, torch.randn(2, 16, requires_grad=True), use_reentrant=True).sum().backward()
    assert met.plain == ["0"] and len(calls) == 1  # a plain call: no recomputation
    checkpoint(block, torch.randn(2, 16, requires_grad=True), use_reentrant=True).sum().backward()
    assert len(calls) == 3  # forward, then again in backward


def test_the_message_names_at_most_four_and_counts_calls() -> None:
    said = checkpointing_message(["a", "b", "a", "c", "d", "e", "f"])
    assert "7 calls: 'a', 'b', 'c', 'd' and 2 more" in said
    assert "1 call: 'the model'" in checkpointing_message(["the model"])


transformers = pytest.importorskip("transformers")


def _gpt2() -> Any:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=160, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_hugging_face_gradient_checkpointing(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = _gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ids = torch.randint(0, 160, (2, 16))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        gm = split_and_compare(
            model,
            {"cpu:0": 6 * total, "cpu:1": 6 * total},
            (ids,),
            trace="export",
            mode="training",
            pins={"transformer.h.0": "cpu:0", "transformer.h.1": "cpu:1"},
            loss=lambda out: out.logits.square().mean(),
        )
    assert gm.code.count("torch.ops.fxsplit_functions.checkpointed.default(") == 2  # each block kept whole
    plan = gm.meta["fxsplit_plan"]
    assert {plan.param_devices[f"transformer.h.{k}.mlp.c_fc.weight"] for k in (0, 1)} == {"cpu:0", "cpu:1"}


def test_hugging_face_mixture_of_experts_with_gradient_checkpointing() -> None:
    """Found by a sweep of Hugging Face families: Mixtral's experts choose ``grouped_mm`` unless compiling, and that
    op's fake kernel takes only bfloat16 on the CPU; export traced the fallback, but fxsplit's own runs of the kept
    calls on fake tensors (after the trace, and the recomputation) took ``grouped_mm`` and failed, blamed on the
    example inputs. Kept calls run on fakes as export traced them."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        use_cache=False,
        attention_dropout=0.0,
    )
    model = transformers.MixtralForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 128, (2, 12))
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)  # activations counted too
        gm = fxsplit.fxsplit(
            model,
            {"cpu:0": "4MiB", "cpu:1": "4MiB"},
            example_inputs=(ids,),
            example_kwargs={"use_cache": False},
            trace="export",
            mode="training",
            pins={"model.layers.0": "cpu:0", "model.layers.1": "cpu:1"},
        )
    assert gm.code.count("torch.ops.fxsplit_functions.checkpointed.default(") == 2
    assert not torch.compiler.is_compiling()  # the flags are put back
    # the experts make their sums with device=hidden.device: "cpu" for a tensor on logical cpu:0 (on GPUs, its device)
    with DeviceChecker(gm.meta["fxsplit_plan"], gm, model, host_anywhere=True) as checker:
        out = gm(ids, use_cache=False)
    assert checker.ops_checked > 0
    expected = reference(ids, use_cache=False)
    torch.testing.assert_close(out.logits, expected.logits)
    out.logits.square().mean().backward()
    expected.logits.square().mean().backward()
    grads = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name].grad, msg=name)


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = Block(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=True))


@pytest.mark.parametrize("trace", TRACES)
def test_a_kept_reentrant_checkpoint_of_inputs_without_grad_gives_none_as_eager_does(trace: str) -> None:
    """torch warns and gives the block no gradient (its input needs none); the kept call does the same."""
    torch.manual_seed(0)
    model = First()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "None of the inputs have requires_grad=True"
        options = {"mode": "training", "pins": {"head": "cpu:1"}, "trace": trace}
        gm = fxsplit.fxsplit(model, _budgets(model), example_inputs=(x,), **options)
        gm(x).sum().backward()
        reference(x).sum().backward()
    assert all(p.grad is None for p in model.block.parameters())
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"grad of {n}: {m}")


class FirstScaled(nn.Module):
    """``First`` whose checkpointed function closes over a value of the forward (so it is a plain call)."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = Block(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.new_ones(()) * 2
        return self.head(checkpoint(lambda t: self.block(t) * scale, x, use_reentrant=True))


@pytest.mark.parametrize("trace", TRACES)
def test_a_plain_reentrant_checkpoint_of_inputs_without_grad_still_gives_gradients(trace: str) -> None:
    """Traced plainly, the call does not know its inputs need no gradient: the split gives the block the
    gradient it has without checkpointing, where eager PyTorch gives none (documented in
    :mod:`fxsplit.tracing.checkpoints`)."""
    torch.manual_seed(0)
    model = FirstScaled()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 16)
    with pytest.warns(FxsplitWarning, match="1 call: 'the model'"):
        options = {"mode": "training", "pins": {"head": "cpu:1"}, "trace": trace}
        gm = fxsplit.fxsplit(model, _budgets(model), example_inputs=(x,), **options)
    gm(x).sum().backward()
    plain.head(plain.block(x) * 2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"grad of {n}: {m}")


def _llama() -> Any:
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=160,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def test_hugging_face_gradient_checkpointing_saves_what_the_plan_says() -> None:
    """Llama with ``gradient_checkpointing_enable``: the plan covers what the allocator holds per device (a few
    generator states above it) and is well below the same model's plan without checkpointing."""
    from fxsplit.memory.allocmeter import allocated_peaks

    ids = torch.randint(0, 160, (2, 48), generator=torch.Generator().manual_seed(0))
    peaks = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = _llama()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        pins = {"model.layers.0": "cpu:0", "model.layers.3": "cpu:1"}
        options = {"mode": "training", "optimizer": "sgd", "example_kwargs": {"use_cache": False}, "pins": pins}
        gm = fxsplit.fxsplit(model, {"cpu:0": 8 * total, "cpu:1": 8 * total}, example_inputs=(ids,), **options)
        planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
        if checkpointed:
            assert gm.code.count("torch.ops.fxsplit_functions.checkpointed.default(") == 4
            allocated = allocated_peaks(gm, ids, backward=True, internal=True, use_cache=False)
            for device, nbytes in allocated.items():
                assert nbytes <= planned[device] <= 1.1 * nbytes, (planned, allocated)
        peaks[checkpointed] = planned
    for device, nbytes in peaks[True].items():
        assert nbytes < 0.7 * peaks[False][device], peaks


def test_a_split_holds_the_model_it_checkpoints_only_while_it_lives() -> None:
    """The kept calls run the model's blocks; once the split and the model are dropped, the blocks are freed."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = Skip(False)
    gm = fxsplit.fxsplit(
        model, _budgets(model), example_inputs=(torch.randn(8, 16),), mode="training", pins=PINS, trace="export"
    )
    gm(torch.randn(8, 16)).sum().backward()
    gone = weakref.ref(model.blocks[0])
    del model
    gc.collect()
    assert gone() is not None  # the split still runs it
    gm(torch.randn(8, 16)).sum().backward()
    del gm
    gc.collect()
    assert gone() is None


def test_tracing_leaves_nothing_of_itself_in_torch() -> None:
    """torch.distributed's composable checkpoint imports torch's non-reentrant generator by name, lazily (export
    imports it): a stand-in installed on torch.utils.checkpoint while tracing was kept there for good, with the
    model it closed over. Nothing importable is replaced now, and a planned model is freed with its split."""
    import gc
    import sys
    import weakref

    model = Skip(False)
    gm = fxsplit.fxsplit(model, _budgets(model), example_inputs=(torch.randn(8, 16),), trace="export", pins=PINS)
    composable = sys.modules.get("torch.distributed._composable.checkpoint_activation")
    if composable is not None:
        assert composable._checkpoint_without_reentrant_generator is (
            torch_checkpoint._checkpoint_without_reentrant_generator
        )
    gone = weakref.ref(model)
    del model, gm
    gc.collect()
    assert gone() is None


class Bound(nn.Module):
    """Checkpoints a method of the model itself, which runs one block per call."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.blocks, self.head = nn.Linear(16, 16), nn.ModuleList(Block() for _ in range(4)), nn.Linear(16, 4)

    def _run(self, k: int, h: torch.Tensor) -> torch.Tensor:
        return self.blocks[k](h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        for k in range(4):
            h = h + checkpoint(self._run, k, h, use_reentrant=False)
        return self.head(h)


def test_under_fx_a_call_of_the_whole_model_is_kept_reading_only_the_weights_it_reads() -> None:
    torch.manual_seed(0)
    model = Bound()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        gm = split_and_compare(model, _budgets(model), (torch.randn(8, 16),), trace="fx", mode="training", pins=PINS)
    assert gm.code.count("fxsplit_checkpointed_the_model") == 4
    placement = gm.meta["fxsplit_plan"].param_devices
    assert placement["blocks.0.up.weight"] == "cpu:0" and placement["blocks.3.up.weight"] == "cpu:1"


def test_under_export_a_call_of_the_whole_model_is_a_plain_call_with_a_warning() -> None:
    """Its op would read every weight of the model (and pins of its blocks would name no op): not kept."""
    torch.manual_seed(0)
    model = Bound()
    with pytest.warns(FxsplitWarning, match=r"4 calls: 'the model'.*run the whole model"):
        gm = split_and_compare(
            model, _budgets(model), (torch.randn(8, 16),), trace="export", mode="training", pins=PINS
        )
    assert "checkpointed" not in gm.code
