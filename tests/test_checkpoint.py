"""Checkpoints onto the plan: a meta model split and loaded from safetensors / torch.save files.

Each test writes its own checkpoint from a model with random weights, builds
the same architecture on ``meta`` (or with :func:`fxsplit.empty_weights`), and
checks the split against the model it was saved from: outputs and gradients,
tensors on their planned devices, tied weights loaded once, and bad
checkpoints refused with one error that lists every problem while nothing of
the model changes.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
from helpers import Tied, assert_same_grads, default_loss

import fxsplit
from fxsplit.checkpoint import load as checkpoint_load

safetensors_torch = pytest.importorskip("safetensors.torch")

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
BUDGETS = {"cpu:0": "1.5KiB", "cpu:1": "1.5KiB"}  # one Linear(16, 16) (1088 bytes) on each
BUDGETS_TIED = {"cpu:0": "4KiB", "cpu:1": "4KiB"}  # helpers.Tied over two devices


class WithTable(nn.Module):
    """Two layers and a non-persistent buffer computed when built (like a rotary embedding's ``inv_freq``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * self.scale)


def two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))


def saved(factory: Callable[[], nn.Module], path: Path, fmt: str = "safetensors") -> nn.Module:
    """A model with seeded random weights, saved at ``path``; returned for reference."""
    torch.manual_seed(1)
    model = factory().eval()
    state = model.state_dict()
    if fmt == "safetensors":
        names = {}
        for name, tensor in state.items():  # shared tensors once, as save_pretrained writes them
            names.setdefault(tensor.data_ptr(), name)
        safetensors_torch.save_file({n: state[n].contiguous() for n in names.values()}, str(path))
    else:
        torch.save(state, path)
    return model


def on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return factory().eval()


def assert_matches(split: torch.nn.Module, model: nn.Module, reference: nn.Module, inputs: tuple) -> None:
    """Same outputs and gradients as ``reference``; the split's weights are ``model``'s."""
    out, expected = split(*inputs), reference(*inputs)
    torch.testing.assert_close(out, expected)
    default_loss(out).backward()
    default_loss(expected).backward()
    assert_same_grads(model, reference)


def test_meta_model_loads_from_safetensors_onto_planned_devices(tmp_path: Path) -> None:
    reference = saved(two_layers, tmp_path / "model.safetensors")
    model = on_meta(two_layers)
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), mode="weights", checkpoint=tmp_path, progress=False)
    plan = split.meta["fxsplit_plan"]
    assert set(plan.param_devices.values()) == {"cpu:0", "cpu:1"}
    for name, param in model.named_parameters():
        assert type(param) is nn.Parameter and param.requires_grad and param.device.type == "cpu"
        assert split.get_parameter(name) is param  # the model and the split share the loaded tensors
    assert_matches(split, model, reference, (X,))


def test_real_model_keeps_its_parameter_objects_and_gets_the_checkpoint_values(tmp_path: Path) -> None:
    reference = saved(two_layers, tmp_path / "weights.safetensors")
    torch.manual_seed(7)
    model = two_layers().eval()
    before = dict(model.named_parameters())
    split = fxsplit.fxsplit(model, BUDGETS, trace="fx", mode="weights", checkpoint=tmp_path / "weights.safetensors")
    assert dict(model.named_parameters()) == before  # same objects
    assert_matches(split, model, reference, (X,))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_tied_weights_load_once_and_stay_tied(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / ("model.safetensors" if fmt == "safetensors" else "pytorch_model.bin")
    reference = saved(Tied, path, fmt)  # safetensors: 'emb.weight' only; torch.save: both names
    model = on_meta(Tied)
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(2))
    split = fxsplit.fxsplit(
        model, {"cpu:0": "4KiB", "cpu:1": "4KiB"}, example_inputs=(ids,), mode="weights", checkpoint=tmp_path
    )
    assert model.head.weight is model.emb.weight
    assert split.get_parameter("head.weight") is model.emb.weight  # export keeps one name of a tied tensor
    assert_matches(split, model, reference, (ids,))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_checkpoint_whose_tied_names_disagree_is_refused(tmp_path: Path, fmt: str) -> None:
    """The model holds one tensor for both names: a checkpoint with two different values is not loaded."""
    state = {name: tensor.clone() for name, tensor in Tied().state_dict().items()}
    state["head.weight"] = torch.randn_like(state["emb.weight"])  # not the embedding's
    if fmt == "safetensors":
        safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    else:
        torch.save(state, tmp_path / "pytorch_model.bin")
    model = on_meta(Tied)
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(2))
    with pytest.raises(fxsplit.CheckpointError, match=r"tied: 'emb.weight' and 'head.weight' are one tensor"):
        fxsplit.fxsplit(model, BUDGETS_TIED, example_inputs=(ids,), mode="weights", checkpoint=tmp_path)
    assert model.head.weight is model.emb.weight and model.emb.weight.device.type == "meta"  # nothing loaded
    state["head.weight"] = state["emb.weight"].clone()  # equal values under both names: loaded
    (tmp_path / ("model.safetensors" if fmt == "safetensors" else "pytorch_model.bin")).unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    split = fxsplit.fxsplit(model, BUDGETS_TIED, example_inputs=(ids,), mode="weights", checkpoint=tmp_path)
    torch.testing.assert_close(split.get_parameter("head.weight"), state["emb.weight"])


