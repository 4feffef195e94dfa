"""A number torch.export read out of a tensor that changes from call to call, and fixed in the graph, is refused
(fxsplit/tracing/fixedreads.py); a number read from a registered buffer, or from a constant nothing writes,
plans, and the split equals the model at every call."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import TraceError

BUDGETS = {"cpu:0": 120, "cpu:1": 120}  # 176 bytes of weights and state: the model is split


class _Counter:
    """An object the model holds outside its modules, as a cache holds its step counter."""

    def __init__(self) -> None:
        self.count = torch.tensor(0)


class Positions(nn.Module):
    """Writes the position it is given into a counter, then builds a mask as long as the counter says."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.held = _Counter()
        self.register_buffer("count", torch.tensor(0))
        self.scale = torch.tensor(2)  # a constant of the model: nothing writes it

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        counter = self.held.count if self.where == "held" else self.count
        counter.copy_(position[0])
        mask = torch.ones(1, counter + 1)  # a tensor used as a size
        y = self.second(self.first(x))
        return y * mask.sum() * (self.scale + 1).item()


def _calls() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return [(torch.randn(2, 4), torch.tensor([p])) for p in (0, 2, 5)]


@pytest.mark.parametrize("trace", ["export", "auto"])
def test_a_size_read_from_a_held_tensor_the_inputs_write_is_refused_and_the_model_is_left_as_it_was(
    trace: str,
) -> None:
    model = Positions("held")
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(TraceError, match=r"changes from call to call") as refused:
        fxsplit.fxsplit(model, BUDGETS, example_inputs=_calls()[0], trace=trace)
    message = str(refused.value)
    assert "test_fixed_reads.py" in message and "torch.ones(1, counter + 1)" in message  # the line, named
    assert "register_buffer" in message  # the fix, tested below
    assert int(model.held.count) == 0 and all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_the_same_read_from_a_registered_buffer_is_kept_as_data_and_the_split_equals_the_model() -> None:
    model = Positions("buffer")
    twin = copy.deepcopy(model)
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=_calls()[0], trace="export", mode="weights")
    assert set(split.meta["fxsplit_plan"].param_devices.values()) == {"cpu:0", "cpu:1"}
    for x, position in _calls():
        assert torch.equal(split(x, position), twin(x, position))


def test_a_number_read_from_a_constant_nothing_writes_plans() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = torch.tensor(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * (self.scale + 1).item()

    model = Scaled()
    split = fxsplit.fxsplit(model, {"cpu:0": 10_000}, example_inputs=(torch.randn(2, 4),), trace="export")
    x = torch.randn(2, 4)
    assert torch.equal(split(x), model(x))


def test_biogpt_with_a_static_cache_is_refused_where_its_export_graph_gives_wrong_logits() -> None:
    """BioGPT builds its attention mask with ``torch.ones(batch, cache_length + 1)``; under Hugging Face's
    static-cache export wrapper the cache length is a tensor held outside the modules, and export fixed the mask
    at the first position: torch.export's own module gives wrong logits from the second token on."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    torch.manual_seed(0)
    config = transformers.BioGptConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=64,
        max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.BioGptForCausalLM(config).eval()
    model.generation_config.cache_implementation = "static"
    wrapped = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=16)
    calls = [((torch.tensor([[t]]),), {"cache_position": torch.tensor([p])}) for p, t in enumerate((5, 17, 42))]
    with torch.no_grad():
        exported = torch.export.export(copy.deepcopy(wrapped), *calls[0], strict=False).module()
        twin = copy.deepcopy(wrapped)
        equal = [torch.equal(exported(*a, **k), twin(*a, **k)) for a, k in calls]
    assert equal == [True, False, False]  # what the refusal guards against, in torch itself
    with torch.no_grad(), pytest.raises(TraceError, match=r"modeling_biogpt\.py.*torch\.ones\(batch_size"):
        fxsplit.fxsplit(wrapped, {"cpu:0": 10**7}, example_inputs=calls[0][0], example_kwargs=calls[0][1])
