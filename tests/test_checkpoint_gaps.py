"""Hugging Face checkpoints that lack, or hold besides, what transformers says they may (its own lists).

``save_pretrained`` leaves Marian's sinusoidal position tables out (``_keys_to_ignore_on_save``; the model's
initializer computes them); old checkpoints lack a batch norm's ``num_batches_tracked`` (which torch's own
``load_state_dict(strict=True)`` takes) and hold per-layer ``rotary_emb.inv_freq`` buffers that models now keep once
(``_keys_to_ignore_on_load_unexpected`` and its additions). ``from_pretrained`` loads each without a word, so
fxsplit does too, with ``strict=True``: what the checkpoint lacks is initialized as the model does (or keeps its
value when real), what it holds besides is skipped. Each split is compared with ``from_pretrained``'s model.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import saved_then_empty

import fxsplit
from fxsplit.errors import FxsplitWarning

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

IDS = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(3))


def _split(model: Any, budgets_of: float, checkpoint: Any, **inputs: Any) -> Any:
    """``model`` split over two devices at ``budgets_of`` of its weights each, with no fxsplit warning."""
    need = sum(fxsplit.plan(model, {"cpu:0": "1GiB"}, example_kwargs=inputs, mode="weights").device_bytes.values())
    budgets = {"cpu:0": int(budgets_of * need), "cpu:1": int(budgets_of * need)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        split = fxsplit.fxsplit(model, budgets, example_kwargs=inputs, mode="weights", checkpoint=checkpoint)
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2
    return split


def _marian() -> Any:
    return transformers.MarianConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=0, decoder_start_token_id=0,
    )  # fmt: skip


def test_tensors_save_pretrained_leaves_out_are_computed_as_from_pretrained_does(tmp_path: Path) -> None:
    config = _marian()
    torch.manual_seed(0)
    transformers.MarianMTModel(config).save_pretrained(tmp_path)
    with safetensors_torch.safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        assert "model.encoder.embed_positions.weight" not in saved.keys()
    reference = transformers.MarianMTModel.from_pretrained(tmp_path).eval()
    inputs = {"input_ids": IDS, "decoder_input_ids": IDS, "use_cache": False}
    with fxsplit.empty_weights():
        model = transformers.MarianMTModel(config).eval()
    split = _split(model, 0.6, tmp_path, **inputs)
    table = model.model.encoder.embed_positions.weight
    assert torch.equal(table.detach(), reference.model.encoder.embed_positions.weight.detach())
    assert torch.equal(split(**inputs).logits, reference(**inputs).logits)

    with fxsplit.empty_weights():  # a split with meta weights, loaded later: the tables are made with the split
        model = transformers.MarianMTModel(config).eval()
    later = _split(model, 0.6, False, **inputs)
    assert model.model.decoder.embed_positions.weight.device.type != "meta"
    fxsplit.load_checkpoint(later, tmp_path)
    assert torch.equal(later(**inputs).logits, reference(**inputs).logits)


def test_a_checkpoint_without_batch_norm_counters_loads_as_load_state_dict_takes_it(tmp_path: Path) -> None:
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    torch.manual_seed(0)
    transformers.ResNetForImageClassification(config).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    state = safetensors_torch.load_file(str(file))
    dropped = [name for name in state if name.endswith("num_batches_tracked")]
    assert dropped
    safetensors_torch.save_file({k: v for k, v in state.items() if k not in dropped}, str(file), {"format": "pt"})
    reference = transformers.ResNetForImageClassification.from_pretrained(tmp_path).eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with fxsplit.empty_weights():  # buffers real: the counters keep the values the model gave them
        model = transformers.ResNetForImageClassification(config).eval()
    split = _split(model, 0.7, tmp_path, pixel_values=pixels)
    assert torch.equal(split(pixel_values=pixels).logits, reference(pixel_values=pixels).logits)


def test_an_old_checkpoints_rotary_tables_are_skipped(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    state = safetensors_torch.load_file(str(file))
    old = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4) for i in range(2)}  # as once saved
    safetensors_torch.save_file({**state, **old}, str(file), {"format": "pt"})
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with fxsplit.empty_weights():
        model = transformers.LlamaForCausalLM(config).eval()
    split = _split(model, 0.7, tmp_path, input_ids=IDS, use_cache=False)
    assert torch.equal(split(input_ids=IDS, use_cache=False).logits, reference(input_ids=IDS, use_cache=False).logits)
    with fxsplit.empty_weights():
        other = torch.nn.Sequential(torch.nn.Linear(4, 4))  # not a transformers model: its lists do not apply
    safetensors_torch.save_file({"0.weight": torch.ones(4, 4), "0.bias": torch.ones(4), **old}, str(file))
    with pytest.raises(fxsplit.CheckpointError, match="unexpected: 'model.layers.0.self_attn.rotary_emb.inv_freq'"):
        fxsplit.fxsplit(other, {"cpu:0": "1KiB"}, example_inputs=(torch.ones(1, 4),), trace="fx", checkpoint=file)


def test_a_whole_encoder_decoders_checkpoint_fills_its_encoder(tmp_path: Path) -> None:
    """T5's encoder lists its checkpoints' ``decoder`` tensors as expected extras."""
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    reference, model = saved_then_empty(
        tmp_path, config, transformers.T5ForConditionalGeneration, transformers.T5EncoderModel
    )
    ids = {"input_ids": torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(3))}
    split = _split(model, 0.6, tmp_path, **ids)
    assert torch.equal(split(**ids).last_hidden_state, reference(**ids).last_hidden_state)
