"""A linear op's rows split over pipeline stages (fxsplit.tracing.rowsplit, fxsplit.planning.rowsplits).

The rewrite is checked against the unsplit graph (outputs, the undo, the names a fresh trace gives), the
decision against what it must improve (the slowest stage's estimate), and the stages against the model:
chained in one process, their outputs are the model's and their gradients, summed as reduce_tied_grads sums
them, the model's. tests/test_distributed.py trains such stages on two gloo ranks.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxsplit
import fxsplit.api
from fxsplit.errors import FxsplitError, PlanMismatchError
from fxsplit.planning.rowsplits import piece_bounds
from fxsplit.tracing.capture import trace
from fxsplit.tracing.rowsplit import ROWS_MODULE, row_shards, split_rows, splittable_ops

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_models import Tied  # noqa: E402


class WideHead(nn.Module):
    """A small body and a large untied head (with a bias): the head is most of the work."""

    def __init__(self, vocab: int = 4096, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def _ids(vocab: int = 4096, batch: int = 8) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, 5), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method", ["fx", "export"])
def test_split_rows_computes_the_same_outputs_and_undoes_to_the_same_code(method: str) -> None:
    torch.manual_seed(0)
    model = WideHead(vocab=64, width=16)
    ids = _ids(64)
    traced = trace(model, example_inputs=(ids,), mode=method)
    gm = traced.graph_module
    before = gm.code
    ops = splittable_ops(gm)
    op = next(name for name, found in ops.items() if found.rows == 64)  # the head, not the body's 16-row linear
    undo = split_rows(gm, {op: (0, 16, 40, 64)})
    pieces = [n for n in gm.graph.nodes if n.name.startswith(f"{op}_rows")]
    assert [n.name for n in pieces if n.op != "get_attr"] == [f"{op}_rows0", f"{op}_rows1", f"{op}_rows2"]
    assert [tuple(n.meta["val"].shape)[-1] for n in pieces if n.op != "get_attr"] == [16, 24, 24]
    torch.testing.assert_close(gm(ids), model(ids), rtol=0, atol=0)
    shards = row_shards(gm)
    weight = model.head.weight
    for path, shard in shards.items():  # each piece's rows are the model's, over its storage: no copy
        rows = gm.get_parameter(path)
        source = weight if shard.source.endswith("weight") else model.head.bias
        assert rows.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        torch.testing.assert_close(rows, source[shard.start : shard.stop], rtol=0, atol=0)
    assert sorted((s.start, s.stop) for s in shards.values()) == [
        (0, 16),
        (0, 16),
        (16, 40),
        (16, 40),
        (40, 64),
        (40, 64),
    ]
    undo()
    assert gm.code == before and not hasattr(gm, ROWS_MODULE)
    split_rows(gm, {op: (0, 32, 64)})  # split again after the undo: the names a fresh trace would give
    assert {n.name for n in gm.graph.nodes if n.name.startswith(f"{op}_rows")} == {
        f"{op}_rows0",
        f"{op}_rows0_weight",
        f"{op}_rows0_bias",
        f"{op}_rows1",
        f"{op}_rows1_weight",
        f"{op}_rows1_bias",
    }
    torch.testing.assert_close(gm(ids), model(ids), rtol=0, atol=0)


def test_split_rows_refuses_what_it_cannot_split_and_leaves_the_graph() -> None:
    gm = trace(WideHead(vocab=64, width=16), example_inputs=(_ids(64),), mode="fx").graph_module
    before = gm.code
    with pytest.raises(ValueError, match="'tanh' is not a linear op"):
        split_rows(gm, {"tanh": (0, 8, 16)})
    with pytest.raises(ValueError, match="must rise from 0 to its 64 rows in at least two steps"):
        split_rows(gm, {"head": (0, 64)})
    with pytest.raises(ValueError, match=r"got \[0, 40, 20, 64\]"):
        split_rows(gm, {"head": (0, 40, 20, 64)})
    with pytest.raises(ValueError, match="'missing' is not a linear op"):
        split_rows(gm, {"missing": (0, 1, 2)})
    assert gm.code == before and not hasattr(gm, ROWS_MODULE)


def test_piece_bounds_are_near_equal_on_whole_tiles() -> None:
    assert piece_bounds(50257, 4) == (0, 12544, 25152, 37696, 50257)
    assert piece_bounds(4096, 7) == (0, 576, 1152, 1728, 2368, 2944, 3520, 4096)
    assert piece_bounds(100, 4) == (0, 64, 100)  # too few rows for four whole tiles
    assert piece_bounds(63, 3) == (0, 63)  # none: the caller then does not split


def _stages(model: nn.Module, devices: int, **options: object) -> fxsplit.PipelineStages:
    budgets = {f"cpu:{k}": "64MiB" for k in range(devices)}
    return fxsplit.pipeline_stages(model, budgets, example_inputs=(_ids(),), chunks=4, **options)  # type: ignore[arg-type]


def _slowest(plan: fxsplit.Plan) -> float:
    return max(row["compute"] + row["copies"] for row in plan.timing["stages"].values())


@pytest.mark.parametrize("make", [WideHead, lambda: Tied(vocab=4096, width=128)], ids=["untied", "tied"])
def test_a_head_most_of_the_work_is_split_over_stages_and_the_stages_equal_the_model(make, monkeypatch) -> None:
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    stages = _stages(model, 3, mode="training", optimizer="sgd")
    plan = stages.plan
    assert len(plan.row_splits) == 1
    ((op, split),) = plan.row_splits.items()
    devices = [plan.placement[f"{op}_rows{k}"] for k in range(len(split.bounds) - 1)]
    assert len(set(devices)) == len(devices) > 1  # one range per device, on consecutive stages
    assert split.weight == ("embed.weight" if isinstance(model, Tied) else "head.weight")
    # the split makes the slowest stage faster than the best plan without it, as estimated
    monkeypatch.setattr(fxsplit.api, "wants_row_splits", lambda *args: False)
    unsplit = _stages(copy.deepcopy(reference), 3, mode="training", optimizer="sgd").plan
    assert not unsplit.row_splits and _slowest(plan) < 0.9 * _slowest(unsplit)
    # chained in one process, the stages compute the model's outputs ...
    micro = _ids()[:2]
    values: tuple[torch.Tensor, ...] = (micro,)
    for module in stages.modules:
        out = module(*values)
        values = out if isinstance(out, tuple) else (out,)
    expected = reference(micro)
    torch.testing.assert_close(values[0], expected, rtol=1e-5, atol=1e-5)
    # ... and, each piece's gradient added at its rows (what reduce_tied_grads sums), the model's gradients
    values[0].square().mean().backward()
    expected.square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    for index, held in enumerate(stages._rows):
        for name, pieces in held.items():
            whole = dict(model.named_parameters())[name]
            total = grads.setdefault(name, torch.zeros_like(whole))
            for piece in pieces:
                total[piece.start : piece.stop] += stages.modules[index].get_parameter(piece.path).grad
    for name, param in reference.named_parameters():
        if name == "head.bias":  # the bias's rows: pieces of their own, checked through their paths
            bias_pieces = [
                p
                for i, m in enumerate(stages.modules)
                for path, p in m.named_parameters()
                if "bias" in path and ROWS_MODULE in path
            ]
            assert torch.cat([p.grad for p in bias_pieces]).allclose(param.grad, rtol=1e-5, atol=1e-6)
            continue
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_plan_records_the_split_round_trips_and_applies_only_as_stages() -> None:
    torch.manual_seed(0)
    model = WideHead()
    stages = _stages(model, 3, mode="weights")
    plan = stages.plan
    ((op, split),) = plan.row_splits.items()
    text = plan.to_yaml()
    assert f"  {op}: {{weight: head.weight, bounds: {list(split.bounds)}}}".replace("'", "") in text.replace("'", "")
    again = fxsplit.Plan.from_yaml(text)
    assert again == plan
    assert f"rows split: '{op}' (4096 output features) in {len(split.bounds) - 1} pieces, rows of head.weight" in str(
        plan
    )
    applied = fxsplit.pipeline_stages(model, again, example_inputs=(_ids(),), chunks=4)
    assert [s.nodes for s in applied.specs] == [s.nodes for s in stages.specs]
    with pytest.raises(
        FxsplitError, match=r"fxsplit.apply: this plan computes 'linear_1' \(2 pieces of head.weight\) in row pieces"
    ):
        fxsplit.apply(model, again, example_inputs=(_ids()[:2],))
    wrong = fxsplit.Plan.from_yaml(text.replace(f"bounds: {list(split.bounds)}", "bounds: [0, 5000]"))
    with pytest.raises(PlanMismatchError, match="row_splits do not fit the traced graph"):
        fxsplit.pipeline_stages(model, wrong, example_inputs=(_ids(),), chunks=4)


def test_an_untied_weight_split_into_rows_is_held_once() -> None:
    """The head's weight is read by no op once split: its rows are the pieces', and it costs nothing more."""
    torch.manual_seed(0)
    model = WideHead()
    plan = _stages(model, 3, mode="weights").plan
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(plan.device_bytes.values()) == total
    assert plan.param_devices["head.weight"] == plan.param_devices[f"{ROWS_MODULE}.linear_1_rows0_weight"]


def test_only_stages_in_processes_of_their_own_split_rows() -> None:
    torch.manual_seed(0)
    model = WideHead()
    budgets = {f"cpu:{k}": "64MiB" for k in range(3)}
    in_process = fxsplit.plan(model, budgets, example_inputs=(_ids(),), pipeline=4)
    assert not in_process.row_splits
    pinned = _stages(model, 3, pins={"head": "cpu:2"})  # a pin keeps every piece on one device: no split
    assert not pinned.plan.row_splits
    balanced = _stages(model, 3, objective="balanced")  # by bytes: no time to balance
    assert not balanced.plan.row_splits
    split = fxsplit.fxsplit(
        model, budgets, example_inputs=(_ids(),), pipeline=fxsplit.PipelineConfig(4, processes=True)
    )
    assert not split.meta["fxsplit_plan"].row_splits  # run here, in one process


def test_the_fresh_memory_of_large_weight_gradients_is_charged_on_cpu_not_cuda() -> None:
    from fxsplit.cost.compute import FRESH_ABOVE, op_seconds, op_work
    from fxsplit.hardware import Hardware

    model = nn.Sequential(nn.Embedding(40_000, 256), nn.Linear(256, 8))  # a 39 MiB table: above 32 MiB
    gm = trace(model, example_inputs=(_ids(40_000),), mode="fx").graph_module
    ops = [n for n in gm.graph.nodes if n.op == "call_module"]
    work = op_work(gm, ops)
    table = 40_000 * 256 * 4
    assert table > FRESH_ABOVE and work.train_fresh_nbytes.tolist() == [table, 0.0]
    cpu, cuda = Hardware.coerce(None).speed("cpu:0"), Hardware.coerce(None).speed("cuda:0")
    plain = Hardware.coerce({"devices": {"cpu": {"fresh_bandwidth": 0}}}).speed("cpu:0")
    extra = op_seconds(work, cpu, training=True) - op_seconds(work, plain, training=True)
    assert extra.tolist() == pytest.approx([table / cpu.fresh_bandwidth, 0.0])
    assert cuda.fresh_bandwidth == 0 and plain.fresh_bandwidth == 0
    assert Hardware.coerce({"devices": {"cpu": {"fresh_bandwidth": "1GB/s"}}}).speed("cpu:1").fresh_bandwidth == 1e9


@pytest.mark.parametrize(("merged_time", "kept"), [(6.0, "merged"), (6.05, "merged"), (7.0, "pieces")])
def test_merged_pieces_are_kept_unless_measured_slower_than_the_pieces(
    monkeypatch: pytest.MonkeyPatch, merged_time: float, kept: str
) -> None:
    """With profile=True, pieces small enough for the cache ran faster than one merged piece of their rows
    (GPT-2's head forward over four CPU stages: 61.7 ms merged against 47.5 ms in five pieces): the pieces
    stay then. The graph is left split as the returned plan says."""
    import types

    import fxsplit.planning.rowsplits as rowsplits

    fine, coarse = {"head": (0, 64, 128, 192, 256)}, {"head": (0, 64, 256)}

    def plan_of(slowest: float, where: list[str]) -> types.SimpleNamespace:
        placement = {f"head_rows{k}": d for k, d in enumerate(where)}
        timing = {"stages": {"a": {"compute": slowest, "copies": 0.0}}}
        return types.SimpleNamespace(plan=types.SimpleNamespace(placement=placement, timing=timing))

    unsplit, pieces, merged = plan_of(10.0, []), plan_of(6.0, ["a", "b", "b", "b"]), plan_of(merged_time, ["a", "b"])
    made: list[tuple[str, dict[str, tuple[int, ...]]]] = []

    def planned_with(gm: object, splits: dict[str, tuple[int, ...]], replan: object) -> tuple[object, object]:
        made.append(("split", dict(splits)))
        return (pieces if splits == fine else merged), lambda: made.append(("undo", dict(splits)))

    monkeypatch.setattr(rowsplits, "_fine_splits", lambda planned, gm: fine)
    monkeypatch.setattr(rowsplits, "_planned_with", planned_with)
    chosen = rowsplits.try_row_splits(unsplit, None, lambda: None)  # type: ignore[arg-type]
    if kept == "merged":
        assert chosen is merged
        assert made == [("split", fine), ("undo", fine), ("split", coarse)]
    else:
        assert chosen is pieces
        assert made == [("split", fine), ("undo", fine), ("split", coarse), ("undo", coarse), ("split", fine)]


def test_profiled_times_of_an_op_are_the_first_measured_across_plans_of_a_rewritten_graph() -> None:
    """Plans of one graph before and after a split are compared on the same numbers: an op that did not change
    (name, target, output shape) keeps the time first measured for it; a new op's is added."""
    from fxsplit.planning.timing import _as_first_seen

    gm = trace(WideHead(vocab=64, width=16), example_inputs=(_ids(64),), mode="fx").graph_module
    ops = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    seen: dict[tuple[object, ...], float] = {}
    first = _as_first_seen({"cpu:0": [1.0] * len(ops)}, ops, seen)
    again = _as_first_seen({"cpu:0": [2.0] * len(ops)}, ops, seen)
    assert first == again == {"cpu:0": [1.0] * len(ops)}
    split_rows(gm, {"head": (0, 32, 64)})  # 'head' is now a cat of two new pieces: measured anew
    ops = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    after = _as_first_seen({"cpu:0": [3.0] * len(ops)}, ops, seen)["cpu:0"]
    assert after == [3.0 if n.name.startswith("head") else 1.0 for n in ops]


def test_a_piece_name_the_graph_already_has_is_refused_before_anything_changes() -> None:
    gm = trace(WideHead(vocab=64, width=16), example_inputs=(_ids(64),), mode="fx").graph_module
    gm.graph.create_node("call_function", torch.relu, (next(iter(gm.graph.nodes)),), name="head_rows1")
    before = gm.graph.python_code("self").src
    with pytest.raises(ValueError, match=r"already has nodes named \['head_rows1'\]"):
        split_rows(gm, {"head": (0, 32, 64)})
    assert gm.graph.python_code("self").src == before and not hasattr(gm, ROWS_MODULE)
