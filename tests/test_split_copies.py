"""A deep copy of a split, or a split saved and loaded, behaves as the split: its mode guards, the model's hooks,
its autocast regions, its plan.

``copy.deepcopy`` of a graph module builds the copy from its graph, submodules and tensors: before, the copy had
the class's defaults for what a split carries besides (fxsplit.codegen.meta.kept_on_copy), so a copy of a split
that refuses ``eval()`` accepted it silently, and the model's own hooks no longer ran. ``torch.save`` of a torch.fx
split loaded it back as a plain ``GraphModule`` traced again from its code: the same loss, and no plan
(fxsplit.codegen.splitbase).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxsplit
from fxsplit.errors import FxsplitError

BUDGETS = {"cpu:0": 2000, "cpu:1": 2000}
X = torch.randn(4, 16)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.a(x).float()
        return F.dropout(h, 0.5, self.training)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(16, 4)).train()


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_copy_of_a_split_refuses_the_mode_switch_the_split_refuses(trace: str) -> None:
    split = fxsplit.fxsplit(model(), BUDGETS, example_inputs=(X,), trace=trace, mode="weights")
    copied = copy.deepcopy(split)
    for each in (split, copied):
        with pytest.raises(FxsplitError, match="cannot change"):
            each.eval()


def test_a_copy_of_a_split_runs_the_models_own_hooks_and_keeps_the_callers_autocast() -> None:
    m = model().eval()
    calls: list[int] = []
    m.register_forward_hook(lambda mod, args, out: calls.append(1) or out * 2)
    expected = m(X)
    calls.clear()
    copied = copy.deepcopy(fxsplit.fxsplit(m, BUDGETS, example_inputs=(X,), trace="fx", mode="weights"))
    torch.testing.assert_close(copied(X), expected, rtol=0, atol=0)
    assert calls == [1]
    with pytest.raises(RuntimeError):
        copied(torch.randn(4, 7))  # raises inside the first autocast region
    assert not torch.is_autocast_enabled("cpu")


def _saved_and_loaded(split: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(split, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _doubled(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
    return out * 2  # (a hook torch.save can pickle: a lambda cannot be)


def test_a_saved_split_runs_the_models_own_hooks_and_keeps_its_plan() -> None:
    m = model().eval()
    m.register_forward_hook(_doubled)
    split = fxsplit.fxsplit(m, BUDGETS, example_inputs=(X,), trace="fx", mode="weights")
    loaded = _saved_and_loaded(split)
    torch.testing.assert_close(loaded(X), m(X), rtol=0, atol=0)
    assert loaded.meta["fxsplit_plan"] == split.meta["fxsplit_plan"]
    assert loaded.code == split.code
    with pytest.raises(RuntimeError):
        loaded(torch.randn(4, 7))  # raises inside the first autocast region: the caller's autocast comes back
    assert not torch.is_autocast_enabled("cpu")


def test_a_saved_split_refuses_what_the_split_refuses() -> None:
    loaded = _saved_and_loaded(fxsplit.fxsplit(model(), BUDGETS, example_inputs=(X,), trace="fx", mode="weights"))
    with pytest.raises(FxsplitError, match="cannot change"):
        loaded.eval()
    graded = _saved_and_loaded(fxsplit.fxsplit(_graded(), BUDGETS, example_inputs=(X,), trace="fx", mode="weights"))
    torch.testing.assert_close(graded(X), _graded()(X), rtol=0, atol=0)
    with torch.no_grad(), pytest.raises(FxsplitError, match="read that mode"):
        graded(X)


class _GradScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * 2 if torch.is_grad_enabled() else self.a(x)


def _graded() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_GradScaled(), _GradScaled(), nn.Linear(16, 4))


def test_a_saved_pipeline_keeps_its_stages_regions() -> None:
    m = model().eval()
    pipeline = fxsplit.fxsplit(
        m, BUDGETS, example_inputs=(X,), trace="fx", mode="weights", pipeline=fxsplit.PipelineConfig(chunks=2)
    )
    loaded = _saved_and_loaded(pipeline)
    for call in ("_enter_autocast(", "_exit_autocast("):  # (its values are named anew)
        assert loaded.code.count(call) == pipeline.code.count(call) == 2
    torch.testing.assert_close(loaded(X), torch.cat([m(rows) for rows in X.chunk(2)]), rtol=0, atol=0)  # per chunk
