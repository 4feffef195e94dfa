"""Hugging Face models nobody here wrote, split over 2 and 4 devices: same outputs, budgets held.

Random weights from tiny configs (no downloads). Three kinds of budgets:
``weights`` (mode="weights", 1.1 x parameter bytes / N per device: the
parameters alone are tight), ``memory`` (the default inference mode, 1.1 x
parameter bytes / N plus the whole model's activation peak on one device:
tight once activations count) and ``loose``. "Held" is checked against the
plan and against the activation memory the forward really uses
(:func:`fxsplit.memory.measure.measure_forward`).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

import fxsplit
from fxsplit.memory.measure import measure_forward

pytestmark = pytest.mark.slow  # Hugging Face models, 2-10 s each, ~95 s in all

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=160, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=128,
        max_position_embeddings=32,
    )
    return transformers.BertModel(config)


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=128,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def _vit() -> torch.nn.Module:
    config = transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, image_size=16, patch_size=4
    )
    return transformers.ViTModel(config)


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))


def _pixels() -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


# name -> (factory, input, example kwargs, output field)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], torch.Tensor], dict[str, Any], str]] = {
    "gpt2": (_gpt2, _ids, {"use_cache": False}, "logits"),
    "bert": (_bert, _ids, {}, "last_hidden_state"),
    "llama": (_llama, _ids, {"use_cache": False}, "logits"),
    "vit": (_vit, _pixels, {}, "last_hidden_state"),
}


def _make(name: str) -> tuple[torch.nn.Module, torch.Tensor, dict[str, Any], str]:
    factory, make_input, kwargs, field = MODELS[name]
    torch.manual_seed(0)
    return factory().eval(), make_input(), kwargs, field


def _budgets(model: torch.nn.Module, x: torch.Tensor, kwargs: dict[str, Any], kind: str, n: int) -> dict[str, int]:
    one = fxsplit.plan(
        model, {"cpu:0": "1GiB"}, example_inputs=(x,), example_kwargs=kwargs or None, mode="inference"
    ).memory["cpu:0"]
    weights = one["params"] + one["buffers"]
    each = {
        "weights": 1.1 * weights / n,
        "memory": 1.1 * weights / n + one["activations_peak"],
        "loose": 4 * (weights + one["activations_peak"]),
    }[kind]
    return {f"cpu:{i}": int(each) for i in range(n)}


@pytest.mark.parametrize("kind", ["weights", "memory", "loose"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_split_equals_unsplit_and_holds_its_budgets(name: str, n: int, kind: str) -> None:
    model, x, kwargs, field = _make(name)
    reference = copy.deepcopy(model)
    budgets = _budgets(model, x, kwargs, kind, n)
    mode = "weights" if kind == "weights" else "inference"
    gm = fxsplit.fxsplit(model, budgets, example_inputs=(x,), example_kwargs=kwargs or None, mode=mode)
    plan = gm.meta["fxsplit_plan"]

    with torch.no_grad():
        expected = getattr(reference(x, **kwargs), field)
        actual = getattr(gm(x), field)  # constant keyword inputs are defaults: no use_cache=False needed
    torch.testing.assert_close(actual, expected)

    measured = measure_forward(gm, x)
    for device in plan.devices:
        assert plan.memory[device]["total"] <= budgets[device]
        if mode == "inference":  # what the forward really allocates fits beside the weights
            assert plan.device_bytes[device] + measured.get(device, 0) <= budgets[device], (device, measured)
        else:
            assert plan.device_bytes[device] <= budgets[device]
    if kind != "loose":
        assert all(plan.modules[d] for d in plan.devices), "tight budgets need every device"
    else:
        assert not plan.cuts or all(c.kind == "output" for c in plan.cuts)


@pytest.mark.parametrize("n", [2, 4])
def test_tied_embedding_has_one_home_and_its_other_use_is_a_parameter_cut(n: int) -> None:
    model, x, kwargs, _ = _make("gpt2")
    tied = ("lm_head.weight", "transformer.wte.weight")
    assert model.lm_head.weight is model.transformer.wte.weight
    unique = len({id(p) for p in model.parameters()})
    gm = fxsplit.fxsplit(
        model, _budgets(model, x, kwargs, "memory", n), example_inputs=(x,), example_kwargs=kwargs, mode="inference"
    )
    plan = gm.meta["fxsplit_plan"]

    homes = {plan.param_devices[name] for name in tied}
    assert len(homes) == 1
    assert model.lm_head.weight is model.transformer.wte.weight  # still one tensor, moved in place
    assert len({id(p) for p in gm.parameters()}) == unique  # never duplicated
    lm_head_device = plan.placement[
        next(n for n in plan.placement if n.startswith("linear") and "lm_head" in _module_of(gm, n))
    ]
    cuts = [c for c in plan.cuts if c.producer in tied]
    if lm_head_device != homes.pop():
        assert [(c.kind, c.destination, c.nbytes) for c in cuts] == [("parameter", lm_head_device, 160 * 32 * 4)]
    else:
        assert not cuts


def _module_of(gm: torch.fx.GraphModule, node_name: str) -> str:
    for node in gm.graph.nodes:
        if node.name == node_name:
            stack = node.meta.get("nn_module_stack") or {}
            return str(list(stack.values())[-1][0]) if stack else ""
    return ""


def test_constant_keyword_inputs_are_defaults_and_other_values_are_refused() -> None:
    model, x, kwargs, _ = _make("llama")
    gm = fxsplit.fxsplit(model, {"cpu:0": "10MiB", "cpu:1": "10MiB"}, example_inputs=(x,), example_kwargs=kwargs)
    assert "use_cache=False" in gm.code.split("\n", 3)[3]
    with torch.no_grad():
        torch.testing.assert_close(gm(x).logits, gm(x, use_cache=False).logits)
        torch.testing.assert_close(gm(input_ids=x).logits, model(x, use_cache=False).logits)
        with pytest.raises(fxsplit.InputMismatchError, match="use_cache"):
            gm(x, use_cache=True)


def test_llama_built_on_meta_is_planned_with_fused_attention_memory() -> None:
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=512,
        max_position_embeddings=2048,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.zeros(1, 1024, dtype=torch.long, device="meta")
    plan = fxsplit.plan(
        model,
        {"cuda:0": "64MiB", "cuda:1": "64MiB"},
        example_inputs=(ids,),
        example_kwargs={"use_cache": False},
        mode="inference",
    )
    attention_matrix = 8 * 1024 * 1024 * 4  # what the math path on meta would materialise: heads x seq x seq floats
    for device in plan.devices:
        assert plan.memory[device]["activations_peak"] < attention_matrix
        assert plan.memory[device]["total"] <= plan.budgets[device]
    logits = 1024 * 512 * 4
    assert plan.memory[plan.output_device]["activations_peak"] >= logits