def test_load_checkpoint_fills_a_tied_weight_the_split_holds_under_its_other_name(tmp_path: Path) -> None:
    reference = saved(Tied, tmp_path / "model.safetensors")  # holds 'emb.weight' only
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(2))
    split = fxsplit.fxsplit(
        on_meta(Tied), {"cpu:0": "4KiB", "cpu:1": "4KiB"}, example_inputs=(ids,), mode="weights", checkpoint=False
    )
    assert "emb.weight" not in dict(split.named_parameters())
    fxsplit.load_checkpoint(split, tmp_path)
    torch.testing.assert_close(split(ids), reference(ids))


def test_sharded_index_and_dtype_of_the_plan(tmp_path: Path) -> None:
    reference = saved(two_layers, tmp_path / "full.safetensors")
    state = reference.state_dict()
    shards = {"a.safetensors": ["0.weight", "0.bias"], "b.safetensors": ["2.weight", "2.bias"]}
    for file, names in shards.items():
        safetensors_torch.save_file({n: state[n] for n in names}, str(tmp_path / file))
    (tmp_path / "full.safetensors").unlink()
    weight_map = {n: file for file, names in shards.items() for n in names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = on_meta(two_layers)
    split = fxsplit.fxsplit(
        model, {"cpu:0": "600B", "cpu:1": "600B"}, trace="fx", mode="weights", dtype="bfloat16", checkpoint=tmp_path
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = split(X.to(torch.bfloat16))
    torch.testing.assert_close(out, reference.to(torch.bfloat16)(X.to(torch.bfloat16)))


class DtypeMask(nn.Module):
    """Adds a mask made at its weights' dtype, as Hugging Face models make attention masks: a trace bakes
    the dtype it saw into the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.full((16,), 0.5, dtype=self.fc1.weight.dtype, device=x.device)
        return self.fc2(self.fc1(x) + mask)


@pytest.mark.parametrize("how", ["fxsplit", "apply", "load_checkpoint"])
@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_checkpoint_loaded_as_the_plans_dtype_runs_the_graph_of_that_dtype(
    tmp_path: Path, trace: str, how: str
) -> None:
    """With ``dtype=`` and a checkpoint, the model is cast before tracing, so the graph is the bf16 model's."""
    reference = saved(DtypeMask, tmp_path / "model.safetensors").to(torch.bfloat16)
    budgets, options = {"cpu:0": "700B", "cpu:1": "700B"}, {"trace": trace, "mode": "weights", "dtype": "bfloat16"}
    model = on_meta(DtypeMask)
    if how == "fxsplit":
        split = fxsplit.fxsplit(model, budgets, example_inputs=(X,), checkpoint=tmp_path, **options)
    elif how == "apply":
        plan = fxsplit.plan(on_meta(DtypeMask), budgets, example_inputs=(X,), **options)
        split = fxsplit.apply(model, plan, example_inputs=(X,), checkpoint=tmp_path)
    else:
        split = fxsplit.fxsplit(model, budgets, example_inputs=(X,), checkpoint=False, **options)
        fxsplit.load_checkpoint(split, tmp_path)
    assert len(split.meta["fxsplit_plan"].cuts) >= 1
    assert {p.dtype for p in split.parameters()} == {torch.bfloat16}
    x = X.to(torch.bfloat16)
    out = split(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x))


class CastsItsInputs(DtypeMask):
    """Converts its input to its weights' dtype first, as Hugging Face's vision models do with their pixels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.fc1.weight.dtype))


class ConvFirst(nn.Module):
    """A convolution first: its fake kernel refuses a float32 input beside bf16 weights (torch.export fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv1d(4, 4, 3, padding=1), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x.view(-1, 4, 4)).flatten(1))


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize(
    ("make", "fed"), [(DtypeMask, torch.bfloat16), (ConvFirst, torch.bfloat16), (CastsItsInputs, torch.float32)]
)
def test_a_model_cast_for_a_plan_is_fed_its_float_inputs_as_given_where_it_can_run_them(
    tmp_path: Path, trace: str, make: Callable[[], nn.Module], fed: torch.dtype
) -> None:
    """Float32 example inputs for a plan at bf16: a model that converts them itself is traced on them as given (its
    split takes them as the model does); one that cannot run them at bf16 on them at bf16, as it will be fed (the
    activations counted at bf16, no warning of mixed dtypes). ``plan()`` of the meta model, a split that loads the
    checkpoint and ``apply`` of the plan choose alike: one plan. The checkpoint split traced float32 inputs into
    the bf16 layers (counted twice their size, with that warning); then, at bf16 always, the pixels a
    Hugging Face ViT converts itself, and the plan of a meta ViT did not apply to it with a checkpoint."""
    reference = saved(make, tmp_path / "model.safetensors").to(torch.bfloat16)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))  # float32: 4 KiB, 2 KiB at bf16
    budgets, options = {"cpu:0": "8KiB", "cpu:1": "8KiB"}, {"trace": trace, "mode": "inference", "dtype": "bfloat16"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxsplit.FxsplitWarning)
        plan = fxsplit.plan(on_meta(make), budgets, example_inputs=(x,), **options)
        split = fxsplit.fxsplit(on_meta(make), budgets, example_inputs=(x,), checkpoint=tmp_path, **options)
        applied = fxsplit.apply(on_meta(make), plan, example_inputs=(x,), checkpoint=tmp_path)
    made = split.meta["fxsplit_plan"]
    assert made.memory == plan.memory and made.placement == plan.placement
    given = [node for node in split.graph.nodes if node.op == "placeholder"][0].meta["val"]
    assert given.dtype == fed
    for run in (split, applied):
        torch.testing.assert_close(run(x.to(fed)), reference(x.bfloat16()))


