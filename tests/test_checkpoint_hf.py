"""Hugging Face checkpoints onto a split: save_pretrained (sharded) -> config on meta -> split from the directory.

Each test saves a tiny model with random weights (no downloads), rebuilds it
from the directory's ``config.json`` without memory for its weights, splits it
over ``cpu:0``/``cpu:1`` with ``checkpoint=`` the directory, and compares the
logits with the model ``from_pretrained`` loads from the same directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import fxsplit

pytestmark = pytest.mark.slow  # Hugging Face models saved and loaded, ~15 s

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(0))
BUDGETS = {"cpu:0": "500KiB", "cpu:1": "500KiB"}  # neither holds the whole model (650-800 KiB)


def _gpt2() -> Any:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=32, bos_token_id=0, eos_token_id=0
        )
    )


def _llama() -> Any:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=128,
            vocab_size=1000,
            max_position_embeddings=32,
        )
    )


def _save(factory: Callable[[], Any], directory: Path) -> None:
    torch.manual_seed(0)
    factory().save_pretrained(directory, max_shard_size="200KB")


def _empty_from_config(directory: Path) -> Any:
    config = transformers.AutoConfig.from_pretrained(directory)
    with fxsplit.empty_weights():
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def _split(model: Any, directory: Path | str) -> torch.fx.GraphModule:
    return fxsplit.fxsplit(
        model, BUDGETS, example_inputs=(IDS,), example_kwargs={"use_cache": False}, mode="weights", checkpoint=directory
    )


@pytest.mark.parametrize("factory", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_sharded_save_pretrained_directory_gives_the_same_logits(tmp_path: Path, factory: Callable[[], Any]) -> None:
    _save(factory, tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = _empty_from_config(tmp_path)
    split = _split(model, tmp_path)
    plan = split.meta["fxsplit_plan"]
    assert set(plan.param_devices.values()) == {"cpu:0", "cpu:1"}
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()(IDS, use_cache=False).logits
    torch.testing.assert_close(split(IDS).logits, expected)
    if factory is _gpt2:
        assert model.lm_head.weight is model.transformer.wte.weight  # tied, loaded once


def test_torch_save_bin_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = _gpt2().eval()
    reference.config.save_pretrained(tmp_path)
    torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")  # tied names both saved
    split = _split(_empty_from_config(tmp_path), tmp_path / "pytorch_model.bin")
    torch.testing.assert_close(split(IDS).logits, reference(IDS, use_cache=False).logits)


def test_rotary_buffers_built_on_meta_are_reported(tmp_path: Path) -> None:
    _save(_llama, tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    with pytest.raises(fxsplit.CheckpointError) as raised:
        _split(model, tmp_path)
    assert "meta buffer: 'model.rotary_emb.inv_freq'" in str(raised.value)
    quoted = (Path(__file__).parents[1] / "docs" / "CHECKPOINTS.md").read_text().split("## Buffers that no")[1]
    quoted = quoted.split("```text\n")[1].split("```")[0]  # docs/CHECKPOINTS.md quotes these lines
    assert set(quoted.splitlines()) <= {line.strip() for line in str(raised.value).splitlines()}
