"""A plan made on one kind of device applied to a graph traced on another, whose ``contiguous`` ops differ.

torch.export records ``x.contiguous()`` only where ``x`` is not contiguous, which depends on the strides the
kernels return: ``scaled_dot_product_attention`` on ``meta`` returns another layout than on the CPU. Every
Hugging Face model with SDPA attention (GPT-2, Llama, Qwen2 ...) planned on ``meta`` (README: plan before you
rent the cluster) was refused when applied to the real model on the CPU: "the plan places 2 node(s) the graph
does not have ... 'contiguous', 'contiguous_1'".
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxsplit
from fxsplit.errors import FxsplitWarning, PlanMismatchError
from fxsplit.planning.layoutnodes import layout_placement
from fxsplit.planning.retrace import retrace

BUDGETS = {"cpu:0": "26KiB", "cpu:1": "26KiB", "cpu:2": "26KiB"}  # 66 KiB of weights: every device holds some


class Attention(nn.Module):
    """Blocks of attention whose output is laid out back by ``transpose(1, 2).contiguous()``, as transformers'
    ``sdpa_attention_forward`` does."""

    def __init__(self, width: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"qkv": nn.Linear(width, 3 * width), "out": nn.Linear(width, width)}) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](x).view(batch, length, 3, 2, width // 2).permute(2, 0, 3, 1, 4)
            heads = F.scaled_dot_product_attention(q, k, v)
            x = x + block["out"](heads.transpose(1, 2).contiguous().view(batch, length, width))
        return x


def _meta_and_real() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    with torch.device("meta"):
        meta = Attention()
    torch.manual_seed(0)
    return meta, Attention().eval(), torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))


def _contiguous(names: object) -> list[str]:
    return sorted(name for name in names if str(name).startswith("contiguous"))  # type: ignore[attr-defined]


def test_a_plan_made_on_meta_applies_to_the_model_on_the_cpu() -> None:
    meta, model, x = _meta_and_real()
    plan = fxsplit.plan(meta, BUDGETS, example_inputs=(x.to("meta"),), mode="weights")
    assert _contiguous(plan.placement) == ["contiguous", "contiguous_1", "contiguous_2", "contiguous_3"]
    saved = fxsplit.Plan.from_yaml(plan.to_yaml())
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)  # the same copies: nothing to say
        split = fxsplit.apply(model, saved, example_inputs=(x,))
    applied = split.meta["fxsplit_plan"]
    assert [(c.source, c.destination, c.nbytes) for c in applied.cuts] == [
        (c.source, c.destination, c.nbytes) for c in plan.cuts
    ]
    assert _contiguous(applied.placement) == [] and applied.transfer_bytes == plan.transfer_bytes == 10240
    assert {n: d for n, d in applied.placement.items()} == {
        n: d for n, d in plan.placement.items() if not n.startswith("contiguous")
    }
    assert applied.param_devices == plan.param_devices
    torch.testing.assert_close(split(x), eager(x), rtol=0, atol=0)
    check = fxsplit.check_plan(eager, saved, example_inputs=(x,))  # the same path: it fits, nothing to note
    assert not check.notes


def test_a_plan_made_on_the_cpu_applies_to_a_graph_traced_on_meta() -> None:
    """The other way: the graph has the ``contiguous`` ops the plan lacks; each goes where the op it copies is."""
    meta, model, x = _meta_and_real()
    plan = fxsplit.plan(model, BUDGETS, example_inputs=(x,), mode="weights")
    assert _contiguous(plan.placement) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        split = fxsplit.apply(meta, plan, example_inputs=(x.to("meta"),), checkpoint=False)
    applied = split.meta["fxsplit_plan"]
    nodes = {node.name: node for node in split.graph.nodes}
    for name in _contiguous(applied.placement):
        (source,) = nodes[name].all_input_nodes
        assert applied.placement[name] == applied.placement[source.name]
    assert len(_contiguous(applied.placement)) == 4 and applied.transfer_bytes == plan.transfer_bytes


def test_other_differences_are_still_refused() -> None:
    """Only copy ops are placed anew: a plan whose other nodes differ was made for other code."""
    meta, model, x = _meta_and_real()
    plan = fxsplit.plan(meta, BUDGETS, example_inputs=(x.to("meta"),), mode="weights")
    assert layout_placement(torch.fx.symbolic_trace(model), {"x": "cpu:0"}) is None  # nodes the plan lacks
    renamed = fxsplit.Plan.from_yaml(plan.to_yaml().replace("  linear:", "  renamed:"))
    assert "renamed" in renamed.placement and "linear" not in renamed.placement
    with pytest.raises(PlanMismatchError, match="not in the graph: node 'renamed'"):
        fxsplit.apply(model, renamed, example_inputs=(x,))


class Constant(nn.Module):
    """A constant made in ``forward``: torch.export copies it (``lift_fresh_copy``) on the CPU, not on ``meta``
    (Hugging Face's Falcon and CPM-Ant planned on ``meta`` were refused on the CPU for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * torch.tensor(0.5, device=x.device))


def test_a_constant_copied_on_the_cpu_only_is_placed_with_the_constant() -> None:
    with torch.device("meta"):
        meta = Constant()
    model, x = Constant(), torch.randn(2, 64)
    plan = fxsplit.plan(meta, {"cpu:0": "20KiB", "cpu:1": "20KiB"}, example_inputs=(x.to("meta"),), mode="weights")
    assert "lift_fresh_copy" not in plan.placement
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxsplitWarning)
        split = fxsplit.apply(model, plan, example_inputs=(x,))
    applied = split.meta["fxsplit_plan"]
    (constant,) = next(n for n in split.graph.nodes if n.name == "lift_fresh_copy").all_input_nodes
    assert applied.placement["lift_fresh_copy"] == applied.placement[constant.name]
    assert applied.transfer_bytes == plan.transfer_bytes
    torch.testing.assert_close(split(x), model(x), rtol=0, atol=0)


def test_other_copies_than_the_plans_are_said() -> None:
    """Where the copies worked out anew differ from the plan's (here: a plan that lists one copy fewer than its
    placement makes), the warning says both, and the plan the split keeps lists the copies it makes."""
    meta, model, x = _meta_and_real()
    plan = fxsplit.plan(meta, BUDGETS, example_inputs=(x.to("meta"),), mode="weights")
    fewer = dataclasses.replace(plan, cuts=plan.cuts[1:])
    with pytest.warns(FxsplitWarning) as caught:
        _, _, made = retrace(model, fewer, example_inputs=(x,))
    (said,) = [str(w.message) for w in caught if "copy op(s)" in str(w.message)]
    assert "the plan was made on a graph with 4 copy op(s) (contiguous, lift_fresh_copy), this one has 0" in said
    assert f"{len(plan.cuts)} cut(s), 10.00 KiB per forward (the plan said {len(plan.cuts) - 1}, " in said
    assert made.cuts == fxsplit.apply(copy.deepcopy(model), plan, example_inputs=(x,)).meta["fxsplit_plan"].cuts
