"""Split generation with a static key/value cache (issue 11), on Hugging Face's own export recipe.

``TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=L)``
registers each layer's cache as buffers ``key_cache_<i>``/``value_cache_<i>``
(``[batch, kv heads, L, head size]``) and takes ``(input_ids, cache_position)``;
each call writes the new keys and values in place with ``index_copy_`` and
returns the logits. Split over 2 and 4 logical devices with budgets of
1.1 x (weights + cache) / N, greedy decoding must give exactly the tokens of
``model.generate(do_sample=False)`` on the unsplit model, keep the cache in the
split between calls, and put each layer's cache on the device of that layer's
attention.

The recipe is traced under ``torch.no_grad()``, as Hugging Face's own
``convert_and_export_with_cache`` does; traced with grad enabled, torch.export
detaches the cache into graph constants (``...self_attn.lifted_tensor_<k>``),
no longer the wrapper's buffers: :func:`test_traced_with_grad_enabled`.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import pytest
import torch

import fxsplit

transformers = pytest.importorskip("transformers")
executorch = pytest.importorskip("transformers.integrations.executorch")

MAX_CACHE_LEN, NEW_TOKENS = 48, 32
PROMPT = torch.tensor([[5, 17, 42, 7, 300, 11, 9, 128]])
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def tiny(family: str) -> Any:
    """A 4-layer model of ``family`` (hidden 64, vocabulary 512), random weights, set up for a static cache."""
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    config = config_class(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=64,
    )
    model = model_class(config).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.eos_token_id = None  # random weights: always NEW_TOKENS tokens
    return model


def wrap(model: Any) -> torch.nn.Module:
    return executorch.TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)


def cache_names(wrapped: torch.nn.Module) -> list[str]:
    return [name for name, _ in wrapped.named_buffers() if name.startswith(("key_cache_", "value_cache_"))]


def budgets(wrapped: torch.nn.Module, devices: int) -> dict[str, int]:
    """1.1 x (weights + cache) / N each (the wrapper's buffers are the cache and the rotary frequencies)."""
    total = sum(t.nbytes for t in [*wrapped.parameters(), *wrapped.buffers()])
    return {f"cpu:{i}": int(1.1 * total / devices) for i in range(devices)}


def split_for_generation(
    wrapped: torch.nn.Module, devices: int, *, dynamic: bool = True, grad: bool = False, **options: Any
) -> torch.fx.GraphModule:
    """The recipe's split: one example token (static sizes) or the prompt with its length kept variable."""
    if dynamic:
        length = torch.export.Dim("length", max=MAX_CACHE_LEN)
        inputs, positions = PROMPT, torch.arange(PROMPT.shape[1])
        options["dynamic_shapes"] = {"input_ids": {1: length}, "cache_position": {0: length}}
    else:
        inputs, positions = torch.tensor([[1]]), torch.tensor([0])
    with contextlib.nullcontext() if grad else torch.no_grad():
        return fxsplit.fxsplit(
            wrapped,
            budgets(wrapped, devices),
            example_inputs=(inputs,),
            example_kwargs={"cache_position": positions},
            mode="weights",
            **options,
        )


@torch.no_grad()
def greedy(step: torch.nn.Module, prompt: torch.Tensor, new_tokens: int = NEW_TOKENS, *, whole: bool = True) -> list:
    """Greedy decoding from cache position 0: the prompt in one call (``whole``) or one token per call."""
    if whole:
        logits = step(prompt, cache_position=torch.arange(prompt.shape[1]))
    else:
        for position in range(prompt.shape[1]):
            logits = step(prompt[:, position : position + 1], cache_position=torch.tensor([position]))
    tokens: list[int] = []
    for position in range(prompt.shape[1], prompt.shape[1] + new_tokens):
        tokens.append(int(logits[0, -1].argmax()))
        if len(tokens) < new_tokens:
            logits = step(torch.tensor([[tokens[-1]]]), cache_position=torch.tensor([position]))
    return tokens


def expected_tokens(model: Any, prompt: torch.Tensor, new_tokens: int = NEW_TOKENS) -> list[int]:
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    return out[0, prompt.shape[1] :].tolist()  # type: ignore[no-any-return]


def cache_writes(split: torch.fx.GraphModule, wrapped: torch.nn.Module) -> list[dict[str, Any]]:
    """Every ``index_copy_`` of the graph: the layer, the tensor it writes (its name in ``plan.param_devices``:
    the wrapper's buffer it is, or the graph constant torch.export made of it), the op's device, the
    tensor's device, and the device of the layer's attention op (``scaled_dot_product_attention``)."""
    plan = split.meta["fxsplit_plan"]
    attention = {}
    for node in split.graph.find_nodes(op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default):
        attention[next(reversed(node.meta["nn_module_stack"].values()))[0]] = plan.placement[node.name]
    writes = []
    for node in split.graph.find_nodes(op="call_function", target=torch.ops.aten.index_copy_.default):
        target = node.args[0].target  # a get_attr: the cache tensor
        name = target
        if name not in plan.param_devices:  # a constant that is the wrapper's buffer: the plan names the buffer
            tensor = operator.attrgetter(target)(split)
            name = next(n for n, b in wrapped.named_buffers() if b.data_ptr() == tensor.data_ptr())
        module = next(reversed(node.meta["nn_module_stack"].values()))[0]  # "model.model.layers.2.self_attn"
        writes.append(
            {
                "layer": int(module.split(".")[-2]),
                "name": name,
                "tensor": operator.attrgetter(target)(split),
                "op_device": plan.placement[node.name],
                "tensor_device": plan.param_devices[name],
                "attention_device": attention[module],
            }
        )
    return writes


def assert_cache_with_its_layer(split: torch.fx.GraphModule, wrapped: torch.nn.Module) -> list[dict[str, Any]]:
    writes = cache_writes(split, wrapped)
    assert sorted(w["layer"] for w in writes) == [0, 0, 1, 1, 2, 2, 3, 3]  # a key and a value tensor per layer
    for w in writes:
        assert w["op_device"] == w["tensor_device"] == w["attention_device"], w
    return writes


CASES = [
    pytest.param("llama", 2, id="llama-2"),
    pytest.param("llama", 4, id="llama-4"),
    pytest.param("qwen2", 2, id="qwen2-2"),
    pytest.param("qwen2", 4, id="qwen2-4"),
]  # 5-8 s each on 2 shared cores


@pytest.mark.parametrize(("family", "devices"), CASES)
def test_greedy_tokens_equal_generate(family: str, devices: int) -> None:
    model = tiny(family)
    expected = expected_tokens(model, PROMPT)
    wrapped = wrap(model)
    split = split_for_generation(wrapped, devices, check=True)
    plan = split.meta["fxsplit_plan"]

    assert greedy(split, PROMPT) == expected

    writes = assert_cache_with_its_layer(split, wrapped)
    assert sorted(w["name"] for w in writes) == sorted(cache_names(wrapped))  # the cache is the wrapper's buffers
    assert len({w["tensor_device"] for w in writes}) >= 2  # the layers' caches are spread, not glued together
    for device in plan.devices:  # each device is charged its cache, within its budget
        cache = sum(w["tensor"].nbytes for w in writes if w["tensor_device"] == device)
        assert cache <= plan.memory[device]["buffers"]
        assert plan.memory[device]["total"] <= plan.budgets[device]


def test_cache_kept_between_calls_and_restarted_at_position_0() -> None:
    """Three sequences in a row on one split, each from cache position 0 (what starts a new sequence with this
    wrapper: every call sets the cache length from ``cache_position``, and the positions after it are masked):
    prompt A, a prompt that fills the cache to its last position, A again. The split gives the tokens the
    unsplit wrapper gives called the same way, and ``model.generate``'s; after each sequence its cache holds
    what the unsplit wrapper's holds."""
    model = tiny("llama")
    long_prompt = torch.randint(0, 512, (1, MAX_CACHE_LEN - 8), generator=torch.Generator().manual_seed(1))
    sequences = [(PROMPT, 16), (long_prompt, 8), (PROMPT, 16)]  # the long one writes positions 0 .. 46 of 48
    expected = [expected_tokens(model, prompt, new) for prompt, new in sequences]
    unsplit = wrap(model)  # a second wrapper: its own cache, the same weights
    wrapped = wrap(model)
    split = split_for_generation(wrapped, 2)

    for (prompt, new), want in zip(sequences, expected, strict=True):
        assert greedy(split, prompt, new) == greedy(unsplit, prompt, new) == want
        written = prompt.shape[1] + new - 1  # the last token is not fed back
        for name in cache_names(wrapped):  # the split writes the wrapper's buffers, in place
            ours, theirs = wrapped.get_buffer(name)[:, :, :written], unsplit.get_buffer(name)[:, :, :written]
            assert ours.abs().sum() > 0
            torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("whole_prompt", [False, True], ids=["token-by-token", "whole-prompt"])
def test_static_sizes_one_token_per_call(whole_prompt: bool) -> None:
    """The recipe as Hugging Face's own ``generate`` for it runs: traced on one token, the prompt fed one token
    at a time. A split traced with fixed sizes refuses a whole prompt and names ``dynamic_shapes``."""
    model = tiny("llama")
    expected = expected_tokens(model, PROMPT)
    wrapped = wrap(model)
    split = split_for_generation(wrapped, 2, dynamic=False)
    if whole_prompt:
        with pytest.raises(fxsplit.InputMismatchError, match="dynamic_shapes"):
            greedy(split, PROMPT)
    else:
        assert greedy(split, PROMPT, whole=False) == expected
        assert_cache_with_its_layer(split, wrapped)


# torch.export's own warning when it detaches the cache it traced with grad on
GRAD_TRACE_WARNING = "ignore:A model attribute .* requires gradient:UserWarning"


@pytest.mark.filterwarnings(GRAD_TRACE_WARNING)
def test_traced_with_grad_enabled() -> None:
    """The recipe split outside ``torch.no_grad()``: torch.export's trace writes the cache with grad on, then
    detaches it into graph constants (``model.model.layers.<i>.self_attn.lifted_tensor_<k>``), so the split's
    cache is no longer the wrapper's buffers. The tokens are still right and each layer's constants sit with
    its attention."""
    model = tiny("llama")
    expected = expected_tokens(model, PROMPT)
    wrapped = wrap(model)
    split = split_for_generation(wrapped, 2, dynamic=False, grad=True)
    plan = split.meta["fxsplit_plan"]
    assert greedy(split, PROMPT, whole=False) == expected
    writes = assert_cache_with_its_layer(split, wrapped)
    assert all(".self_attn.lifted_tensor_" in w["name"] for w in writes)
    assert len({w["tensor_device"] for w in writes}) == 2

    # What the plan charges for buffers and constants: the cache once, the rotary frequencies, the lengths.
    cache = sum(w["tensor"].nbytes for w in writes)
    others = sum(b.nbytes for n, b in wrapped.named_buffers() if n not in cache_names(wrapped))
    unused = sum(wrapped.get_buffer(n).nbytes for n in cache_names(wrapped))  # the buffers the split no longer uses
    charged = sum(plan.memory[d]["buffers"] for d in plan.devices)
    assert unused and charged == cache + others  # the buffers share the constants' storage: counted once


@pytest.mark.filterwarnings(GRAD_TRACE_WARNING)
def test_traced_with_grad_enabled_check() -> None:
    """``check=True`` on the split traced with grad on (see :func:`test_traced_with_grad_enabled`)."""
    wrapped = wrap(tiny("llama"))
    split = split_for_generation(wrapped, 2, dynamic=False, grad=True, check=True)
    plan = split.meta["fxsplit_plan"]
    assert plan.constants and all(".self_attn.lifted_tensor_" in name for name in plan.constants)
    assert fxsplit.Plan.from_yaml(plan.to_yaml()) == plan  # the constants are listed, so the plan reads back
