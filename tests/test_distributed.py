"""Stages for torch.distributed.pipelining: relayed values, replicated tied weights, and 2 real gloo ranks."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.utils import _pytree as pytree

import fxsplit
from benchmarks.measure import torchrun_command

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import pipeline_worker  # noqa: E402
from pipeline_models import LongSkip, Tied, TwoHeads, budgets  # noqa: E402


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    if name == "Tied":
        return (torch.randint(0, 24, (4, 5), generator=gen),)
    if name == "TwoHeads":
        return (torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen))
    return (torch.randn(4, 16, generator=gen),)


def _loss(out: Any) -> torch.Tensor:
    return sum((leaf.sin() * (i + 1)).sum() for i, leaf in enumerate(pytree.tree_leaves(out)))  # type: ignore[return-value]


@pytest.mark.parametrize("trace", ["export", "fx"])
@pytest.mark.parametrize("make", [LongSkip, TwoHeads, Tied], ids=lambda m: m.__name__)
def test_stages_chained_by_hand_equal_the_model(make: Callable[[], torch.nn.Module], trace: str) -> None:
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    inputs = _inputs(type(model).__name__)
    room = budgets(model, 3, replicas=True)
    stages = fxsplit.pipeline_stages(model, room, mode="weights", example_inputs=inputs, trace=trace)
    assert len(stages) == 3
    out = stages[0](*inputs)  # stage 0 takes the model's inputs, the others the previous stage's tuple
    for module in stages.modules[1:]:
        assert isinstance(out, tuple) and all(isinstance(v, torch.Tensor) for v in out)
        out = module(*out)
    expected = reference(*inputs)
    assert pytree.tree_structure(out) == pytree.tree_structure(expected)  # the last stage returns the model's output
    for got, want in zip(pytree.tree_leaves(out), pytree.tree_leaves(expected), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _loss(out).backward()
    _loss(expected).backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, atol=1e-5, rtol=1e-5, msg=name)


def test_skip_connection_is_relayed_through_the_middle_stage() -> None:
    stages = fxsplit.pipeline_stages(
        LongSkip(), budgets(LongSkip(), 3), mode="weights", example_inputs=_inputs("LongSkip")
    )
    first, middle, last = stages.specs
    skip = [name for name in first.outputs if name in last.inputs]
    assert skip and set(skip) <= set(middle.inputs) and set(skip) <= set(middle.outputs)
    for module in stages.modules[1:]:  # what a stage receives is on its device already: no .to(device) of it
        received = {n for n in module.graph.nodes if n.op == "placeholder"}
        copies = [n for n in module.graph.nodes if n.op == "call_method" and n.target == "to"]
        assert not [n for n in copies if n.args[0] in received]
    assert any(n.op == "call_method" and n.target == "to" for n in stages.modules[0].graph.nodes)  # model inputs


def test_tied_weight_is_replicated_on_the_stages_that_read_it() -> None:
    model = Tied()
    stages = fxsplit.pipeline_stages(
        model, budgets(model, 3, replicas=True), mode="weights", example_inputs=_inputs("Tied")
    )
    assert stages.tied == {"embed.weight": (0, 2)}
    assert not any(t is model.embed.weight for t in stages[1].parameters())
    assert stages.plan.param_devices["embed.weight"] == "cpu:0"
    text = str(stages)  # what a stage holds, not the single-process plan's copy per forward
    assert (
        "tied: embed.weight = head.weight: replicated on stages 0 (cpu:0), 2 (cpu:2), gradients summed by "
        "reduce_tied_grads (no copy per forward; its " in text
    )
    assert "each forward" not in text and text.startswith("device  budget")
    for module in stages.modules:  # each stage reads its own copy: no .to(device) of a weight, a real copy on cpu:N
        weights = {n for n in module.graph.nodes if n.op == "get_attr"}
        copies = [n for n in module.graph.nodes if n.op == "call_method" and n.target == "to"]
        assert not [n for n in copies if n.args[0] in weights]
    assert any(n.op == "get_attr" and n.target == "head.weight" for n in stages[2].graph.nodes)


def test_a_given_plan_and_a_plan_that_cannot_be_staged() -> None:
    model = LongSkip()
    x = _inputs("LongSkip")
    plan = fxsplit.plan(model, budgets(model, 2), mode="weights", example_inputs=x, pipeline={"chunks": 2})
    stages = fxsplit.pipeline_stages(model, plan, example_inputs=x, chunks=2)
    assert [s.device for s in stages.specs] == ["cpu:0", "cpu:1"] and stages.plan is plan
    swap = {"cpu:0": "cpu:1", "cpu:1": "cpu:0"}
    backwards = dataclasses.replace(
        plan,
        placement={k: swap[v] for k, v in plan.placement.items()},
        param_devices={k: swap[v] for k, v in plan.param_devices.items()},
        cuts=tuple(dataclasses.replace(c, source=swap[c.source], destination=swap[c.destination]) for c in plan.cuts),
        output_device=swap[plan.output_device],
    )
    with pytest.raises(fxsplit.FxsplitError, match="cannot run as a pipeline.*list cpu:1 before cpu:0"):
        fxsplit.pipeline_stages(model, backwards, example_inputs=x, chunks=2)
    with pytest.raises(fxsplit.PlanMismatchError, match="made for another model"):
        fxsplit.pipeline_stages(Tied(), plan, example_inputs=_inputs("Tied"), chunks=2)


@pytest.mark.parametrize("leaf", [torch.nn.Sequential, "middle"], ids=["type", "name"])
def test_a_plan_made_with_leaf_modules_stages_like_apply(leaf: Any) -> None:
    """pipeline_stages re-traces a saved plan the way apply does (it once dropped the plan's leaf_modules)."""
    model = LongSkip()
    x = _inputs("LongSkip")
    plan = fxsplit.plan(
        model,
        {"cpu:0": 3000, "cpu:1": 6000},
        mode="weights",
        example_inputs=x,
        trace="fx",
        leaf_modules=[leaf],
        pipeline={"chunks": 2},
    )
    assert any(n.startswith("middle") for n in plan.placement) and "middle_0" not in plan.placement
    loaded = fxsplit.Plan.from_yaml(plan.to_yaml())
    stages = fxsplit.pipeline_stages(model, loaded, example_inputs=x, chunks=2)
    out = stages[0](*x)
    for module in stages.modules[1:]:
        out = module(*out)
    torch.testing.assert_close(out, model(*x))
    applied = fxsplit.apply(copy.deepcopy(model), loaded, example_inputs=x)
    torch.testing.assert_close(applied(*x), model(*x))


class Block(torch.nn.Module):
    """A user's block that fx could trace into: as a leaf, the plan names one node for it, 'block'."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(width, width)
        self.outer = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x)))


class WithBlock(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.first = torch.nn.Linear(width, width)
        self.block = Block(width)
        self.last = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.block(torch.relu(self.first(x)))))


def test_a_plan_with_a_leaf_module_class_applies_and_stages_equal_the_model() -> None:
    """Regression: pipeline_stages re-traced a plan without its leaf_modules, so a plan made with
    leaf_modules=[SomeBlock] raised PlanMismatchError ('nodes in the plan but not the graph') there,
    while fxsplit.apply took it."""
    torch.manual_seed(0)
    model = WithBlock()
    x = (torch.randn(4, 16),)
    expected = model(*x)
    linear = (16 * 16 + 16) * 4
    plan = fxsplit.plan(
        model,
        {"cpu:0": 3 * linear + 100, "cpu:1": 3 * linear + 100},  # the model is 4 Linears: two stages
        mode="weights",
        example_inputs=x,
        trace="fx",
        leaf_modules=[Block],
        contiguous=True,  # stages: values flow to later devices only
    )
    assert plan.leaf_modules == (f"{Block.__module__}.Block",)  # the class, by its qualified name
    assert "block" in plan.placement and not any(name.startswith("block_") for name in plan.placement)
    assert set(plan.placement.values()) == {"cpu:0", "cpu:1"}  # a real split, so there are stages to chain
    loaded = fxsplit.Plan.from_yaml(plan.to_yaml())  # a saved plan knows the class by name only

    applied = fxsplit.apply(copy.deepcopy(model), loaded, example_inputs=x)
    assert any(n.op == "call_module" and n.target == "block" for n in applied.graph.nodes)
    torch.testing.assert_close(applied(*x), expected)

    stages = fxsplit.pipeline_stages(model, loaded, example_inputs=x)
    assert len(stages) == 2
    out = stages[0](*x)
    for module in stages.modules[1:]:
        out = module(*out)
    torch.testing.assert_close(out, expected)
    held = [{name for name, _ in module.named_modules()} for module in stages.modules]
    assert sum("block" in names for names in held) == 1  # the block is one module, on one stage


class _SizeAcross(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.a(x).size(0)
        return self.b(x).reshape(rows, 4, 4)


def test_non_tensor_crossing_processes_is_refused() -> None:
    model = _SizeAcross()
    with pytest.raises(fxsplit.FxsplitError, match="exchange tensors only"):
        fxsplit.pipeline_stages(
            model,
            budgets(model, 2),
            mode="weights",
            example_inputs=(torch.randn(4, 16),),
            trace="fx",
            pins={"a": "cpu:0", "b": "cpu:1"},
        )


def _single_process(name: str) -> tuple[list[float], torch.nn.Module]:
    model = pipeline_worker.make(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=pipeline_worker.LR)
    losses = []
    for x, y in pipeline_worker.batches(name):
        optimizer.zero_grad()
        loss = pipeline_worker.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.slow  # two gloo processes: ~13 s
def test_two_gloo_ranks_train_like_one_process(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    command = torchrun_command(HERE / "pipeline_worker.py", str(tmp_path))
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, kind in pipeline_worker.CASES:
        case = f"{name}-{kind}"
        losses, model = _single_process(name)
        assert all(r[case]["stages"] == 2 for r in ranks)
        assert ranks[1][case]["losses"] == pytest.approx(losses, abs=1e-5), case
        seen = set()
        for rank in ranks:
            for path, value in rank[case]["params"].items():
                if path in rank[case]["rows"]:  # rows of the head's weight, a parameter of their own on this rank
                    start, stop = rank[case]["rows"][path]
                    expected = model.get_parameter("head.weight").detach()[start:stop]
                else:
                    expected = model.get_parameter(path).detach()
                    seen.add(id(model.get_parameter(path)))
                torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-5, msg=f"{case}: {path}")
        assert seen == {id(p) for p in model.parameters()}, case  # every weight was trained somewhere
    assert ranks[0]["Tied-gpipe"]["tied"] == {"embed.weight": (0, 1)}
    wide = [rank["TiedWide-1f1b"] for rank in ranks]  # the head's rows split over the ranks, summed with the embedding
    assert wide[0]["splits"] == {"linear_2": (0, 2368, 4096)} and wide[0]["tied"] == {"embed.weight": (0, 1)}
    assert [sorted(r["rows"].values()) for r in wide] == [[(0, 2368)], [(2368, 4096)]]
    _check_measured_memory([rank["memory"] for rank in ranks])


def _check_measured_memory(measured: list[dict[str, Any]]) -> None:
    """Each rank of an Adam step under 1F1B (pipeline_worker.memory) holds what its plan's memory row says.

    Its own tensors (parameters, its copy of the tied weight, Adam's state) are the row's weights, stage copies
    and optimizer state. With the step's peak (gradients, activations, the outputs the last rank keeps and
    returns), and with the peak of ``optimizer.step()`` (its temporaries beside the gradients and the outputs
    still held), they come within the row's total, and the larger within 20% of it: the row assumes a
    fill-drain schedule, whose later micro-batches add each weight's gradient to its ``.grad`` while the
    saved tensors of those after them are held (the embedding's 512 KB gradient with two micro-batches' on the
    first rank), and 1F1B holds fewer. Allowed beyond the row: the loss and Adam's step counts (scalars,
    outside the model).
    """
    scalars = 64
    for rank in measured:
        row = rank["row"]
        persistent = row["params"] + row["buffers"] + row["optimizer"] + row["stage_copies"] - row["stage_copies"] // 4
        assert persistent <= rank["own"] <= persistent + scalars, rank
        held = [rank["own"] + rank["step"], rank["own"] + rank["update"]]
        assert max(held) <= row["total"] + scalars and max(held) >= 0.8 * row["total"], rank
    last = measured[-1]["row"]
    assert last["stage_copies"] == 4 * 2000 * 64 * 4  # the tied weight, its gradient and Adam's two moments


def test_stages_refuse_a_tied_weight_copy_the_budgets_cannot_hold() -> None:
    """Each rank holds its own copy of a tied weight, which the plan counts once: over budget is an error."""
    model, x = Tied(), _inputs("Tied")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    tight = budgets(model, 3)  # room for the model once: the head's stage cannot also hold the 1.5 KiB embedding
    with pytest.raises(fxsplit.BudgetError) as caught:
        fxsplit.pipeline_stages(model, tight, mode="weights", example_inputs=x)
    message = str(caught.value)
    assert "own copy" in message and "cpu:2: embed.weight (1.50 KiB)" in message and "'cpu:2' holds" in message
    assert "over by" in message
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())  # the model is untouched
    stages = fxsplit.pipeline_stages(model, budgets(model, 3, replicas=True), mode="weights", example_inputs=x)
    assert stages.tied == {"embed.weight": (0, 2)}


def test_replicas_in_training_bring_their_gradients_and_optimizer_state() -> None:
    from fxsplit.pipeline.replicabudget import replica_bytes, replica_overruns

    model, x = Tied(), _inputs("Tied")
    room, pins = {f"cpu:{i}": "1MiB" for i in range(3)}, {"embed": "cpu:0", "body": "cpu:1", "head": "cpu:2"}
    plan = fxsplit.plan(model, room, mode="training", optimizer="adam", example_inputs=x, pipeline=1, pins=pins)
    stages = fxsplit.pipeline_stages(model, plan, example_inputs=x)
    devices = [spec.device for spec in stages.specs]
    assert replica_bytes(plan, model, stages.modules, devices) == {"cpu:2": {"embed.weight": 1536}}
    squeezed = dataclasses.replace(
        plan, budgets={**plan.budgets, "cpu:2": plan.memory["cpu:2"]["total"] + 4 * 1536 - 1}
    )
    overruns, _, charged = replica_overruns(squeezed, model, stages.modules, devices)
    assert [o.device for o in overruns] == ["cpu:2"]  # the weight, its gradient and Adam's two moments: 4 x 1536
    assert overruns[0].weights == plan.device_bytes["cpu:2"] + 4 * 1536 and charged == {"cpu:2": 4 * 1536}


def test_a_frozen_tied_weight_brings_no_gradient_nor_optimizer_state() -> None:
    """Fine-tuning with the embedding frozen: each stage's copy of it is its bytes alone, not the bytes at the
    rate the trainable parameters bring (which would put the head's stage over a budget it fits)."""
    from fxsplit.pipeline.replicabudget import replica_overruns

    model, x = Tied(), _inputs("Tied")
    model.embed.weight.requires_grad_(False)
    room, pins = {f"cpu:{i}": "1MiB" for i in range(3)}, {"embed": "cpu:0", "body": "cpu:1", "head": "cpu:2"}
    plan = fxsplit.plan(model, room, mode="training", optimizer="adam", example_inputs=x, pipeline=1, pins=pins)
    assert plan.memory["cpu:1"]["optimizer"] > 0  # the body trains
    stages = fxsplit.pipeline_stages(model, plan, example_inputs=x)
    devices = [spec.device for spec in stages.specs]
    exact = dataclasses.replace(plan, budgets={**plan.budgets, "cpu:2": plan.memory["cpu:2"]["total"] + 1536})
    overruns, _, charged = replica_overruns(exact, model, stages.modules, devices)
    assert overruns == [] and charged == {"cpu:2": 1536}


class _DeepTied(torch.nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layers = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())]
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def test_stages_are_planned_with_room_for_a_tied_weight_copy() -> None:
    """A plan for one process balances the body over both stages; the head's stage then has no room for its copy
    of the 8 KiB tied embedding. pipeline_stages plans with each stage's copies charged (once: no warning, no
    room held back), so the head's stage takes fewer layers."""
    torch.manual_seed(0)
    model, x = _DeepTied(), (torch.randint(0, 64, (4, 8)),)
    embed, layer = 64 * 32 * 4, (32 * 32 + 32) * 4
    room = {"cpu:0": embed + 6 * layer, "cpu:1": embed + 1 * layer + 1000}
    first = fxsplit.plan(model, room, mode="weights", example_inputs=x, pipeline=2)
    assert first.device_bytes["cpu:1"] + embed > room["cpu:1"]  # the plan alone leaves no room for the copy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stages = fxsplit.pipeline_stages(model, room, mode="weights", example_inputs=x, chunks=2)
    plan = stages.plan
    assert not any(plan.reserved.values()) and plan.device_bytes["cpu:1"] + embed <= room["cpu:1"]
    assert stages.tied == {"embed.weight": (0, 1)}
    micro = (x[0][:2],)  # the stages run one micro-batch of the two
    torch.testing.assert_close(stages[1](*_as_tuple(stages[0](*micro))), model(*micro))
    again = fxsplit.pipeline_stages(model, fxsplit.Plan.from_yaml(plan.to_yaml()), example_inputs=x, chunks=2)
    assert again.plan == plan  # a saved plan of the stages is accepted as it is: its reserve holds the copy
    with pytest.raises(fxsplit.BudgetError, match="own copy"):  # the first plan, given as is, is refused
        fxsplit.pipeline_stages(model, first, example_inputs=x, chunks=2)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def test_stages_of_a_model_that_draws_random_numbers_say_so() -> None:
    """Each rank runs its micro-batches one by one, so dropout draws per micro-batch, as in fxsplit's own pipeline."""
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 32), torch.nn.Dropout(0.1)
    )
    x = (torch.randn(4, 16),)
    room = {"cpu:0": "1MiB", "cpu:1": "1MiB"}
    pins = {"0": "cpu:0", "2": "cpu:1"}
    with pytest.warns(
        fxsplit.FxsplitWarning,
        match=r"ops '_1' \(in '1'\), '_3' \(in '3'\) draw random numbers .*filter this FxsplitWarning",
    ):
        fxsplit.pipeline_stages(model, room, mode="training", example_inputs=x, chunks=2, pins=pins, trace="fx")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxsplit.pipeline_stages(model.eval(), room, mode="weights", example_inputs=x, chunks=2, pins=pins)
        fxsplit.pipeline_stages(model.train(), room, mode="training", example_inputs=x, chunks=1, pins=pins)