def test_a_failed_split_with_a_dtype_leaves_the_model_at_its_own_dtype(tmp_path: Path) -> None:
    saved(DtypeMask, tmp_path / "model.safetensors")
    model = on_meta(DtypeMask)
    with pytest.raises(fxsplit.BudgetError):
        fxsplit.fxsplit(model, {"cpu:0": "100B"}, example_inputs=(X,), dtype="bfloat16", checkpoint=tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_apply_a_saved_plan_with_a_checkpoint(tmp_path: Path) -> None:
    reference = saved(two_layers, tmp_path / "model.safetensors")
    plan = fxsplit.plan(on_meta(two_layers), BUDGETS, example_inputs=(X,), mode="weights")
    model = on_meta(two_layers)
    split = fxsplit.apply(model, fxsplit.Plan.from_yaml(plan.to_yaml()), example_inputs=(X,), checkpoint=tmp_path)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert_matches(split, model, reference, (X,))


def test_load_checkpoint_into_a_split_made_with_checkpoint_false(tmp_path: Path) -> None:
    reference = saved(WithTable, tmp_path / "model.safetensors")
    with fxsplit.empty_weights():  # parameters on meta, the buffer computed
        model = WithTable().eval()
    assert model.fc1.weight.device.type == "meta" and model.scale.device.type == "cpu"
    with pytest.raises(fxsplit.FxsplitError, match="checkpoint="):
        fxsplit.fxsplit(model, BUDGETS, trace="fx", mode="weights")
    split = fxsplit.fxsplit(model, BUDGETS, trace="fx", mode="weights", checkpoint=False)
    assert split.get_parameter("fc1.weight").device.type == "meta"
    with pytest.raises(fxsplit.CheckpointError, match=r"4 tensor\(s\) are on meta .*fxsplit.load_checkpoint"):
        split(X)  # not loaded yet: said so, not a torch error from inside an op
    # fx copies the buffer into the split as a persistent one; the split remembers it is not in checkpoints
    fxsplit.load_checkpoint(split, tmp_path / "model.safetensors")
    torch.testing.assert_close(split(X), reference(X))
    assert not split._forward_pre_hooks  # loaded: the check is gone


def test_load_checkpoint_into_a_real_split_replaces_values_in_place(tmp_path: Path) -> None:
    reference = saved(two_layers, tmp_path / "model.pt", "bin")
    torch.manual_seed(5)
    model = two_layers().eval()
    split = fxsplit.fxsplit(model, BUDGETS, trace="fx", mode="weights")
    before = dict(split.named_parameters())
    fxsplit.load_checkpoint(split, tmp_path / "model.pt")
    assert dict(split.named_parameters()) == before
    assert_matches(split, model, reference, (X,))


def test_meta_buffers_the_checkpoint_cannot_fill_are_named(tmp_path: Path) -> None:
    saved(WithTable, tmp_path / "model.safetensors")
    # the buffer is on meta too: lost. Moved there, not built there: after transformers' from_pretrained (which
    # patches torch.linspace meanwhile), torch.device("meta") no longer makes torch.linspace on meta in the process
    model = WithTable().eval().to("meta")
    with pytest.raises(fxsplit.CheckpointError) as raised:
        fxsplit.fxsplit(model, BUDGETS, trace="fx", mode="weights", checkpoint=tmp_path)
    message = str(raised.value)
    assert "meta buffer: 'scale' (float32[16])" in message and "fxsplit.empty_weights()" in message
    assert model.fc1.weight.device.type == "meta"


def test_a_bad_checkpoint_lists_every_problem_with_its_file_and_loads_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    good = two_layers().state_dict()
    safetensors_torch.save_file(
        {"0.weight": good["0.weight"], "0.bias": good["0.bias"].long()}, str(tmp_path / "one.safetensors")
    )
    safetensors_torch.save_file(
        {"2.weight": torch.zeros(8, 16), "extra.table": torch.zeros(3)}, str(tmp_path / "two.safetensors")
    )
    model = on_meta(two_layers)
    before = dict(model.named_parameters())
    with pytest.raises(fxsplit.CheckpointError) as raised:
        fxsplit.fxsplit(model, BUDGETS, trace="fx", mode="weights", checkpoint=tmp_path)
    assert isinstance(raised.value, ValueError)
    assert sorted(raised.value.problems) == sorted(
        [
            "missing: '2.bias' (float32[16]) is not in the checkpoint",
            "dtype: '0.bias' is int64[16] in 'one.safetensors', float32[16] in the model; only floating dtypes are "
            "converted",
            "shape: '2.weight' is float32[8, 16] in 'two.safetensors', float32[16, 16] in the model",
            "unexpected: 'extra.table' (float32[3]) in 'two.safetensors' is not a tensor of the model",
        ]
    )
    assert "nothing was loaded" in str(raised.value)
    assert dict(model.named_parameters()) == before
    assert all(p.device.type == "meta" for p in model.parameters())


def test_a_failure_while_reading_leaves_the_model_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved(two_layers, tmp_path / "model.safetensors")
    torch.manual_seed(3)
    model = two_layers().eval()
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    read = checkpoint_load._read
    calls = []

    def fail_third(*args: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("out of memory on the device")
        return read(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint_load, "_read", fail_third)
    with pytest.raises(MemoryError):
        fxsplit.fxsplit(model, BUDGETS, trace="fx", mode="weights", checkpoint=tmp_path)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, values[name])


def test_a_failure_after_loading_puts_the_meta_tensors_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved(two_layers, tmp_path / "model.safetensors")
    model = on_meta(two_layers)
    before = dict(model.named_parameters())

    def broken_emit(*args: object, **kwargs: object) -> None:
        raise RuntimeError("codegen failed")

    monkeypatch.setattr(fxsplit.api, "emit", broken_emit)
    with pytest.raises(RuntimeError, match="codegen failed"):
        fxsplit.fxsplit(model, BUDGETS, trace="fx", mode="weights", checkpoint=tmp_path)
    assert dict(model.named_parameters()) == before  # the meta Parameters, back in their modules


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    saved(two_layers, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(fxsplit.CheckpointError, match="corrupt or truncated"):
        fxsplit.fxsplit(on_meta(two_layers), BUDGETS, trace="fx", mode="weights", checkpoint=tmp_path)


def test_an_empty_directory_says_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(fxsplit.CheckpointError, match="model.safetensors.index.json"):
        fxsplit.fxsplit(on_meta(two_layers), BUDGETS, trace="fx", mode="weights", checkpoint=tmp_path)


def test_progress_is_silent_off_a_terminal_and_drawn_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved(two_layers, tmp_path / "model.safetensors")
    fxsplit.fxsplit(on_meta(two_layers), BUDGETS, trace="fx", mode="weights", checkpoint=tmp_path)
    assert capsys.readouterr().err == ""  # stderr is not a terminal here
    fxsplit.fxsplit(on_meta(two_layers), BUDGETS, trace="fx", mode="weights", checkpoint=tmp_path, progress=True)
    assert "loading checkpoint [########################] 4/4 tensors" in capsys.readouterr().err


def test_empty_weights_puts_parameters_on_meta_and_restores_register_parameter() -> None:
    register = nn.Module.register_parameter
    with fxsplit.empty_weights():
        norm = nn.BatchNorm1d(4)
    assert nn.Module.register_parameter is register
    assert norm.weight.device.type == "meta" and isinstance(norm.weight, nn.Parameter)
    assert norm.running_mean.device.type == "cpu"
    assert nn.Linear(2, 2).weight.device.type == "cpu"


@pytest.mark.slow  # the benchmark in a subprocess: ~10 s
def test_benchmark_small_checkpoint_meets_the_memory_bar(tmp_path: Path) -> None:
    from benchmarks import checkpoint_load as bench

    result = bench.measure_fxsplit(bench.write_checkpoint(tmp_path, 64 * 2**20))
    assert result["peak_anon"] <= result["bar"], result
    # what loading added: the weights once and one tensor in flight (a second copy of each would show)
    assert result["peak_anon"] - result["baseline_anon"] <= result["model_bytes"] + result["largest"] + 32 * 2**20
    out = io.StringIO()
    bench.report([result], out)
    assert "fxsplit" in out.getvalue()


@pytest.mark.slow  # the benchmark in a subprocess: ~10 s
def test_benchmark_small_checkpoint_offloaded_to_disk_keeps_only_the_resident_part(tmp_path: Path) -> None:
    from benchmarks import checkpoint_load as bench

    checkpoint = bench.write_checkpoint(tmp_path, 64 * 2**20)
    result = bench.measure_fxsplit(checkpoint, offload=True)
    assert result["disk_bytes"] > 0 and result["resident_bytes"] + result["disk_bytes"] == result["model_bytes"]
    assert result["peak_anon"] <= result["bar"] == result["resident_bytes"] + result["largest"] + bench.MARGIN
    # what loading added: the resident weights once and one tensor in flight, the disk ones not at all
    grew = result["peak_anon"] - result["baseline_anon"]
    assert grew <= result["resident_bytes"] + result["largest"] + 32 * 2**20, result
    assert bench.passes(result) is True


def test_load_checkpoint_into_a_pipeline(tmp_path: Path) -> None:
    reference = saved(two_layers, tmp_path / "model.safetensors")
    pipeline = fxsplit.fxsplit(
        on_meta(two_layers), BUDGETS, example_inputs=(X,), mode="weights", pipeline=2, checkpoint=False
    )
    fxsplit.load_checkpoint(pipeline, tmp_path)
    torch.testing.assert_close(pipeline(X), reference(X))


def test_a_legacy_torch_save_file_says_how_to_convert_it(tmp_path: Path) -> None:
    torch.save(two_layers().state_dict(), tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(fxsplit.CheckpointError, match="save it again with torch.save"):
        fxsplit.fxsplit(on_meta(two_layers), BUDGETS, trace="fx", mode="weights", checkpoint=tmp_path / "old.bin")


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_split_and_model_state_dicts_load_strictly_into_each_other(trace: str) -> None:
    """A non-persistent buffer the split holds (a graph module's copy of it) stays out of its state dict."""
    model = WithTable().eval()
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace=trace, mode="weights")
    assert "scale" not in model.state_dict()
    assert set(split.state_dict()) == set(model.state_dict())
    split.load_state_dict(model.state_dict())
    model.load_state_dict(split.state_dict())
    torch.testing.assert_close(split(X), model(X))


class WithStages(nn.Module):
    """A model whose own child is named ``stages`` (timm's ConvNeXt, for one), holding a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.Sequential(WithTable(), nn.ReLU(), WithTable())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(x)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_models_own_child_named_stages_is_not_taken_for_a_pipelines(trace: str) -> None:
    """Found by the planning-speed benchmark: a split of such a model failed with 'Value after * must be an
    iterable, not Container' (the split's ``stages`` attribute is the model's child, not a Pipeline's)."""
    model = WithStages().eval()
    split = fxsplit.fxsplit(model, {"cpu:0": "4KiB", "cpu:1": "4KiB"}, example_inputs=(X,), trace=trace, mode="weights")
    assert set(split.state_dict()) == set(model.state_dict())
    assert not any("scale" in name for name in split.state_dict())
    split.load_state_dict(model.state_dict())
    torch.testing.assert_close(split(X), model(X))


def test_a_pipelines_state_dict_leaves_out_the_models_non_persistent_buffers() -> None:
    model = WithTable().eval()
    pipeline = fxsplit.fxsplit(model, BUDGETS, example_inputs=(X,), trace="fx", mode="weights", pipeline={"chunks": 2})
    assert sorted(pipeline.state_dict()) == [
        "stages.0.fc1.bias",
        "stages.0.fc1.weight",
        "stages.1.fc2.bias",
        "stages.1.fc2.weight",
    ]
