"""In-process pipelining: outputs and gradients equal the unsplit model's on cpu:N devices."""

from __future__ import annotations

import copy
import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.utils import _pytree as pytree

import fxsplit
from fxsplit.api import trace_and_plan
from fxsplit.codegen.emitter import emit, move_weights
from fxsplit.pipeline.gpipe import clock_cycles, pipelined
from fxsplit.pipeline.microbatch import gather, scatter

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_models import MLP, LongSkip, Residual, Tied, TwoHeads, WithBatchNorm, budgets  # noqa: E402

ATOL = 1e-5  # float32; micro-batches only change the order of sums


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    if name == "Tied":
        return (torch.randint(0, 24, (8, 5), generator=gen),)
    if name == "TwoHeads":
        return (torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen))
    return (torch.randn(8, 16, generator=gen),)


def _loss(out: Any) -> torch.Tensor:
    leaves = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
    return sum((leaf.float().sin() * (i + 1)).sum() for i, leaf in enumerate(leaves))  # type: ignore[return-value]


def _assert_same(out: Any, expected: Any) -> None:
    leaves, spec = pytree.tree_flatten(out)
    want, want_spec = pytree.tree_flatten(expected)
    assert spec == want_spec
    for got, ref in zip(leaves, want, strict=True):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-5)


def _compare(make: Callable[[], torch.nn.Module], chunks: int, devices: int = 3, **options: Any) -> fxsplit.Pipeline:
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    inputs = _inputs(type(model).__name__)
    expected = reference(*inputs)
    _loss(expected).backward()
    pipe = fxsplit.fxsplit(
        model,
        budgets(model, devices),
        mode="weights",
        example_inputs=inputs,
        pipeline=fxsplit.PipelineConfig(chunks=chunks, **options.pop("config", {})),
        **options,
    )
    assert len(pipe.stages) == devices
    out = pipe(*inputs)
    _assert_same(out, expected)
    _loss(out).backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, grads[name].grad, atol=ATOL, rtol=1e-5, msg=name)
    return pipe


MODELS = [MLP, Residual, LongSkip, TwoHeads, Tied]


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
def test_outputs_and_gradients_equal_unsplit(make: Callable[[], torch.nn.Module], chunks: int) -> None:
    _compare(make, chunks)


@pytest.mark.parametrize("make", [MLP, LongSkip, TwoHeads], ids=lambda m: m.__name__)
def test_fx_trace_pipelines_too(make: Callable[[], torch.nn.Module]) -> None:
    _compare(make, 4, trace="fx")


@pytest.mark.parametrize("mode", [True, "except_last"])
def test_checkpointing_gives_the_same_gradients(mode: Any) -> None:
    pipe = _compare(LongSkip, 4, config={"checkpoint": mode})
    assert pipe.config.checkpoint == ("always" if mode is True else mode)


def test_skip_connection_goes_straight_to_its_reader() -> None:
    pipe = _compare(LongSkip, 2)
    first, middle, last = pipe.stage_specs
    skip = [name for name in last.inputs if name in first.outputs]
    assert skip and not set(skip) & set(middle.inputs)


def test_each_weight_lives_in_exactly_one_stage() -> None:
    pipe = _compare(Tied, 2)
    owners: dict[int, list[int]] = {}
    for index, stage in enumerate(pipe.stages):
        for tensor in {id(t): t for t in [*stage.parameters(), *stage.buffers()]}.values():
            owners.setdefault(id(tensor), []).append(index)
    assert all(len(stages) == 1 for stages in owners.values())
    model_params = {id(p) for p in pipe.parameters()}
    assert set(owners) == model_params
    # the tied weight is sent from its stage to the head's stage as a value
    assert any("embed" in name for spec in pipe.stage_specs[1:] for name in spec.inputs)


