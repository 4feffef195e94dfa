"""Copies between CUDA devices on side streams (fxsplit.pipeline.streams).

Without GPUs only the pass-through is testable: nothing that is not on another GPU is copied, and
no CUDA call is made for it. The copy itself runs where two GPUs are visible.
"""

from __future__ import annotations

import pytest
import torch

from fxsplit.pipeline.streams import CudaCopies


@pytest.mark.parametrize("device", ["cpu", "cpu:1", "cuda:0"])
def test_values_not_on_another_gpu_pass_through_untouched(device: str) -> None:
    copies = CudaCopies()
    x, marker = torch.ones(2), object()
    out = copies.copy_in([x, marker, 3], device)
    assert len(out) == 3 and out[0] is x and out[1] is marker and out[2] == 3
    assert copies._streams == {}  # no stream was made for them


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_tensor_on_another_gpu_is_copied_on_copy_streams() -> None:
    copies = CudaCopies()
    x = torch.arange(6.0, device="cuda:0")
    (moved,) = copies.copy_in([x], "cuda:1")
    assert moved.device == torch.device("cuda:1")
    torch.testing.assert_close(moved.cpu(), x.cpu())
    assert set(copies._streams) == {torch.device("cuda:0"), torch.device("cuda:1")}
    (again,) = copies.copy_in([moved], "cuda:1")
    assert again is moved  # already there
