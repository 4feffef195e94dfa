"""A torch.export split keeps the train/eval mode it was traced in, and says so when asked to switch."""

import copy

import pytest
import torch
import torch.nn as nn

import fxsplit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3), nn.BatchNorm1d(6), nn.Linear(6, 2))


BUDGETS = {"cpu:0": 300, "cpu:1": 400}


def test_eval_traced_split_matches_eval_model_and_refuses_train() -> None:
    model = _model().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 6)
    split = fxsplit.fxsplit(model, BUDGETS, mode="weights", example_inputs=(x,))
    assert split.training is False
    torch.testing.assert_close(split(x), reference(x))
    with pytest.raises(fxsplit.FxsplitError, match=r"eval mode.*model\.train\(\) before fxsplit"):
        split.train()
    split.eval()  # same mode: fine


def test_train_traced_split_refuses_eval() -> None:
    model = _model().train()
    x = torch.randn(5, 6)
    split = fxsplit.fxsplit(model, BUDGETS, mode="weights", example_inputs=(x,))
    assert split.training is True
    with pytest.raises(fxsplit.FxsplitError, match="training mode"):
        split.eval()


def test_graph_without_mode_dependent_ops_may_switch() -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2)).eval()
    x = torch.randn(5, 6)
    split = fxsplit.fxsplit(model, BUDGETS, mode="weights", example_inputs=(x,))
    split.train()
    assert split.training is True


def test_fx_split_follows_module_mode() -> None:
    model = _model().train()
    reference = copy.deepcopy(model).eval()
    x = torch.randn(5, 6)
    split = fxsplit.fxsplit(model, BUDGETS, mode="weights", example_inputs=(x,), trace="fx")
    split.eval()
    torch.testing.assert_close(split(x), reference(x))
