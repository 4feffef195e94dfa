"""Tensors a model keeps at float32 when loaded at bf16 (transformers' ``_keep_in_fp32_modules_strict``).

A split at ``dtype="bfloat16"`` from a checkpoint holds what
``from_pretrained(dtype=torch.bfloat16)`` holds: a MoE router's ``gate.weight``
and ``e_score_correction_bias`` stay float32, so the split's logits are the bf16
model's, bit for bit; the plan counts them at float32. A plain torch model
declares the same with its own ``_get_dtype_plan(dtype)`` (pattern -> dtype).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fxsplit
from benchmarks.dtype_parity import small_config
from fxsplit.cost.keptdtype import kept_dtypes

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


class Routed(torch.nn.Module):
    """A router whose scores are computed in float32 from a gate the model keeps at float32."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.gate = torch.nn.Linear(32, 4, bias=False)
        self.register_buffer("score_bias", torch.randn(4))
        self.experts = torch.nn.Linear(32, 16 * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        scores = F.linear(h.float(), self.gate.weight.float()) + self.score_bias
        weights = scores.softmax(-1).to(h.dtype)
        return (self.experts(h).unflatten(-1, (4, 16)) * weights.unsqueeze(-1)).sum(-2)


class KeepsGate(torch.nn.Module):
    def __init__(self, fails: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(Routed(), Routed(), Routed())
        self.keep = None if fails else {"gate.weight": torch.float32, "score_bias": torch.float32}

    def _get_dtype_plan(self, dtype: torch.dtype) -> dict[str, torch.dtype]:
        if self.keep is None:
            raise RuntimeError("no rule")
        return dict(self.keep) if dtype in (torch.float16, torch.bfloat16) else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


KEPT = [f"blocks.{i}.{name}" for i in range(3) for name in ("gate.weight", "score_bias")]


def _saved(tmp_path: Path) -> tuple[Path, KeepsGate]:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = KeepsGate()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path, model


def _as_loaded_at_bf16(model: KeepsGate) -> KeepsGate:
    """What a loader that keeps the kept tensors at float32 makes of ``model`` at bf16, by hand."""
    reference = KeepsGate()
    reference.load_state_dict(model.state_dict())
    reference.to(torch.bfloat16)
    for name in KEPT:
        owner, _, leaf = name.rpartition(".")
        tensor = reference.get_submodule(owner)._parameters.get(leaf)
        if tensor is not None:
            tensor.data = model.get_parameter(name).data.clone()
        else:
            reference.get_submodule(owner)._buffers[leaf] = model.get_buffer(name).clone()
    return reference.eval()


def test_the_names_a_model_keeps_are_found_as_its_rule_matches_them() -> None:
    model = KeepsGate()
    assert sorted(kept_dtypes(model, torch.bfloat16)) == sorted(KEPT)
    assert set(kept_dtypes(model, "bfloat16").values()) == {torch.float32}
    assert kept_dtypes(model, torch.float32) == {} and kept_dtypes(model, None) == {}
    assert kept_dtypes(KeepsGate(fails=True), torch.bfloat16) == {}  # a rule that fails names nothing
    assert kept_dtypes(torch.nn.Linear(2, 2), torch.bfloat16) == {}  # no rule at all


@pytest.mark.parametrize("offload", [False, True])
def test_a_checkpoint_loaded_at_bf16_keeps_what_the_model_keeps_at_float32(tmp_path: Path, offload: bool) -> None:
    path, model = _saved(tmp_path)
    reference = _as_loaded_at_bf16(model)
    x = torch.randn(3, 16).to(torch.bfloat16)
    with torch.no_grad():
        want = reference(x)
    with fxsplit.empty_weights():
        empty = KeepsGate().eval()
    options: dict[str, Any] = {"offload": {"disk": "1MiB", "dir": str(tmp_path / "off")}} if offload else {}
    budget = "6KiB" if offload else "20KiB"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = fxsplit.fxsplit(
            empty,
            {"cpu:0": budget, "cpu:1": budget},
            example_inputs=(x,),
            trace="fx",
            checkpoint=path,
            dtype="bfloat16",
            **options,
        )
    held = dict(split.named_parameters()) | dict(split.named_buffers())
    assert {name: held[name].dtype for name in KEPT} == dict.fromkeys(KEPT, torch.float32)
    assert {t.dtype for name, t in held.items() if name not in KEPT} == {torch.bfloat16}
    if offload:
        assert split.meta["fxsplit_plan"].streamed, "the test meant some weights to be stored off the devices"
    with torch.no_grad():
        assert torch.equal(split(x), want)


def test_a_split_filled_later_keeps_them_too(tmp_path: Path) -> None:
    path, model = _saved(tmp_path)
    x = torch.randn(3, 16).to(torch.bfloat16)
    with fxsplit.empty_weights():
        empty = KeepsGate().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = fxsplit.fxsplit(
            empty,
            {"cpu:0": "20KiB", "cpu:1": "20KiB"},
            example_inputs=(x,),
            trace="fx",
            checkpoint=False,
            dtype="bfloat16",
        )
    fxsplit.load_checkpoint(split, path)
    held = dict(split.named_parameters()) | dict(split.named_buffers())
    assert {held[name].dtype for name in KEPT} == {torch.float32}
    with torch.no_grad():
        assert torch.equal(split(x), _as_loaded_at_bf16(model)(x))


@pytest.mark.parametrize("weights", ["real", "meta", "profiled"])  # stood in for, cast, counted as the dtype
def test_a_plan_at_bf16_counts_the_kept_tensors_at_float32(weights: str) -> None:
    torch.manual_seed(0)
    if weights == "meta":
        with fxsplit.empty_weights():
            model = KeepsGate().eval()
    else:
        model = KeepsGate().eval()
    inputs = (torch.randn(3, 16),)
    budgets = {"cpu:0": "20KiB", "cpu:1": "20KiB"}
    plan = fxsplit.plan(
        model, budgets, example_inputs=inputs, trace="fx", dtype="bfloat16", profile=weights == "profiled"
    )
    kept = {id(t) for name, t in model.state_dict(keep_vars=True).items() if name in KEPT}
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    want = sum(t.numel() * (4 if key in kept else 2) for key, t in tensors.items())
    assert sum(plan.device_bytes.values()) == want
    assert {t.dtype for t in model.state_dict().values()} == {torch.float32}  # the model is as it was


transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_a_moe_model_split_at_bf16_is_the_model_transformers_loads_at_bf16(tmp_path: Path) -> None:
    config = transformers.Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64, n_group=1, topk_group=1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    floats = {n for n, t in loaded.state_dict().items() if t.dtype == torch.float32}
    assert floats and all(n.endswith(("gate.weight", "e_score_correction_bias")) for n in floats)
    with torch.no_grad():
        want = loaded(input_ids=IDS, use_cache=False).logits
    with fxsplit.empty_weights():
        empty = transformers.AutoModelForCausalLM.from_config(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = fxsplit.fxsplit(
            empty, {"cpu:0": "300KiB", "cpu:1": "300KiB"}, example_inputs=(IDS,),
            example_kwargs={"use_cache": False}, checkpoint=tmp_path, dtype="bfloat16",
        )  # fmt: skip
    held = split.state_dict()
    assert {n for n, t in held.items() if t.dtype == torch.float32} >= floats
    with torch.no_grad():
        got = split(IDS, use_cache=False)
    assert torch.equal(got["logits"], want)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hunyuan_v1_moe", "zamba", "falcon_h1", "apertus"])
def test_what_the_model_builds_at_bf16_is_what_the_split_holds(tmp_path: Path, kind: str) -> None:
    """HunYuan-MoE's router and Zamba's ``A_log`` are built at float32 whatever the default dtype, Falcon-H1's
    ``mup_vector`` buffer at the default: ``from_pretrained(dtype=bf16)`` holds them so, and so does the split
    (it was 0.0024 and 0.0039 off, as if built at float32 and cast). Apertus' xIELU makes its parameters at
    ``config.dtype``, which ``save_pretrained`` set to float32 on the config the model shares: built at bf16 as
    transformers builds it, with ``config.dtype`` bf16, they are bf16."""
    config = small_config(kind)  # (benchmarks/dtype_parity.py: 116 such models)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    with fxsplit.empty_weights():
        empty = transformers.AutoModelForCausalLM.from_config(config).eval()
    total = sum(p.numel() * 2 for p in empty.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = fxsplit.fxsplit(
            empty, {"cpu:0": int(0.6 * total), "cpu:1": int(0.6 * total)}, example_inputs=(IDS,),
            example_kwargs={"use_cache": False}, checkpoint=tmp_path, dtype="bfloat16", mode="weights",
        )  # fmt: skip
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2
    want = {n: t.dtype for n, t in [*loaded.named_parameters(), *loaded.named_buffers()]}
    held = {n: t.dtype for n, t in [*split.named_parameters(), *split.named_buffers()]}
    assert {n: d for n, d in held.items() if n in want} == {n: d for n, d in want.items() if n in held}
    assert {d for d in want.values() if d.is_floating_point} == {torch.bfloat16, torch.float32}
    assert kind != "apertus" or {d for n, d in held.items() if "act_fn" in n} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(split(IDS, use_cache=False)["logits"], loaded(input_ids=IDS, use_cache=False).logits)
    with fxsplit.empty_weights():
        again = transformers.AutoModelForCausalLM.from_config(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = fxsplit.plan(
            again, split.meta["fxsplit_plan"].budgets, example_inputs=(IDS,), example_kwargs={"use_cache": False},
            dtype="bfloat16", mode="weights",
        )  # fmt: skip
    assert plan.memory == split.meta["fxsplit_plan"].memory  # planned on meta as the checkpoint split holds it
