"""``strict=False``: a checkpoint that holds more or fewer tensors than the model, loaded as far as it fits.

The cases users meet: a base model's checkpoint loaded into a model with a new
head (fine-tuning), a checkpoint with a head the model lacks. Tensors the model lacks are skipped; tensors the
checkpoint lacks keep their values (a real model) or, on ``meta``, are made on
their planned device and initialized as the model initializes them (a Hugging
Face model's ``_init_weights``, else ``reset_parameters()``); a warning lists
both. What cannot be initialized is refused before anything of the model changes.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from helpers import saved_then_empty

import fxsplit
from fxsplit.errors import CheckpointError, FxsplitWarning, SpecError

safetensors_torch = pytest.importorskip("safetensors.torch")

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
BUDGETS = {"cpu:0": "2KiB", "cpu:1": "2KiB"}  # one Linear(16, 16) (1088 bytes) and its activations on each


def two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))


def _save(state: dict[str, torch.Tensor], path: Path) -> Path:
    safetensors_torch.save_file({name: t.contiguous() for name, t in state.items()}, str(path))
    return path


def _reference() -> nn.Module:
    torch.manual_seed(1)
    return two_layers().eval()


def _split(model: nn.Module, checkpoint: Any, **options: Any) -> tuple[torch.fx.GraphModule, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="fx", checkpoint=checkpoint, **options)
    return split, [str(w.message) for w in caught if issubclass(w.category, FxsplitWarning)]


def _on_meta(model: nn.Module) -> list[str]:
    return [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]


def test_strict_is_the_default_and_its_refusal_says_how_to_load_what_fits(tmp_path: Path) -> None:
    state = _reference().state_dict()
    path = _save({k: v for k, v in state.items() if k != "2.bias"}, tmp_path / "m.safetensors")
    with fxsplit.empty_weights():
        model = two_layers()
    with pytest.raises(CheckpointError, match="missing: '2.bias'") as raised:
        _split(model, path)
    assert "pass strict=False" in str(raised.value)
    assert sorted(_on_meta(model)) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # nothing was loaded
    with pytest.raises(SpecError, match="strict must be True or False"):
        _split(model, path, strict="no")


def test_a_missing_bias_is_initialized_by_its_module_and_the_loaded_weight_kept(tmp_path: Path) -> None:
    reference = _reference()
    state = reference.state_dict()
    path = _save({k: v for k, v in state.items() if k != "2.bias"}, tmp_path / "m.safetensors")
    with fxsplit.empty_weights():
        model = two_layers()
    torch.manual_seed(5)
    split, said = _split(model, path, strict=False)
    assert _on_meta(model) == []
    assert len(said) == 1 and "'2.bias' (Linear.reset_parameters)" in said[0] and "were initialized" in said[0]
    held = dict(model.named_parameters())
    for name in ("0.weight", "0.bias", "2.weight"):  # the loaded ones, untouched by the module's initializer
        assert torch.equal(held[name].detach(), state[name]), name
    bias = held["2.bias"].detach()
    assert not torch.equal(bias, state["2.bias"]) and bias.abs().max() <= 16**-0.5  # Linear's own bound
    assert split.meta["fxsplit_plan"].param_devices["2.bias"] == "cpu:1" and isinstance(held["2.bias"], nn.Parameter)
    with torch.no_grad():
        reference[2].bias.copy_(bias)
    out = split(X)
    assert torch.equal(out, reference(X))
    out.sum().backward()  # the made parameter trains like the loaded ones
    assert held["2.bias"].grad is not None and held["2.bias"].grad.shape == (16,)


def test_a_failure_after_loading_puts_back_the_meta_tensors_it_initialized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _reference().state_dict()
    path = _save({k: v for k, v in state.items() if k != "2.bias"}, tmp_path / "m.safetensors")
    with fxsplit.empty_weights():
        model = two_layers()
    before = dict(model.named_parameters())

    def broken_emit(*args: object, **kwargs: object) -> None:
        raise RuntimeError("codegen failed")

    monkeypatch.setattr(fxsplit.api, "emit", broken_emit)
    with pytest.raises(RuntimeError, match="codegen failed"):
        _split(model, path, strict=False)
    assert dict(model.named_parameters()) == before  # the meta Parameters, the initialized one too


def test_tensors_the_model_lacks_are_skipped(tmp_path: Path) -> None:
    reference = _reference()
    extra = {**reference.state_dict(), "head.weight": torch.ones(3, 16), "head.bias": torch.zeros(3)}
    path = _save(extra, tmp_path / "m.safetensors")
    with fxsplit.empty_weights():
        model = two_layers()
    with pytest.raises(CheckpointError, match="unexpected: 'head.bias'"):
        _split(model, path)
    split, said = _split(model, path, strict=False)
    assert torch.equal(split(X), reference(X))
    assert (
        len(said) == 1
        and "2 of its tensors are not the model's and were not loaded: 'head.bias', 'head.weight'" in said[0]
    )


def test_a_real_model_keeps_the_values_of_what_the_checkpoint_lacks(tmp_path: Path) -> None:
    reference = _reference()
    state = reference.state_dict()
    path = _save({k: v for k, v in state.items() if not k.startswith("0.")}, tmp_path / "m.safetensors")
    torch.manual_seed(9)
    model = two_layers().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    split, said = _split(model, path, strict=False)
    assert len(said) == 1 and "2 tensors it lacks keep the values the model had: '0.weight', '0.bias'" in said[0]
    after = model.state_dict()
    assert torch.equal(after["0.weight"].cpu(), before["0.weight"]) and torch.equal(
        after["2.weight"].cpu(), state["2.weight"]
    )
    with torch.no_grad():
        reference[0].weight.copy_(before["0.weight"])
        reference[0].bias.copy_(before["0.bias"])
    assert torch.equal(split(X), reference(X))


class Scaled(nn.Module):
    """A layer with a parameter of its own and no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.gain = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.gain


