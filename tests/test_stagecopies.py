"""Time estimates for pipeline_stages: each stage holds the weights it reads (no copy per micro-batch), and in
training the gradients of a weight several stages hold are all-reduced once per step."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxsplit
from fxsplit.errors import SpecError
from fxsplit.hardware import Hardware
from fxsplit.planning.stagecopies import allreduce_seconds
from fxsplit.planning.timetable import step_and_bubble, time_lines
from fxsplit.planning.timing import TRAINING_COPIES
from tests.helpers import Tied

VOCAB, DIM, CHUNKS = 4000, 64, 4
WEIGHT_BYTES = VOCAB * DIM * 4
BUDGETS = {"cpu:0": "16MiB", "cpu:1": "16MiB"}
PINS = {"emb": "cpu:0", "body": "cpu:0", "head": "cpu:1"}  # the tied weight is read on both stages


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Tied(vocab=VOCAB, dim=DIM)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (32, 8), generator=torch.Generator().manual_seed(1))


def _stages(model: torch.nn.Module, **options: object) -> fxsplit.PipelineStages:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxsplit.pipeline_stages(model, BUDGETS, example_inputs=(_ids(),), chunks=CHUNKS, **options)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_stages_charge_no_copy_of_the_tied_weight_where_an_in_process_plan_does(mode: str) -> None:
    model = _model()
    in_process = fxsplit.plan(model, BUDGETS, example_inputs=(_ids(),), pipeline=CHUNKS, mode=mode, pins=PINS)
    stages = _stages(model, mode=mode, pins=PINS)
    assert stages.plan.placement == in_process.placement  # the pins fix it: only the charge differs
    assert [c.producer for c in in_process.cuts if c.kind == "parameter"] == ["emb.weight"]
    copies = {name: p.timing["stages"]["cpu:1"]["copies"] for name, p in (("one", in_process), ("stages", stages.plan))}
    link = Hardware().link("cpu:0", "cpu:1")
    weight_copy = link.seconds(WEIGHT_BYTES) * (TRAINING_COPIES if mode == "training" else 1.0)
    assert copies["one"] - copies["stages"] == pytest.approx(weight_copy, rel=1e-9)
    assert copies["stages"] > 0  # the activations crossing into the head's stage are still charged
    assert stages.plan.timing["stage_copies"] is True
    assert "stage_copies" not in in_process.timing and "allreduce" not in in_process.timing


def test_the_throughput_programme_may_choose_other_stages_once_the_copy_is_free() -> None:
    model = _model()
    in_process = fxsplit.plan(model, BUDGETS, example_inputs=(_ids(),), pipeline=CHUNKS)
    stages = _stages(model)
    # one process keeps the head beside the embedding (a copy per micro-batch would cost more than it saves);
    # stages that each hold the weight split them, and their slowest stage is faster
    assert set(in_process.placement.values()) == {"cpu:0"}
    assert "head" in stages.plan.modules["cpu:1"]
    slowest = {name: max(r["compute"] + r["copies"] for r in p.timing["stages"].values()) for name, p in
               (("one", in_process), ("stages", stages.plan))}  # fmt: skip
    assert slowest["stages"] < slowest["one"]


def test_training_adds_the_gradient_all_reduce_once_per_step() -> None:
    stages = _stages(_model(), mode="training", pins=PINS)
    record = stages.plan.timing
    link = Hardware().link("cpu:0", "cpu:1")
    expected = 2 * link.latency + WEIGHT_BYTES / link.bandwidth  # ring of two: 2 (k - 1) (lat + B / (k bw))
    assert record["allreduce"] == {
        "emb.weight": {"devices": ["cpu:0", "cpu:1"], "nbytes": WEIGHT_BYTES, "seconds": pytest.approx(expected)}
    }
    totals = [r["compute"] + r["copies"] for r in record["stages"].values()]
    step, bubble = step_and_bubble(record)
    assert step == pytest.approx(sum(totals) + (CHUNKS - 1) * max(totals) + expected)
    assert bubble == pytest.approx(1 - CHUNKS * sum(totals) / (len(totals) * step))
    lines = time_lines(record)
    assert lines[-2].startswith("tied gradients: all-reduce ≈ ") and "per step (emb.weight 1000.00 KiB" in lines[-2]
    assert "with the all-reduce" in lines[-1]
    assert "tied gradients: all-reduce" in str(stages)


def test_inference_has_no_all_reduce() -> None:
    stages = _stages(_model(), pins=PINS)
    assert stages.plan.timing["stage_copies"] is True  # planned for stages that hold the weight ...
    assert "allreduce" not in stages.plan.timing  # ... whose gradient nothing sums
    assert "all-reduce" not in str(stages)


def test_a_given_in_process_plan_says_its_times_are_for_one_process() -> None:
    model = _model()
    plan = fxsplit.plan(model, BUDGETS, example_inputs=(_ids(),), pipeline=CHUNKS, pins=PINS)
    text = str(fxsplit.pipeline_stages(model, plan, example_inputs=(_ids(),), chunks=CHUNKS))
    assert "time: estimated for a run in one process" in text
    assert "time: estimated for a run in one process" not in str(_stages(model, pins=PINS))


@pytest.mark.parametrize(
    "pipeline", [fxsplit.PipelineConfig(CHUNKS, processes=True), {"chunks": CHUNKS, "processes": True}]
)
def test_a_plan_made_for_processes_estimates_the_stages_pipeline_stages_runs(pipeline: object) -> None:
    model = _model()  # e.g. planned with profile=True on one rank, then given to pipeline_stages on every rank
    plan = fxsplit.plan(model, BUDGETS, example_inputs=(_ids(),), pipeline=pipeline, mode="training", pins=PINS)
    stages = _stages(model, mode="training", pins=PINS)
    assert plan.timing == stages.plan.timing and plan.timing["stage_copies"] is True and "allreduce" in plan.timing
    given = fxsplit.pipeline_stages(model, plan, example_inputs=(_ids(),), chunks=CHUNKS)
    assert "time: estimated for a run in one process" not in str(given)
    assert fxsplit.Plan.from_yaml(plan.to_yaml()).timing == plan.timing


def test_processes_must_be_a_bool() -> None:
    with pytest.raises(SpecError, match="pipeline processes must be true or false"):
        fxsplit.PipelineConfig(CHUNKS, processes="yes")  # type: ignore[arg-type]


def test_plan_files_keep_the_stage_copies_and_the_all_reduce() -> None:
    plan = _stages(_model(), mode="training", pins=PINS).plan
    loaded = fxsplit.Plan.from_yaml(plan.to_yaml())
    assert loaded == plan
    assert loaded.timing["stage_copies"] is True and "emb.weight" in loaded.timing["allreduce"]
    assert str(loaded) == str(plan)
    old = plan.to_yaml().replace(", stage_copies: true", "")  # a file written before these keys
    old = old[: old.index(", allreduce: ")] + "}" + old[old.index("  # seconds per stage") :]
    assert "allreduce" not in fxsplit.Plan.from_yaml(old).timing
    with pytest.raises(SpecError, match="timing"):
        fxsplit.Plan.from_yaml(plan.to_yaml().replace("nbytes: 1024000, seconds", "nbytes: many, seconds"))


def test_all_reduce_seconds_follow_the_ring_formula() -> None:
    link = Hardware().link("cpu:0", "cpu:1")
    assert allreduce_seconds(1e6, [link]) == 0.0
    three = allreduce_seconds(3e6, [link] * 3)
    assert three == pytest.approx(4 * (link.latency + 1e6 / link.bandwidth))
