"""Hugging Face checkpoints onto a split: save_pretrained (sharded) -> config on meta -> split from the directory.

Each test saves a tiny model with random weights (no downloads), rebuilds it
from the directory's ``config.json`` without memory for its weights, splits it
over ``cpu:0``/``cpu:1`` with ``checkpoint=`` the directory, and compares the
logits with the model ``from_pretrained`` loads from the same directory.
"""

from __future__ import annotations

import warnings
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


def _split(model: Any, directory: Path | str | bool) -> torch.fx.GraphModule:
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


def _gpt_neox() -> Any:
    return transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=1000
        )
    )


def _mixtral() -> Any:
    config = transformers.MixtralConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_local_experts=4,
        vocab_size=1000,
        max_position_embeddings=32,
    )
    return transformers.MixtralForCausalLM(config)


def _falcon() -> Any:  # its attention indexes with a list (qkv[..., [-2], :]): export makes that a constant
    return transformers.FalconForCausalLM(
        transformers.FalconConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000)
    )


def _gptj() -> Any:  # its rotary table is a buffer, which empty_weights keeps real
    return transformers.GPTJForCausalLM(
        transformers.GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, vocab_size=1000, n_positions=32)
    )


def _keys(directory: Path) -> set[str]:
    from safetensors import safe_open

    found: set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as handle:
            found.update(handle.keys())
    return found


def _loaded_now_and_later(directory: Path) -> None:
    """Split with ``checkpoint=directory``, and split without weights then ``load_checkpoint``: both give the
    logits ``from_pretrained`` gives, to the bit."""
    expected = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()(IDS, use_cache=False).logits
    torch.testing.assert_close(_split(_empty_from_config(directory), directory)(IDS).logits, expected, rtol=0, atol=0)
    later = _split(_empty_from_config(directory), False)
    fxsplit.load_checkpoint(later, directory)
    torch.testing.assert_close(later(IDS).logits, expected, rtol=0, atol=0)


def test_a_checkpoint_naming_a_tensor_as_transformers_once_did_is_read_under_the_models_name(tmp_path: Path) -> None:
    """GPT-NeoX (Pythia) checkpoints call the head ``embed_out``; transformers 5's model calls it ``lm_head`` and
    renames it when it loads, and ``save_pretrained`` writes the old name. So does fxsplit, by transformers' rules."""
    _save(_gpt_neox, tmp_path)
    assert "embed_out.weight" in _keys(tmp_path) and "lm_head.weight" not in _keys(tmp_path)
    _loaded_now_and_later(tmp_path)  # later: the split remembers the model's names