class HalfReset(Scaled):
    """``reset_parameters`` that forgets one of its parameters."""

    def reset_parameters(self) -> None:
        self.fc.reset_parameters()


@pytest.mark.parametrize(("kind", "said"), [(Scaled, "has no reset_parameters()"), (HalfReset, "left it unset")])
def test_what_no_initializer_sets_is_refused_and_the_model_left_as_it_was(
    tmp_path: Path, kind: type[nn.Module], said: str
) -> None:
    torch.manual_seed(1)
    state = nn.Sequential(kind(), nn.Linear(16, 16)).state_dict()
    path = _save({k: v for k, v in state.items() if k != "0.gain"}, tmp_path / "m.safetensors")
    with fxsplit.empty_weights():
        model = nn.Sequential(kind(), nn.Linear(16, 16))
    with pytest.raises(CheckpointError, match=f"'0.gain'.*{said}"):
        fxsplit.fxsplit(
            model, {"cpu:0": "2KiB", "cpu:1": "2KiB"}, example_inputs=(X,), trace="fx", checkpoint=path, strict=False
        )
    assert len(_on_meta(model)) == 5  # nothing loaded, nothing made


def test_apply_and_offload(tmp_path: Path) -> None:
    """A saved plan applied with ``strict=False``; a missing tensor the plan streams from host memory is made there,
    one it stores on disk (where only a checkpoint's tensors go) is refused."""
    torch.manual_seed(1)
    reference = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).eval()
    inputs = (torch.randn(4, 256),)
    with fxsplit.empty_weights():
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    offload = {"host": "512KiB", "disk": "4MiB", "dir": str(tmp_path / "offload")}
    plan = fxsplit.plan(model, {"cpu:0": "900KiB", "cpu:1": "900KiB"}, example_inputs=inputs, offload=offload)
    stored = {tier: sorted(n for n, t in plan.streamed.items() if t == tier) for tier in ("host", "disk")}
    assert stored["host"] and stored["disk"]
    state = reference.state_dict()
    for tier in ("disk", "host"):
        gone = stored[tier][0]
        path = _save({k: v for k, v in state.items() if k != gone}, tmp_path / f"{tier}.safetensors")
        if tier == "disk":
            with pytest.raises(CheckpointError, match=f"'{gone}': the plan stores it on disk"):
                fxsplit.apply(model, plan, example_inputs=inputs, checkpoint=path, strict=False)
            assert len(_on_meta(model)) == 16
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            split = fxsplit.apply(model, plan, example_inputs=inputs, checkpoint=path, strict=False)
        assert any(f"'{gone}' (Linear.reset_parameters)" in str(w.message) for w in caught)
        made = dict(model.named_parameters())[gone].detach()
        assert made.device.type == "cpu" and not torch.isnan(made).any()
        with torch.no_grad():
            dict(reference.named_parameters())[gone].copy_(made)
        assert torch.equal(split(*inputs), reference(*inputs))


def test_load_checkpoint_into_a_split_skips_extra_tensors_and_refuses_meta_ones_it_cannot_initialize(
    tmp_path: Path,
) -> None:
    reference = _reference()
    state = reference.state_dict()
    extra = _save({**state, "head.weight": torch.ones(3, 16)}, tmp_path / "extra.safetensors")
    short = _save({k: v for k, v in state.items() if k != "0.bias"}, tmp_path / "short.safetensors")
    with fxsplit.empty_weights():
        model = two_layers()
    split, _ = _split(model, False)
    with pytest.raises(
        CheckpointError,
        match=r"(?s)'0.bias' is on meta in the split.*fxsplit.fxsplit\(model, ..., checkpoint=..., strict=False\)",
    ):
        fxsplit.load_checkpoint(split, short, strict=False)
    with pytest.raises(CheckpointError, match="unexpected: 'head.weight'"):
        fxsplit.load_checkpoint(split, extra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxsplit.load_checkpoint(split, extra, strict=False)
    assert any("'head.weight'" in str(w.message) for w in caught)
    assert torch.equal(split(X), reference(X))


transformers = pytest.importorskip("transformers")


def _bert_config() -> Any:
    return transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=3
    )


