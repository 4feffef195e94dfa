"""Models whose code calls ``torch.vmap`` (transformers builds its attention masks so: ``masking_utils``).

``torch.export`` keeps such a call as a region of the graph: ``_vmap_increment_nesting`` ... ``_add_batch_dim``
... ``_remove_batch_dim``, ``_vmap_decrement_nesting``, whose values inside are functorch wrappers with no storage.
The activation profile, run node by node on fake tensors, failed on them (found on Gemma 3 by a sweep of Hugging
Face models): the plan counted no activations, and the failure left the vmap region open, so every ``backward()``
in the process after that plan refused to run ("backward() called inside a functorch transform"). Now the region's
wrappers are passed through (its results are counted where it ends), and a failure leaves no transform open.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from helpers import assert_same_grads

import fxsplit
from fxsplit.errors import FxsplitWarning
from fxsplit.memory import activations
from fxsplit.memory.allocmeter import allocated_peaks

X = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))


class MaskedByVmap(nn.Module):
    """Attention whose causal mask is made by ``torch.vmap`` over the query positions, as transformers makes it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out, self.head = nn.Linear(16, 48), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1])
        mask = torch.vmap(lambda q: positions <= q)(positions)  # [queries, keys]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(torch.relu(self.out(h)) + x)


def _no_transform_open() -> bool:
    return torch._C._functorch.maybe_current_level() is None


def test_the_region_is_in_the_exported_graph() -> None:
    graph = torch.export.export(MaskedByVmap(), (X,)).module().graph
    assert any("vmap_increment_nesting" in str(node.target) for node in graph.nodes)


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_a_model_that_calls_vmap_is_planned_with_its_activations_and_trains(mode: str) -> None:
    torch.manual_seed(0)
    model = MaskedByVmap()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)  # "activations not counted: ..." before
        plan = fxsplit.plan(model, {"cpu:0": "1GiB"}, example_inputs=(X,), trace="export", mode=mode)
    assert _no_transform_open()
    need = plan.memory["cpu:0"]["total"]
    assert plan.memory["cpu:0"]["activations_peak"] > 0
    split = fxsplit.fxsplit(
        model, {"cpu:0": int(0.8 * need), "cpu:1": int(0.8 * need)}, example_inputs=(X,), trace="export", mode=mode
    )
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2 and _no_transform_open()
    rows = split.meta["fxsplit_plan"].memory
    with torch.set_grad_enabled(mode == "training"):  # what each device allocates, against what its row charged
        measured = allocated_peaks(split, X.clone(), backward=mode == "training")
    assert all(measured.get(device, 0) <= row["activations_peak"] for device, row in rows.items()), (measured, rows)
    model.zero_grad()
    out = split(X)
    torch.testing.assert_close(out, reference(X), rtol=0, atol=1e-6)
    if mode == "training":
        out.sum().backward()
        reference(X).sum().backward()
        assert_same_grads(reference, model)


def test_a_profile_that_fails_inside_the_region_leaves_no_transform_open(monkeypatch: pytest.MonkeyPatch) -> None:
    original = activations._Recorder.run_node

    def fails_in_the_region(self: activations._Recorder, n: torch.fx.Node) -> object:
        if "_add_batch_dim" in n.name:
            raise RuntimeError("an op failed inside the vmap region")
        return original(self, n)

    monkeypatch.setattr(activations._Recorder, "run_node", fails_in_the_region)
    with pytest.warns(FxsplitWarning, match="an op failed inside the vmap region"):
        fxsplit.plan(MaskedByVmap(), {"cpu:0": "1GiB"}, example_inputs=(X,), trace="export", mode="training")
    assert _no_transform_open()
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()  # refused while a transform was left open