def _lara_mini() -> Any:
    config = transformers.AutoConfig.for_model(
        "lara_mini",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        vocab_size=1000,
        eos_token_id=1,
        max_position_embeddings=32,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.skipif(
    "lara_mini" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING,
    reason="this transformers has no LaraMini",
)
def test_a_fused_tensor_is_cut_into_the_parameters_it_fills(tmp_path: Path) -> None:
    """LaraMini's checkpoints fuse four input projections into one ``in_proj``, which transformers cuts (its
    ``Split``) into pieces the size of the model's parameters. fxsplit gave that cut no model to read the sizes
    from: the split crashed with transformers' ``AttributeError: 'NoneType' object has no attribute
    'get_parameter'`` (found by a sweep of Hugging Face checkpoints). Its gated linear attention computes in float32
    and runs other kernels exported than eager (``torch.export`` alone differs as much): equal to float32's
    tolerance, and to the bit between a split loaded now and one loaded later."""
    _save(_lara_mini, tmp_path)
    keys = _keys(tmp_path)
    assert "model.layers.0.linear_attn.in_proj.weight" in keys and not any("in_proj_qkv" in key for key in keys)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected = loaded(IDS, use_cache=False).logits
    part = int(0.7 * sum(p.numel() * p.element_size() for p in loaded.parameters()))  # two devices hold it
    options: dict[str, Any] = {"example_inputs": (IDS,), "example_kwargs": {"use_cache": False}, "mode": "weights"}
    now = fxsplit.fxsplit(_empty_from_config(tmp_path), {"cpu:0": part, "cpu:1": part}, checkpoint=tmp_path, **options)
    assert set(now.meta["fxsplit_plan"].param_devices.values()) == {"cpu:0", "cpu:1"}
    torch.testing.assert_close(now(IDS).logits, expected)
    later = fxsplit.fxsplit(_empty_from_config(tmp_path), {"cpu:0": part, "cpu:1": part}, checkpoint=False, **options)
    fxsplit.load_checkpoint(later, tmp_path)
    torch.testing.assert_close(later(IDS).logits, now(IDS).logits, rtol=0, atol=0)


def test_experts_stored_one_by_one_are_stacked_as_the_model_holds_them(tmp_path: Path) -> None:
    """Mixtral's checkpoints hold each expert's w1, w2, w3; the model holds each layer's experts stacked
    (``gate_up_proj``, ``down_proj``). They are stacked when read, also into the offload storage on disk."""
    _save(_mixtral, tmp_path)
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in _keys(tmp_path)
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()(IDS, use_cache=False).logits
    model = _empty_from_config(tmp_path)
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (4, 128, 32)
    split = fxsplit.fxsplit(
        model,
        {"cpu:0": "220KiB", "cpu:1": "220KiB"},
        example_inputs=(IDS,),
        example_kwargs={"use_cache": False},
        mode="weights",
        checkpoint=tmp_path,
        offload={"disk": "1MiB", "dir": str(tmp_path / "offload")},
    )
    plan = split.meta["fxsplit_plan"]
    assert any(name.endswith(("gate_up_proj", "down_proj")) for name, where in plan.streamed.items() if where == "disk")
    torch.testing.assert_close(split(IDS).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("factory", [_falcon, _gptj, _mixtral], ids=["falcon", "gptj", "mixtral"])
def test_a_model_built_on_meta_is_traced_as_it_runs_on_its_inputs_device(tmp_path: Path, factory: Any) -> None:
    """Export cannot mix meta weights with real inputs, and on meta the code runs otherwise: Falcon's index lists
    became constants on meta (no data, so the split could not run), GPT-J's real rotary table met meta activations
    (export failed), Mixtral's experts counted tokens as the non-CPU branch does (int histc, which the CPU lacks).
    The weights are fakes on the inputs' device while export runs."""
    _save(factory, tmp_path)
    _loaded_now_and_later(tmp_path)  # later: the constants the trace made are no checkpoint's


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_model_on_meta_is_planned_as_the_same_model_with_its_weights(mode: str) -> None:
    """Traced with its meta weights as fakes on the inputs' device, the empty model gets the plan its loaded twin
    gets: the same placement, cuts and memory rows."""
    config = _llama().config
    with fxsplit.empty_weights():
        empty = transformers.LlamaForCausalLM(config)
    options = {"example_inputs": (IDS,), "example_kwargs": {"use_cache": False, "labels": IDS}, "mode": mode}
    planned = [fxsplit.plan(m, {"cpu:0": "4MiB", "cpu:1": "4MiB"}, **options) for m in (empty, _llama())]
    assert all(t.is_meta for t in empty.parameters())
    assert planned[0].placement == planned[1].placement and planned[0].cuts == planned[1].cuts
    assert planned[0].memory == planned[1].memory


def test_a_float32_checkpoint_split_as_bfloat16_computes_what_transformers_loads_as_bfloat16(tmp_path: Path) -> None:
    """``dtype="bfloat16"`` loads the weights as bf16 and leaves what the model computes itself (the rotary
    ``inv_freq``, a non-persistent buffer) at float32, as ``from_pretrained(dtype=torch.bfloat16)`` does: cast, it
    turned each position's angles by a bf16 rounding, and the logits differed by a bf16 step. The plan counts the
    tensors at the dtypes traced, which are the split's: the loss casts the logits to float32, and counted as if
    bf16 the plan was 40% under what the device needs at its peak (the allocator with composite ops' insides)."""
    from fxsplit.memory.allocmeter import allocated_peaks

    _save(_llama, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    expected = reference(IDS, use_cache=False).logits
    model = _empty_from_config(tmp_path)
    kwargs = {"use_cache": False, "labels": IDS}
    budgets = {"cpu:0": "1MiB", "cpu:1": "1MiB"}
    split = fxsplit.fxsplit(
        model, budgets, example_inputs=(IDS,), example_kwargs=kwargs, dtype="bfloat16", checkpoint=tmp_path
    )
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32 and model.lm_head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(split(IDS, **kwargs).logits, expected, rtol=0, atol=0)
    planned = {device: row["activations_peak"] for device, row in split.meta["fxsplit_plan"].memory.items()}
    with torch.no_grad():
        for device, peak in allocated_peaks(split, IDS, internal=True, **kwargs).items():
            assert planned[device] >= peak, (device, planned[device], peak)


@pytest.mark.parametrize(
    ("factory", "mode"),
    [(_llama, "inference"), (_llama, "training"), (_gpt2, "training"), (_falcon, "training"), (_gptj, "inference")],
    ids=["llama-inference", "llama-training", "gpt2-training", "falcon-training", "gptj-inference"],
)
def test_a_meta_model_planned_as_bfloat16_gets_the_plan_of_its_bfloat16_checkpoint_split(
    tmp_path: Path, factory: Callable[[], Any], mode: str
) -> None:
    """``fxsplit.plan(meta_model, dtype="bfloat16")`` (sizing a deployment before renting it) traces the model cast
    to bf16, free on ``meta``, and counts what it traced, as the checkpoint split does: the plan is the split's
    own. Traced at float32 and scaled, it counted the float32 softmax and norms of a bf16 Llama as bf16, and its
    activations were under the split's (by a third on a training Llama's second device). The model is left as
    given, and the plan, recorded as of it, applies. GPT-J's rotary table is a real buffer in the empty model."""
    _save(factory, tmp_path)
    kwargs = {"use_cache": False, **({"labels": IDS} if mode == "training" else {})}
    options = {"example_inputs": (IDS,), "example_kwargs": kwargs, "dtype": "bfloat16", "mode": mode}
    alone = fxsplit.plan(_empty_from_config(tmp_path), {"cpu:0": 1 << 30}, **options).memory["cpu:0"]["total"]
    budgets = {"cpu:0": int(0.7 * alone), "cpu:1": int(0.7 * alone)}  # split: neither holds it all
    model = _empty_from_config(tmp_path)
    given = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    planned = fxsplit.plan(model, budgets, **options)
    assert {name: tensor.dtype for name, tensor in model.state_dict().items()} == given
    split = fxsplit.fxsplit(_empty_from_config(tmp_path), budgets, checkpoint=tmp_path, **options)
    made = split.meta["fxsplit_plan"]
    assert planned.memory == made.memory
    assert planned.placement == made.placement and planned.cuts == made.cuts and len(set(made.placement.values())) == 2
    assert "bfloat16" not in {sig.partition("[")[0] for sig in planned.tensors.values()}  # the model as given
    saved = fxsplit.Plan.from_yaml(planned.to_yaml())
    applied = fxsplit.apply(
        _empty_from_config(tmp_path), saved, example_inputs=(IDS,), example_kwargs=kwargs, checkpoint=tmp_path
    )
    torch.testing.assert_close(applied(IDS, **kwargs).logits, split(IDS, **kwargs).logits, rtol=0, atol=0)


class _NormedScores(torch.nn.Module):
    """A batch norm (its statistics: buffers ``empty_weights()`` keeps real) and scores softmaxed in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.proj(x))
        return (h @ h.T).float().softmax(-1).to(h.dtype) @ h


def test_a_model_with_meta_parameters_and_real_buffers_is_planned_at_the_dtype_and_given_back() -> None:
    """Parameters on ``meta`` and the norm's statistics real, as ``empty_weights()`` builds: cast for the trace
    (the buffers copied), planned as the bf16 model is, and the buffers put back as they were."""
    with fxsplit.empty_weights():
        empty = _NormedScores().eval()
    statistics = empty.norm.running_var
    x = torch.randn(64, 16)
    options = {"mode": "inference", "trace": "export"}
    planned = fxsplit.plan(empty, {"cpu:0": "1MiB"}, example_inputs=(x.bfloat16(),), dtype="bfloat16", **options)
    cast = fxsplit.plan(_NormedScores().eval().bfloat16(), {"cpu:0": "1MiB"}, example_inputs=(x.bfloat16(),), **options)
    assert planned.memory["cpu:0"]["activations_peak"] == cast.memory["cpu:0"]["activations_peak"]
    assert empty.norm.running_var is statistics and statistics.dtype == torch.float32 and not statistics.is_meta
    assert torch.equal(statistics, torch.ones(16)) and empty.proj.weight.is_meta


def test_a_meta_model_planned_at_a_dtype_is_fed_its_floating_inputs_at_that_dtype() -> None:
    """Float32 pixels into a convolution cast to bf16 would not run: the plan feeds the bf16 model bf16 pixels, as
    it will be fed, silently, and so plans what bf16 pixels plan."""
    with fxsplit.empty_weights():
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(288, 4)
        )
    pixels = torch.randn(2, 3, 8, 8)
    for trace in ("fx", "export"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            given = fxsplit.plan(model, {"cpu:0": "1MiB"}, example_inputs=(pixels,), dtype="bfloat16", trace=trace)
            cast = fxsplit.plan(
                model, {"cpu:0": "1MiB"}, example_inputs=(pixels.bfloat16(),), dtype="bfloat16", trace=trace
            )
        assert given.memory == cast.memory and given.placement == cast.placement
        assert all(p.dtype == torch.float32 and p.is_meta for p in model.parameters())
        assert pixels.dtype == torch.float32


def test_a_split_does_not_depend_on_transformers_finding_its_checkpoint_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every split of a transformers model asks for its checkpoint names (for a later load_checkpoint); should
    transformers' own lookup fail on a model, the split is made as before, reading names as they are."""
    import transformers.conversion_mapping as mapping

    from fxsplit.checkpoint.load import CONVERSIONS

    def broken(model: Any, *args: Any, **kwargs: Any) -> Any:
        raise AttributeError("no config for this model")

    monkeypatch.setattr(mapping, "get_model_conversion_mapping", broken)
    model = _gpt2().eval()
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(IDS,), example_kwargs={"use_cache": False}, mode="weights")
    assert split.meta[CONVERSIONS] is None
    torch.testing.assert_close(split(IDS).logits, model(IDS, use_cache=False).logits, rtol=0, atol=0)
