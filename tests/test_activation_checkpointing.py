"""Models that call ``torch.utils.checkpoint``: the split computes the model's values and gradients, and says that
it keeps the activations the model recomputed.

Before :mod:`fxsplit.tracing.checkpoints`, a reentrant checkpoint (``use_reentrant=True``) was traced as its
``no_grad`` forward by both tracers: the checkpointed block's parameters got no gradient and the layers before
it got one that missed the block's path, with no error when another path carried the loss
(:class:`Skip` below). Non-reentrant checkpointing (and Hugging Face's ``gradient_checkpointing_enable``) was
dropped without a word.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import fxsplit
from fxsplit import FxsplitWarning, PipelineConfig
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
def test_checkpointed_blocks_get_the_models_gradients(trace: str, reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Skip(reentrant)
    with pytest.warns(FxsplitWarning, match=r"4 calls: 'blocks.0', 'blocks.1', 'blocks.2', 'blocks.3'"):
        gm = split_and_compare(model, _budgets(model), (torch.randn(8, 16),), trace=trace, mode="training", pins=PINS)
    assert all(p.grad is not None for p in model.blocks.parameters())  # split_and_compare compared them
    assert "checkpoint" not in gm.code  # traced as plain calls
    assert issubclass(torch_checkpoint.CheckpointFunction, torch.autograd.Function)  # put back


@pytest.mark.parametrize("trace", TRACES)
def test_checkpoint_sequential_and_a_checkpointed_function(trace: str) -> None:
    torch.manual_seed(0)
    model = Sequential()
    pins = {"pre": "cpu:0", "body.2": "cpu:1"}
    with pytest.warns(FxsplitWarning, match=r"2 calls: 'body', '_scaled_tanh'") as caught:
        split_and_compare(model, _budgets(model), (torch.randn(8, 16),), trace=trace, mode="training", pins=pins)
    said = str(next(w.message for w in caught if issubclass(w.category, FxsplitWarning)))
    assert "recomputing" in said and "PipelineConfig(checkpoint='always')" in said


@pytest.mark.parametrize("mode", ["inference", "weights"])
def test_no_warning_where_nothing_is_recomputed(mode: str) -> None:
    model = Skip(True).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        gm = fxsplit.fxsplit(model, _budgets(model), example_inputs=(torch.randn(8, 16),), mode=mode, pins=PINS)
    x = torch.randn(8, 16)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


def test_no_warning_when_the_pipeline_recomputes_its_stages() -> None:
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


def test_the_plan_counts_the_activations_a_plain_model_keeps() -> None:
    """The memory model counts what the split holds: the same bytes as the model with its checkpoints removed."""
    torch.manual_seed(0)
    checkpointed = Skip(True)
    plain = copy.deepcopy(checkpointed)
    plain.forward = _without_checkpoints(plain)  # type: ignore[method-assign]
    x = torch.randn(8, 16)
    with pytest.warns(FxsplitWarning, match="checkpoints activations"):
        kept = fxsplit.plan(checkpointed, _budgets(checkpointed), example_inputs=(x,), mode="training", pins=PINS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        expected = fxsplit.plan(plain, _budgets(plain), example_inputs=(x,), mode="training", pins=PINS)
    assert kept.placement == expected.placement
    assert kept.memory == expected.memory


def _without_checkpoints(model: Skip) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model.pre(x)
        for block in model.blocks:
            h = h + block(h)
        return model.head(h)

    return forward


def test_torch_checkpoint_is_restored_after_a_failed_trace() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(lambda t: t.reshape(7, -1), x, use_reentrant=True)

    before = (torch_checkpoint.CheckpointFunction, torch_checkpoint._checkpoint_without_reentrant_generator)
    with pytest.raises(fxsplit.FxsplitError):
        fxsplit.fxsplit(Fails(), {"cpu:0": "1MiB"}, example_inputs=(torch.randn(4, 4),), trace="export")
    assert (torch_checkpoint.CheckpointFunction, torch_checkpoint._checkpoint_without_reentrant_generator) == before


def test_eager_checkpointing_recomputes_after_tracing() -> None:
    """Outside a trace the model's own checkpoint is untouched: its block runs again in backward."""
    calls: list[int] = []
    block = Block()
    block.register_forward_hook(lambda *_: calls.append(1))
    model = nn.Sequential(block)
    with plain_checkpoints(model) as met:
        checkpoint(block, torch.randn(2, 16, requires_grad=True), use_reentrant=True).sum().backward()
    assert met == ["0"] and len(calls) == 1  # a plain call: no recomputation
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
    with pytest.warns(FxsplitWarning, match=r"2 calls: 'transformer.h.0', 'transformer.h.1'"):
        split_and_compare(
            model,
            {"cpu:0": 6 * total, "cpu:1": 6 * total},
            (ids,),
            trace="export",
            mode="training",
            pins={"transformer.h.1": "cpu:1"},
            loss=lambda out: out.logits.square().mean(),
        )


def test_a_reentrant_checkpoint_of_inputs_without_grad_still_gives_gradients() -> None:
    """Eager PyTorch gives the block no gradient here (its inputs do not require grad); the split gives the
    gradient the block has without checkpointing, as documented in :mod:`fxsplit.tracing.checkpoints`."""

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.head = Block(), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, x, use_reentrant=True))

    torch.manual_seed(0)
    model = First()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 16)
    with pytest.warns(FxsplitWarning, match="1 call: 'block'"):
        gm = fxsplit.fxsplit(model, _budgets(model), example_inputs=(x,), mode="training", pins={"head": "cpu:1"})
    gm(x).sum().backward()
    plain.head(plain.block(x)).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"grad of {n}: {m}")
