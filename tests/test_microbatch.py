"""Micro-batches (fxsplit.pipeline.microbatch): scatter a batch, gather the outputs, trace on the first one.

The basic scatter and gather cases are in test_pipeline.py; here: nesting, uneven splits, what gather
cannot combine, and first_microbatch.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fxsplit
from fxsplit.pipeline.microbatch import first_microbatch, gather, scatter


def test_scatter_splits_nested_inputs_leaf_by_leaf_into_uneven_parts() -> None:
    batch = {"ids": torch.arange(8), "pair": (torch.ones(8, 2), torch.tensor(3.0))}
    parts, rows = scatter([batch, [torch.zeros(8, 1)]], ["batch", "extra"], 3)
    assert rows == [3, 3, 2]  # torch.tensor_split: sizes differ by at most one row
    assert [p[0]["ids"].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [p[0]["pair"][0].shape[0] for p in parts] == rows
    assert all(p[0]["pair"][1] is batch["pair"][1] for p in parts)  # a 0-dim tensor goes whole to every part
    assert [p[1][0].shape[0] for p in parts] == rows and all(type(p[1]) is list for p in parts)


def test_scatter_of_one_chunk_without_a_batch_gives_the_inputs_back() -> None:
    inputs = [2.0, "text"]
    parts, rows = scatter(inputs, ["scale", "label"], 1)
    assert parts == [inputs] and rows == [0]


def test_a_broadcast_input_is_not_counted_as_the_batch() -> None:
    with pytest.raises(
        fxsplit.FxsplitError,
        match="no tensor input has a batch dimension to split into micro-batches \\(inputs: mask\\)",
    ):
        scatter([torch.ones(4, 4)], ["mask"], 2, broadcast=("mask",))


def test_gather_weights_scalars_by_rows_not_by_micro_batch() -> None:
    with pytest.warns(UserWarning, match="weighted by rows"):
        merged = gather([torch.tensor(1.0), torch.tensor(4.0)], [3, 1])
    assert merged.item() == pytest.approx((1.0 * 3 + 4.0 * 1) / 4)  # not the plain mean 2.5


def test_gather_of_one_micro_batch_returns_its_values() -> None:
    y, loss = torch.ones(2, 1), torch.tensor(5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is averaged, so nothing to warn about
        merged = gather([(y, loss)], [2])
    assert merged[0] is y and merged[1] is loss


def test_gather_refuses_integer_scalars_and_numbers_that_differ_between_micro_batches() -> None:
    with pytest.raises(fxsplit.FxsplitError, match="output leaf 0 is a 0-dim torch.int64 tensor"):
        gather([torch.tensor(1), torch.tensor(2)], [1, 1])
    with pytest.raises(
        fxsplit.FxsplitError, match=r"output leaf 1 is a number .* differs between micro-batches \(7, 8\)"
    ):
        gather([(torch.ones(1, 2), 7), (torch.zeros(2, 2), 8)], [1, 2])  # a loss.item(): no whole-batch value


def test_gather_warns_for_a_number_that_may_depend_on_the_batch_and_keeps_other_values() -> None:
    with pytest.warns(UserWarning, match=r"output leaf 1 is a number that is not a tensor \(2 in every micro-batch\)"):
        merged = gather([(torch.ones(2, 2), 2, "label", None), (torch.zeros(2, 2), 2, "label", None)], [2, 2])
    assert merged[0].shape == (4, 2) and merged[1:] == (2, "label", None)  # x.shape[0] of a micro-batch, not 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strings, None and flags are not counts: nothing to warn about
        assert gather([(torch.ones(1, 2), True, "a"), (torch.ones(1, 2), True, "a")], [1, 1])[1:] == (True, "a")


def test_scatter_then_gather_is_the_batch_again() -> None:
    x = torch.randn(7, 3)
    parts, rows = scatter([x], ["x"], 3)
    assert torch.equal(gather([p[0] * 2 for p in parts], rows), x * 2)


def test_first_microbatch_of_inputs_and_keywords() -> None:
    x, mask = torch.arange(12.0).reshape(6, 2), torch.ones(6)
    args, kwargs = first_microbatch((x, 0.5), {"mask": mask}, 3)
    assert args is not None and kwargs is not None
    assert args[0].tolist() == [[0.0, 1.0], [2.0, 3.0]] and args[1] == 0.5
    assert kwargs["mask"].shape == (2,)


def test_first_microbatch_owns_its_storage() -> None:
    x = torch.randn(64, 16)
    (first,), _ = first_microbatch((x,), None, 4)
    assert first.untyped_storage().nbytes() == 16 * 16 * 4  # not a view that keeps the whole batch alive
    first.zero_()
    assert x.abs().sum() > 0


def test_first_microbatch_keeps_absent_inputs_absent() -> None:
    assert first_microbatch(None, None, 4) == (None, None)
    assert first_microbatch(None, {}, 4) == (None, None)
    args, kwargs = first_microbatch(None, {"x": torch.zeros(4, 1)}, 2)
    assert args is None and kwargs is not None and kwargs["x"].shape == (2, 1)
    args, kwargs = first_microbatch((torch.zeros(4, 1),), None, 2)
    assert kwargs is None and args is not None and args[0].shape == (2, 1)


def test_first_microbatch_needs_an_even_split() -> None:
    with pytest.raises(fxsplit.SpecError, match=r"example batch of 7 rows does not split evenly into 2 .*\[4, 3\]"):
        first_microbatch((torch.zeros(7, 1),), None, 2)
    with pytest.raises(fxsplit.SpecError, match="^pipeline: a batch of 2 rows .* cannot be split into 4"):
        first_microbatch((torch.zeros(2, 1),), None, 4)
    with pytest.raises(fxsplit.SpecError, match=r"'mask' has 3 rows along dim 0 but 'example_inputs\[0\]' has 4"):
        first_microbatch((torch.zeros(4, 1),), {"mask": torch.zeros(3)}, 2)
