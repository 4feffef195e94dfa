"""A split's state_dict names each tied tensor as the model does (fxsplit.codegen.tiednames)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Tied

import fxsplit

BUDGETS = {"cpu:0": "4KiB", "cpu:1": "4KiB"}


def _ids() -> torch.Tensor:
    return torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("trace", ["export", "fx"])
def test_state_dict_loads_strictly_both_ways(trace: str) -> None:
    torch.manual_seed(0)
    model = Tied(vocab=32)
    gm = fxsplit.fxsplit(model, BUDGETS, example_inputs=(_ids(),), mode="weights", trace=trace)
    saved = gm.state_dict()
    assert set(saved) == set(Tied(vocab=32).state_dict())  # emb.weight and head.weight, as the model names them
    assert saved["emb.weight"].data_ptr() == saved["head.weight"].data_ptr()  # one tensor
    fresh = Tied(vocab=32)
    fresh.load_state_dict(saved, strict=True)
    torch.testing.assert_close(fresh(_ids()), gm(_ids()))

    torch.manual_seed(1)
    other = Tied(vocab=32)
    gm.load_state_dict(other.state_dict(), strict=True)  # the model's own state dict, both names in it
    torch.testing.assert_close(gm(_ids()), other(_ids()))
    assert set(copy.deepcopy(gm).state_dict()) == set(saved)


def test_a_state_dict_with_only_the_other_name_loads_into_the_held_tensor() -> None:
    gm = fxsplit.fxsplit(Tied(vocab=32), BUDGETS, example_inputs=(_ids(),), mode="weights", trace="export")
    held = {name for name, _ in gm.named_parameters()}
    other = Tied(vocab=32)
    state = other.state_dict()
    alias = next(name for name in ("emb.weight", "head.weight") if name not in held)
    del state[next(iter({"emb.weight", "head.weight"} - {alias}))]  # keep only the name the split lacks
    gm.load_state_dict(state, strict=True)
    torch.testing.assert_close(gm(_ids()), other(_ids()))
