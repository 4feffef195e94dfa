"""benchmarks/grad_parity.py: how a split's gradients are judged against the unsplit model's, and one real row.

The sweep itself (every causal LM type, two budgets each) runs as ``python -m benchmarks.grad_parity``; here its
judgement is held on made-up gradients, and one model type runs through it for real.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.grad_parity import classify, one

pytest.importorskip("transformers")

EXACT = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64) / 3  # float64 "truth"
REF = EXACT.float()  # the unsplit model's float32 gradient: the truth rounded once


def _nudged(t: torch.Tensor, steps: int) -> torch.Tensor:
    """``t`` with its first element moved ``steps`` float32 steps (as another order of additions rounds)."""
    out = t.clone()
    for _ in range(abs(steps)):
        out[0] = torch.nextafter(out[0], torch.tensor(float("inf") if steps > 0 else float("-inf")))
    return out


def test_equal_gradients_are_equal() -> None:
    assert classify({"w": REF.clone(), "b": None}, {"w": REF, "b": None}, None) == ("equal", [], 0.0)


def test_a_gradient_a_rounding_step_off_is_rounding_and_one_far_off_fails() -> None:
    status, differ, ratio = classify({"w": _nudged(REF, 1)}, {"w": REF}, {"w": EXACT})
    assert (status, differ) == ("rounding", ["w"]) and ratio > 0
    status, differ, _ = classify({"w": REF * 1.001}, {"w": REF}, {"w": EXACT})
    assert (status, differ) == ("fail", ["w"])


def test_without_float64_a_difference_is_unchecked_and_a_missing_gradient_fails() -> None:
    assert classify({"w": _nudged(REF, 1)}, {"w": REF}, None)[0] == "unchecked"
    assert classify({"w": None}, {"w": REF}, {"w": EXACT}) == ("fail", ["w"], 0.0)
    assert classify({"w": REF[:2].clone()}, {"w": REF}, {"w": EXACT})[0] == "fail"  # another shape


def test_gpt2_trains_over_two_devices_as_the_unsplit_model_does() -> None:
    rows = one("gpt2", fractions=(0.6,))
    assert len(rows) == 1
    row = rows[0]
    assert row["status"] in ("equal", "rounding"), row
    assert row["devices"] == 2 and row["loss_diff"] == 0.0 and row["gradients"] > 20, row