def test_outputs_land_on_output_device_and_plan_is_kept() -> None:
    torch.manual_seed(0)
    model = MLP()
    pipe = fxsplit.fxsplit(
        model,
        budgets(model, 2),
        mode="weights",
        example_inputs=_inputs("MLP"),
        output_device="cpu:0",
        pipeline={"chunks": 2},
    )
    plan = pipe.meta["fxsplit_plan"]
    assert isinstance(plan, fxsplit.Plan) and plan.output_device == "cpu:0"
    (x,) = _inputs("MLP")
    torch.testing.assert_close(pipe(x)[:4], pipe.split(x[:4]))  # export traced one micro-batch of 4 rows
    assert "# stage 0 on cpu:0" in pipe.code and "# stage 1 on cpu:1" in pipe.code
    assert pipe.stages[1].code in pipe.code


def test_batchnorm_warns_errors_or_is_allowed() -> None:
    model = WithBatchNorm()
    x = torch.randn(8, 16)
    for trace in ("fx", "export"):
        pipe = fxsplit.fxsplit(
            copy.deepcopy(model),
            budgets(model, 2),
            mode="weights",
            example_inputs=(x,),
            trace=trace,
            pipeline={"chunks": 2},
        )
        with pytest.warns(UserWarning, match="batch statistics"):
            pipe(x)
    strict = fxsplit.fxsplit(
        copy.deepcopy(model),
        budgets(model, 2),
        mode="weights",
        example_inputs=(x,),
        trace="fx",
        pipeline={"chunks": 2, "batch_stats": "error"},
    )
    with pytest.raises(fxsplit.FxsplitError, match=r"batch statistics.*batch_stats='allow'"):
        strict(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strict.eval()(x)  # running statistics: nothing differs
        allowed = fxsplit.fxsplit(
            copy.deepcopy(model),
            budgets(model, 2),
            mode="weights",
            example_inputs=(x,),
            trace="fx",
            pipeline={"chunks": 2, "batch_stats": "allow"},
        )
        allowed(x)


class _Counting(torch.nn.Module):
    """Updates a counter and a running mean of its own in place: once per micro-batch when pipelined."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = self.a(x)
        with torch.no_grad():
            self.mean.mul_(0.5).add_(h.mean(0), alpha=0.5)
        return self.b(h)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_state_updated_in_place_warns_errors_or_is_allowed(trace: str) -> None:
    """Found by an outside fuzz: a buffer the forward updates in place (not BatchNorm's) was updated once per
    micro-batch, each seeing its rows only, and nothing said so."""
    x = torch.randn(8, 8)

    def pipe(**config: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the plan's own warnings, if any
            return fxsplit.fxsplit(
                _Counting(), {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(x,), trace=trace, pipeline=config
            )

    warned = pipe(chunks=2)
    with pytest.warns(fxsplit.FxsplitWarning, match=r"updates 'calls', 'mean' in place; with 2 micro-batches"):
        warned(x)
    assert int(warned.split.get_buffer("calls")) == 2  # what the warning says: once per micro-batch
    with pytest.raises(fxsplit.FxsplitError, match=r"updates 'calls', 'mean' in place.*batch_stats='allow'"):
        pipe(chunks=2, batch_stats="error")(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(chunks=2, batch_stats="allow")(x)
        pipe(chunks=1)(x)  # one micro-batch: the unsplit model's update


class _Dropping(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # two draws: each micro-batch draws both in turn
        return self.b(
            self.drop(torch.relu(self.a(x))) + torch.nn.functional.dropout(x.repeat(1, 2), 0.5, self.training)
        )


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_dropout_in_training_warns_errors_or_is_allowed(trace: str) -> None:
    """Found by a fuzz of random programs: dropout drew its masks per micro-batch, in the schedule's order, so a
    pipelined training step differed from the unsplit model's with the same seed, and nothing said so."""
    x = torch.randn(8, 8)
    torch.manual_seed(0)
    model = _Dropping()
    reference = copy.deepcopy(model)

    def pipe(**config: Any) -> Any:
        return fxsplit.fxsplit(
            copy.deepcopy(model),
            {"cpu:0": "1MiB", "cpu:1": "1MiB"},
            example_inputs=(x,),
            trace=trace,
            mode="training",
            pins={"a": "cpu:0", "b": "cpu:1"},
            pipeline=config,
        )

    warned = pipe(chunks=2)
    torch.manual_seed(1)
    with pytest.warns(
        fxsplit.FxsplitWarning, match=r"ops '\w+'( \(in 'drop'\))?, '\w+' draw random numbers .*with 2 micro-batches"
    ):
        out = warned(x)
    torch.manual_seed(1)
    assert not torch.allclose(out, reference(x))  # what the warning says: other masks
    with pytest.raises(fxsplit.FxsplitError, match=r"draw random numbers.*batch_stats='allow'"):
        pipe(chunks=2, batch_stats="error")(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(chunks=2, batch_stats="allow")(x)
        torch.manual_seed(1)
        single = pipe(chunks=1)(x)  # one micro-batch: the unsplit model's draws
        torch.manual_seed(1)
        torch.testing.assert_close(single, reference(x))


def test_plan_that_sends_a_value_back_cannot_be_staged() -> None:
    model = MLP()
    x = _inputs("MLP")
    planned = trace_and_plan(model, budgets(model, 2), x, {"mode": "weights"})
    swap = {"cpu:0": "cpu:1", "cpu:1": "cpu:0"}
    plan = dataclasses.replace(
        planned.plan,
        placement={k: swap[v] for k, v in planned.plan.placement.items()},
        param_devices={k: swap[v] for k, v in planned.plan.param_devices.items()},
        output_device="cpu:0",
    )
    move_weights(planned.traced.graph_module, plan, planned.costs.weights)
    split = emit(planned.traced.graph_module, plan)
    torch.testing.assert_close(split(*x), model(*x))  # the plain split still runs
    with pytest.raises(fxsplit.FxsplitError) as error:
        pipelined(split, fxsplit.PipelineConfig(chunks=2))
    message = str(error.value)
    assert "comes from cpu:1 (stage 1)" in message and "on cpu:0 (stage 0)" in message
    assert "list cpu:1 before cpu:0 in the budgets" in message and "pins=" in message


def test_export_pipeline_refuses_other_micro_batch_sizes() -> None:
    model = MLP()
    pipe = fxsplit.fxsplit(
        model, budgets(model, 2), mode="weights", example_inputs=(torch.randn(8, 16),), pipeline={"chunks": 4}
    )
    assert pipe(torch.randn(8, 16)).shape == (8, 16)
    with pytest.raises(fxsplit.FxsplitError, match=r"micro-batches of 2 rows.*batches of 8 rows"):
        pipe(torch.randn(6, 16))
    fx = fxsplit.fxsplit(
        model,
        budgets(model, 2),
        mode="weights",
        example_inputs=(torch.randn(8, 16),),
        trace="fx",
        pipeline={"chunks": 4},
    )
    assert fx(torch.randn(6, 16)).shape == (6, 16)  # fx graphs take any size


def test_example_batch_must_split_evenly() -> None:
    with pytest.raises(fxsplit.SpecError, match="does not split evenly into 4 micro-batches"):
        fxsplit.fxsplit(
            MLP(), budgets(MLP(), 2), mode="weights", example_inputs=(torch.randn(6, 16),), pipeline={"chunks": 4}
        )


def test_config_is_validated() -> None:
    with pytest.raises(fxsplit.SpecError, match="chunks must be an int >= 1"):
        fxsplit.PipelineConfig(chunks=0)
    with pytest.raises(fxsplit.SpecError, match="checkpoint must be"):
        fxsplit.PipelineConfig(chunks=2, checkpoint="sometimes")
    with pytest.raises(fxsplit.SpecError, match="unknown pipeline option.*'chunk'"):
        fxsplit.PipelineConfig.coerce({"chunk": 2})
    assert fxsplit.PipelineConfig.coerce(3) == fxsplit.PipelineConfig(chunks=3)
    assert fxsplit.PipelineConfig(chunks=2, checkpoint=False).checkpoint == "never"


def test_clock_cycles_fill_and_drain() -> None:
    ticks = clock_cycles(4, 3)
    assert len(ticks) == 4 + 3 - 1
    assert sorted(pair for tick in ticks for pair in tick) == [(m, s) for m in range(4) for s in range(3)]
    for t, tick in enumerate(ticks):
        assert all(m == t - s for m, s in tick)


def test_scatter_splits_batched_tensors_and_broadcasts_the_rest() -> None:
    x, mask = torch.arange(10).reshape(5, 2), torch.ones(3)
    parts, rows = scatter([{"x": x, "n": 3}, mask, None], ["inputs", "mask", "extra"], 2, broadcast=("mask",))
    assert rows == [3, 2]
    assert torch.equal(torch.cat([p[0]["x"] for p in parts]), x)
    assert all(p[0]["n"] == 3 and p[1] is mask and p[2] is None for p in parts)
    with pytest.raises(fxsplit.FxsplitError, match=r"'mask' has 3 rows.*'inputs\['x'\]' has 5.*broadcast=\('mask',\)"):
        scatter([{"x": x}, mask], ["inputs", "mask"], 2)
    with pytest.raises(fxsplit.FxsplitError, match="batch of 5 rows .* cannot be split into 8 micro-batches"):
        scatter([x], ["x"], 8)
    with pytest.raises(fxsplit.FxsplitError, match="no tensor input has a batch dimension"):
        scatter([2.0], ["scale"], 2)


def test_gather_concatenates_and_averages_scalars_by_rows() -> None:
    outs = [
        {"y": torch.ones(2, 1), "loss": torch.tensor(1.0), "k": "a"},
        {"y": torch.zeros(1, 1), "loss": torch.tensor(4.0), "k": "a"},
    ]
    with pytest.warns(UserWarning, match="0-dim tensor"):
        merged = gather(outs, [2, 1])
    assert merged["y"].tolist() == [[1.0], [1.0], [0.0]] and merged["k"] == "a"
    assert merged["loss"].item() == pytest.approx(2.0)
    with pytest.raises(fxsplit.FxsplitError, match="different output structures"):
        gather([(torch.ones(1),), [torch.ones(1)]], [1, 1])


@pytest.mark.slow  # GPT-2: ~8 s
def test_hugging_face_model_output_comes_back_whole() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=4,
        n_head=2,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    pipe = fxsplit.fxsplit(
        model, budgets(model, 3, slack=1.3), mode="weights", example_inputs=(ids,), pipeline={"chunks": 2}
    )
    assert len(pipe.stages) == 3
    out, expected = pipe(ids), reference(ids)
    assert type(out) is type(expected) and list(out.keys()) == list(expected.keys())
    torch.testing.assert_close(out.logits, expected.logits, atol=ATOL, rtol=1e-5)
    out.logits.sin().sum().backward()
    expected.logits.sin().sum().backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, atol=1e-4, rtol=1e-4, msg=name)


def test_fx_without_example_inputs_and_uneven_micro_batches() -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    reference = copy.deepcopy(model)
    pipe = fxsplit.fxsplit(
        model, budgets(model, 3), mode="weights", pipeline=3
    )  # traced by fx, no shapes; 8 rows -> 3, 3, 2
    inputs = _inputs("TwoHeads")
    out, expected = pipe(*inputs), reference(*inputs)
    _assert_same(out, expected)
    _loss(out).backward()
    _loss(expected).backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, atol=ATOL, rtol=1e-5, msg=name)


def test_a_grad_mode_region_is_never_cut_by_the_pipelines_own_plan() -> None:
    """Found by an outside fuzz: the plan put the restore of a ``no_grad`` region first in the next stage. Stages of
    two micro-batches interleave, so the second micro-batch saved the mode the first had set: the call returned
    outputs that did not require grad and left grad mode off for the caller, and the stages' check (which looked
    at the mode before each op, not after) let it through. Now the planner keeps each region in one stage."""
    from fxsplit.tracing.gradmode import open_regions, region_spans

    torch.manual_seed(0)
    model, x = _Counting(), torch.randn(8, 8)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = fxsplit.fxsplit(
            model, {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(x,), trace="fx", pipeline={"chunks": 2}
        )
        out = pipe(x)
    assert torch.is_grad_enabled() and out.requires_grad
    torch.testing.assert_close(out, reference(x))
    out.sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    ops = [n for n in pipe.split.graph.nodes if n.op.startswith("call_")]
    spans = region_spans(ops)
    assert spans and all(depth == 0 for depth in open_regions(ops, after=True)[spans[-1][1] :])
    stage_of = {
        n.name: spec.index for spec, m in zip(pipe.stage_specs, pipe.stages, strict=True) for n in m.graph.nodes
    }
    for lo, hi in spans:
        assert len({stage_of[ops[i].name] for i in range(lo, hi + 1) if ops[i].name in stage_of}) == 1


class _Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + mask.sum(0)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_an_input_broadcast_to_every_micro_batch_is_traced_whole(trace: str) -> None:
    """``broadcast=("mask",)`` was honoured when running, not when tracing the first micro-batch: the trace split
    the mask too (or refused it, saying to broadcast 'example_inputs[1]')."""
    x, mask = torch.randn(4, 6, 8), torch.randn(5, 6, 8)
    model = _Masked()
    options: dict[str, Any] = {"example_inputs": (x, mask), "trace": trace}
    with pytest.raises(fxsplit.SpecError, match=r"'mask' has 5 rows .* 'x' has 4.*broadcast=\('mask',\)"):
        fxsplit.fxsplit(model, {"cpu:0": "1MiB"}, pipeline={"chunks": 2}, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = fxsplit.fxsplit(model, {"cpu:0": "1MiB"}, pipeline={"chunks": 2, "broadcast": ("mask",)}, **options)
        torch.testing.assert_close(pipe(x, mask), model(x, mask))
        square = torch.randn(4, 6, 8)  # as many rows as the batch: still whole, not split with it
        options["example_inputs"] = (x, square)
        pipe = fxsplit.fxsplit(model, {"cpu:0": "1MiB"}, pipeline={"chunks": 2, "broadcast": ("mask",)}, **options)
        torch.testing.assert_close(pipe(x, square), model(x, square))


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_saved_pipeline_plan_is_applied_as_a_pipeline(trace: str) -> None:
    """``fxsplit.apply(model, plan, pipeline=...)``: a plan saved to YAML runs as the pipeline it was made for,
    traced again on the first micro-batch (export fixes its sizes); apply took no ``pipeline`` before."""
    torch.manual_seed(0)
    model = Residual()
    (x,) = _inputs("Residual")
    options: dict[str, Any] = {"example_inputs": (x,), "trace": trace}
    made = fxsplit.fxsplit(model, budgets(model, 2), pipeline=2, **options)
    saved = made.meta["fxsplit_plan"].to_yaml()
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    fresh = Residual()
    pipe = fxsplit.apply(fresh, fxsplit.Plan.from_yaml(saved), example_inputs=(x,), pipeline=2)
    assert isinstance(pipe, fxsplit.Pipeline) and pipe.code == made.code
    torch.testing.assert_close(pipe(x), reference(x), atol=ATOL, rtol=1e-5)
    with pytest.warns(fxsplit.FxsplitWarning, match=r"made for a pipeline of 2 micro-batches.*this one runs 4"):
        fxsplit.apply(Residual(), fxsplit.Plan.from_yaml(saved), example_inputs=(x,), pipeline=4)
    processes = {"chunks": 2, "processes": True}
    with pytest.raises(fxsplit.SpecError, match=r"in this process.*pipeline_stages"):
        fxsplit.apply(Residual(), fxsplit.Plan.from_yaml(saved), example_inputs=(x,), pipeline=processes)
