"""A wrapped model (``torch.compile``, ``DataParallel``) is planned and split as the module inside, and its checkpoints
load.

``torch.compile(model)`` is an ``OptimizedModule`` whose ``forward`` torch.fx cannot trace ("missing the required
forward function", before) and whose tensors are all named ``_orig_mod.<name>``: a plan torch.export made of it
named them so, and applied to neither the model nor checkpoints saved from it. Now every entry point takes the
module it compiles, with a warning, and a checkpoint saved from the compiled model's ``state_dict()`` reads
under the model's names; the same for ``DataParallel`` (``module.<name>``), alone or compiled.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import fxsplit
from fxsplit.errors import FxsplitWarning

BUDGETS = {"cpu:0": "6KiB", "cpu:1": "6KiB"}
X = torch.randn(3, 16)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))


def _compiled_warning(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FxsplitWarning) and "_orig_mod" in str(w.message)]


def _plan(m: nn.Module, trace: str) -> fxsplit.Plan:
    return fxsplit.plan(m, BUDGETS, example_inputs=(X,), trace=trace, mode="weights")


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_compiled_model_is_planned_as_the_module_it_compiles(trace: str) -> None:
    plain = _plan(model(), trace)
    assert len(set(plain.param_devices.values())) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = _plan(torch.compile(model()), trace)
    (said,) = _compiled_warning(caught)
    assert "Sequential" in said and "runs uncompiled" in said and "model._orig_mod" in said
    assert [w.filename for w in caught if "_orig_mod" in str(w.message)] == [__file__]  # at the caller's line
    assert compiled.param_devices == plain.param_devices and compiled.fingerprint == plain.fingerprint
    assert compiled.cuts == plain.cuts


ROUTES: dict[str, Callable[[nn.Module, fxsplit.Plan], Any]] = {
    "fxsplit": lambda m, p: fxsplit.fxsplit(m, BUDGETS, example_inputs=(X,), trace=p.trace, mode="weights"),
    "apply": lambda m, p: fxsplit.apply(m, p, example_inputs=(X,)),
    "check_plan": lambda m, p: fxsplit.check_plan(m, p, example_inputs=(X,)),
    "from_device_map": lambda m, p: fxsplit.from_device_map(
        m, {"0": "cpu:0", "2": "cpu:0", "4": "cpu:1"}, example_inputs=(X,), trace=p.trace
    ),
    "pipeline_stages": lambda m, p: fxsplit.pipeline_stages(m, p, example_inputs=(X,), trace=p.trace),
}


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_entry_point_takes_a_compiled_model(route: str, trace: str) -> None:
    expected = model()(X)
    planned = _plan(model(), trace)
    compiled = torch.compile(model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = ROUTES[route](compiled, planned)
    assert len(_compiled_warning(caught)) == 1
    if isinstance(made, torch.nn.Module):
        torch.testing.assert_close(made(X), expected, rtol=0, atol=0)
        assert {id(p) for p in made.parameters()} == {id(p) for p in compiled._orig_mod.parameters()}
    elif isinstance(made, fxsplit.Plan):
        assert set(made.param_devices) == set(planned.param_devices)


def _save(state: dict[str, torch.Tensor], path: Path) -> Path:
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path))
    return path


def test_a_checkpoint_saved_from_a_compiled_model_loads_under_the_model_names(tmp_path: Path) -> None:
    trained = torch.compile(model())
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)  # not what model() starts with
    expected = trained(X)
    path = _save(trained.state_dict(), tmp_path / "model.safetensors")
    assert all(key.startswith("_orig_mod.") for key in trained.state_dict())
    with fxsplit.empty_weights():
        meta = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
    split = fxsplit.fxsplit(meta, BUDGETS, checkpoint=path, mode="weights")
    torch.testing.assert_close(split(X), expected, rtol=0, atol=0)
    applied = fxsplit.apply(model(), split.meta["fxsplit_plan"], checkpoint=path)
    torch.testing.assert_close(applied(X), expected, rtol=0, atol=0)
    loaded = fxsplit.fxsplit(model(), BUDGETS, mode="weights")
    fxsplit.load_checkpoint(loaded, path)
    torch.testing.assert_close(loaded(X), expected, rtol=0, atol=0)


def test_a_checkpoint_with_a_name_both_with_and_without_the_prefix_is_refused(tmp_path: Path) -> None:
    state = model().state_dict()
    path = _save({**state, "_orig_mod.0.weight": state["0.weight"] + 1}, tmp_path / "both.safetensors")
    with pytest.raises(fxsplit.CheckpointError, match="unexpected: '_orig_mod.0.weight'"):
        fxsplit.fxsplit(model(), BUDGETS, checkpoint=path, mode="weights")


def test_a_model_in_data_parallel_or_compiled_in_it_is_planned_as_the_module_inside() -> None:
    plain = _plan(model(), "fx")
    for wrap, count in ((nn.DataParallel, 1), (lambda m: torch.compile(nn.DataParallel(m)), 2)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = _plan(wrap(model()), "fx")
        said = [str(w.message) for w in caught if issubclass(w.category, FxsplitWarning)]
        assert len(said) == count and "wrapped in DataParallel: the split is one copy" in said[-1], said
        assert wrapped.param_devices == plain.param_devices and wrapped.fingerprint == plain.fingerprint


def test_a_checkpoint_saved_from_data_parallel_loads_under_the_model_names(tmp_path: Path) -> None:
    trained = nn.DataParallel(model())
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(-1.0)
    expected = trained(X)
    path = _save(trained.state_dict(), tmp_path / "model.safetensors")
    assert all(key.startswith("module.") for key in trained.state_dict())
    split = fxsplit.fxsplit(model(), BUDGETS, checkpoint=path, mode="weights")
    torch.testing.assert_close(split(X), expected, rtol=0, atol=0)