def test_a_base_models_checkpoint_fills_a_hugging_face_model_with_a_new_head(tmp_path: Path) -> None:
    """As ``from_pretrained`` does: the encoder loaded, the classifier initialized by the model's ``_init_weights``
    (normal with ``initializer_range``, bias zero), not by ``nn.Linear``'s own initializer."""
    config = _bert_config()
    config.initializer_range = 0.5  # far from nn.Linear's kaiming bound (1/sqrt(32)): says which initializer ran
    reference, model = saved_then_empty(
        tmp_path, config, transformers.BertModel, transformers.BertForSequenceClassification
    )
    ids = {"input_ids": torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(3))}
    with pytest.raises(CheckpointError, match="missing: 'classifier.weight'"):
        fxsplit.fxsplit(model, {"cpu:0": "200KiB", "cpu:1": "10MiB"}, example_kwargs=ids, checkpoint=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = fxsplit.fxsplit(
            model, {"cpu:0": "200KiB", "cpu:1": "10MiB"}, example_kwargs=ids, checkpoint=tmp_path, strict=False
        )
    said = [str(w.message) for w in caught if issubclass(w.category, FxsplitWarning)]
    assert any("'classifier.weight' (BertForSequenceClassification._init_weights)" in s for s in said), said
    assert _on_meta(model) == []
    head = model.classifier
    assert 0.3 < head.weight.detach().std().item() < 0.7 and torch.equal(head.bias.detach(), torch.zeros(3))
    with torch.no_grad():
        reference.classifier.weight.copy_(head.weight)
        reference.classifier.bias.copy_(head.bias)
    assert torch.equal(split(**ids).logits, reference(**ids).logits)


def test_a_classifiers_checkpoint_fills_its_base_model(tmp_path: Path) -> None:
    config = _bert_config()
    reference, model = saved_then_empty(
        tmp_path, config, transformers.BertForSequenceClassification, transformers.BertModel
    )
    ids = {"input_ids": torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(3))}
    need = sum(fxsplit.plan(model, {"cpu:0": "1GiB"}, example_kwargs=ids, mode="weights").device_bytes.values())
    budgets = {"cpu:0": int(0.6 * need), "cpu:1": int(0.6 * need)}
    with pytest.raises(CheckpointError, match="unexpected: 'classifier.bias'"):
        fxsplit.fxsplit(model, budgets, example_kwargs=ids, checkpoint=tmp_path, mode="weights")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = fxsplit.fxsplit(model, budgets, example_kwargs=ids, checkpoint=tmp_path, mode="weights", strict=False)
    said = [str(w.message) for w in caught if issubclass(w.category, FxsplitWarning)]
    assert any("2 of its tensors are not the model's and were not loaded: 'classifier." in s for s in said), said
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2
    assert torch.equal(split(**ids).last_hidden_state, reference(**ids).last_hidden_state)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


def test_an_initializer_that_resets_its_children_keeps_what_they_loaded(tmp_path: Path) -> None:
    """``MultiheadAttention._reset_parameters`` also zeroes ``out_proj.bias``, loaded from the checkpoint: kept."""
    torch.manual_seed(1)
    reference = nn.Sequential(Attention(), nn.Linear(16, 16)).eval()
    with torch.no_grad():  # trained values: none of them what the initializer sets
        for param in reference.parameters():
            param.normal_(0, 0.3)
    state = reference.state_dict()
    path = _save({k: v for k, v in state.items() if k != "0.mha.in_proj_bias"}, tmp_path / "m.safetensors")
    assert state["0.mha.out_proj.bias"].abs().sum() > 0
    with fxsplit.empty_weights():
        model = nn.Sequential(Attention(), nn.Linear(16, 16)).eval()
    x = torch.randn(2, 3, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = fxsplit.fxsplit(model, {"cpu:0": "7.5KiB", "cpu:1": "7.5KiB"}, example_inputs=(x,), trace="fx",
                                checkpoint=path, strict=False)  # fmt: skip
    assert any("'0.mha.in_proj_bias' (MultiheadAttention._reset_parameters)" in str(w.message) for w in caught)
    held = dict(model.named_parameters())
    assert torch.equal(held["0.mha.out_proj.bias"].detach(), state["0.mha.out_proj.bias"])
    assert torch.equal(held["0.mha.in_proj_weight"].detach(), state["0.mha.in_proj_weight"])
    assert torch.equal(held["0.mha.in_proj_bias"].detach(), torch.zeros(48))  # what the initializer sets
    with torch.no_grad():
        reference[0].mha.in_proj_bias.zero_()
    torch.testing.assert_close(split(x), reference(x), rtol=0, atol=1e-6)
