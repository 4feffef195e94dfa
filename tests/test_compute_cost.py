"""The compute cost model (fxsplit.cost.compute), device speeds (fxsplit.hardware) and plans made for time."""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest
import torch

import fxsplit
from fxsplit.api import trace_and_plan
from fxsplit.cost.compute import op_seconds, op_work
from fxsplit.errors import SpecError
from fxsplit.hardware import DEFAULT_SPEEDS, Hardware, parse_flops, parse_rate, parse_seconds
from fxsplit.planning.plan import Plan

CPU = DEFAULT_SPEEDS["cpu"]


def _mlp(blocks: int = 8, width: int = 256) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


class ConvHeavy(torch.nn.Module):
    """Few weights, most of the compute."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).relu()


class EmbeddingHeavy(torch.nn.Module):
    """Most of the weights, little compute."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(60_000, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).sum(dim=1)


def _work(model: torch.nn.Module, inputs: tuple, trace: str) -> tuple[float, float]:
    planned = trace_and_plan(model, {"cpu:0": "1GiB"}, inputs, {"trace": trace, "mode": "weights"})
    work = op_work(planned.traced.graph_module, planned.costs.ops)
    seconds = op_seconds(work, DEFAULT_SPEEDS["cpu"])
    return float(work.flops.sum()), float(seconds.sum())


def _measured(model: torch.nn.Module, inputs: tuple, repeats: int = 7) -> float:
    with torch.no_grad():
        model(*inputs)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(*inputs)
            times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_linear_and_conv_flops_are_their_formulas(trace: str) -> None:
    flops, _ = _work(torch.nn.Linear(64, 32), (torch.randn(8, 64),), trace)
    assert flops == 2 * 8 * 64 * 32
    conv, _ = _work(ConvHeavy(), (torch.randn(2, 32, 16, 16),), trace)
    assert conv >= 2 * (2 * 32 * 16 * 16) * (32 * 3 * 3)  # the convolution; plus bias and relu elementwise
    assert conv < 1.1 * 2 * (2 * 32 * 16 * 16) * (32 * 3 * 3)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_estimate_ranks_compute_against_weights_like_the_real_run(trace: str) -> None:
    conv, ids = (torch.randn(4, 32, 32, 32),), (torch.randint(0, 60_000, (4, 16)),)
    conv_bytes = sum(p.numel() * 4 for p in ConvHeavy().parameters())
    embed_bytes = sum(p.numel() * 4 for p in EmbeddingHeavy().parameters())
    assert conv_bytes * 100 < embed_bytes  # by weights the embedding is the big one...
    _, conv_estimate = _work(ConvHeavy(), conv, trace)
    _, embed_estimate = _work(EmbeddingHeavy(), ids, trace)
    assert conv_estimate > 10 * embed_estimate  # ...by time the convolution
    torch.manual_seed(0)
    assert _measured(ConvHeavy(), conv) > 3 * _measured(EmbeddingHeavy(), ids)  # and so it runs


def test_meta_models_are_estimated_from_shapes() -> None:
    with torch.device("meta"):
        model = _mlp(4, 1024)
    plan = fxsplit.plan(
        model,
        {"cuda:0": "10MiB", "cuda:1": "10MiB"},
        example_inputs=(torch.randn(32, 1024, device="meta"),),
        objective="throughput",
        trace="fx",
    )
    compute = {d: row["compute"] for d, row in plan.timing["stages"].items()}
    assert compute["cuda:0"] == pytest.approx(compute["cuda:1"], rel=0.05)  # two blocks each
    per_linear = 2 * 32 * 1024 * 1024 / DEFAULT_SPEEDS["cuda"].flops
    assert compute["cuda:0"] > 2 * per_linear


def test_pipeline_of_the_eight_block_mlp_spreads_over_four_devices_by_default() -> None:
    model, x = _mlp(), torch.randn(64, 256)
    budgets = {f"cpu:{k}": "8MiB" for k in range(4)}
    pipelined = fxsplit.plan(model, budgets, example_inputs=(x,), pipeline=fxsplit.PipelineConfig(chunks=4))
    assert pipelined.objective == "throughput"
    assert [pipelined.modules[d] for d in pipelined.devices] == [
        tuple(str(i) for i in range(4 * k, 4 * k + 4)) for k in range(4)
    ]
    totals = [row["compute"] + row["copies"] for row in pipelined.timing["stages"].values()]
    assert max(totals) / (sum(totals) / 4) < 1.05
    text = str(pipelined)
    assert "bottleneck: cpu:" in text and "4 micro-batches: step ≈" in text and "bubble 44%" in text
    plain = fxsplit.plan(model, budgets, example_inputs=(x,))  # no pipeline: fewest bytes, one device
    assert set(plain.placement.values()) == {"cpu:0"} and not plain.timing
    split = fxsplit.fxsplit(model, budgets, example_inputs=(x,), pipeline=4)
    torch.testing.assert_close(split(x), model(x))


def test_a_faster_device_gets_more_of_the_pipeline() -> None:
    model, x = _mlp(), torch.randn(64, 256)
    budgets = {"cpu:0": "8MiB", "cpu:1": "8MiB"}
    hardware = {"devices": {"cpu:1": {"flops": "150G"}}}  # three times the default CPU's 50 GFLOP/s
    plan = fxsplit.plan(model, budgets, example_inputs=(x,), pipeline=2, hardware=hardware)
    linears = {d: sum(1 for m in plan.modules[d] if int(m) % 2 == 0) for d in plan.devices}
    assert linears["cpu:1"] > linears["cpu:0"]


def test_timing_survives_yaml_and_prints_for_training() -> None:
    model, x = _mlp(4, 64), torch.randn(16, 64)
    plan = fxsplit.plan(model, {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(x,), pipeline=2, mode="training")
    assert plan.timing["training"] is True and plan.timing["chunks"] == 2
    assert Plan.from_yaml(plan.to_yaml()) == plan
    assert "per micro-batch training step (forward + backward)" in str(plan)


def test_latency_objective_records_one_forward() -> None:
    plan = fxsplit.plan(
        _mlp(4, 64), {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(torch.randn(16, 64),), objective="latency"
    )
    assert plan.objective == "latency" and plan.timing["chunks"] is None
    assert "stages one after another" in str(plan)


def test_hardware_values_parse_and_bad_ones_say_how() -> None:
    assert parse_flops("312 TFLOP/s") == 312e12 and parse_flops(1e9) == 1e9
    assert parse_rate("25GiB/s") == 25 * 2**30 and parse_seconds("2ms") == 0.002
    hw = Hardware.coerce({"links": {("cuda", "cuda"): {"bandwidth": "300GB/s"}}})
    assert hw.link("cuda:0", "cuda:7").bandwidth == 300e9 and hw.link("cpu:0", "cuda:0").bandwidth == 25e9
    with pytest.raises(SpecError, match="unknown hardware key"):
        Hardware.coerce({"speeds": {}})
    with pytest.raises(SpecError, match="must be positive"):
        Hardware.coerce({"devices": {"cuda": {"flops": 0}}})
    with pytest.raises(SpecError, match="like 'cuda:0 <-> cuda:1'"):
        Hardware.coerce({"links": {"cuda:0": {"bandwidth": 1}}})
    with pytest.raises(SpecError, match="flops must be .* \\(got 'fast'\\); hardware link 'cuda:0' must name"):
        Hardware.coerce({"devices": {"cuda": {"flops": "fast"}}, "links": {"cuda:0": {"bandwidth": 1}}})  # both
    with pytest.raises(SpecError, match="rate like '25GB/s'"):
        Hardware.coerce({"links": {"a <-> b": {"bandwidth": "25GB"}}})
    with pytest.raises(SpecError, match="unknown option 'hardwares'"):
        fxsplit.plan(torch.nn.Linear(2, 2), {"cpu:0": "1KiB"}, hardwares={})


def test_efficiency_and_norm_passes_are_per_device_kind() -> None:
    hw = Hardware.coerce({"devices": {"cpu:1": {"half_reduction": 0, "flops": "80G"}, "cuda": {"norm_passes": 9}}})
    mine, other = hw.speed("cpu:1"), hw.speed("cpu:0")
    assert (mine.half_reduction, mine.half_map, mine.flops) == (0.0, CPU.half_map, 80e9)  # the rest from cpu's
    assert other == CPU and hw.speed("cuda:0").norm_passes == 9.0 and hw.speed("cuda:0").half_map == 0.0
    assert Hardware.coerce(hw.to_dict()) == hw
    with pytest.raises(SpecError, match="half_map must be a number >= 0"):
        Hardware.coerce({"devices": {"cpu": {"half_map": "2"}}})


def test_profile_plans_with_measured_times_and_refuses_meta() -> None:
    model, x = _mlp(4, 256), torch.randn(64, 256)
    threads = torch.get_num_threads()
    plan = fxsplit.plan(model, {"cpu:0": "8MiB", "cpu:1": "8MiB"}, example_inputs=(x,), pipeline=2, profile=True)
    assert torch.get_num_threads() == threads  # profiled on one thread, then put back
    assert plan.timing["source"] == "profile" and "measured per op (profile=True)" in str(plan)
    stages = [row["compute"] for row in plan.timing["stages"].values()]
    # measured; whether to spread depends on this machine's copy speed (tests/test_linkprofile.py), how
    # evenly is for benchmarks/STAGE_RESULTS.md
    assert len(stages) == 2 and all(s >= 0 for s in stages) and sum(stages) > 0
    with torch.device("meta"):
        on_meta = _mlp(2, 64)
    with pytest.raises(SpecError, match="profile=True runs the model: .* is on the meta device"):
        fxsplit.plan(on_meta, {"cpu:0": "1MiB"}, example_inputs=(torch.randn(2, 64, device="meta"),), profile=True)


def test_profile_in_training_times_the_backward_too() -> None:
    model, x = _mlp(4, 256), torch.randn(64, 256)
    budgets = {"cpu:0": "16MiB", "cpu:1": "16MiB"}
    forward = fxsplit.plan(model, budgets, example_inputs=(x,), pipeline=2, profile=True, mode="weights")
    training = fxsplit.plan(model, budgets, example_inputs=(x,), pipeline=2, profile=True, mode="training")
    assert training.timing["training"] and not forward.timing["training"]
    forward_s, training_s = (sum(r["compute"] for r in p.timing["stages"].values()) for p in (forward, training))
    assert training_s > 1.5 * forward_s  # a backward costs about twice a forward here
    assert all(p.grad is None for p in model.parameters())  # the model's own tensors took no gradient


def test_profiled_pipeline_stages_across_ranks_must_share_one_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.raises(SpecError, match="plan on one rank .* pass it to pipeline_stages on every rank"):
        fxsplit.pipeline_stages(
            _mlp(2, 16),
            {"cpu:0": "1MiB", "cpu:1": "1MiB"},
            example_inputs=(torch.randn(4, 16),),
            chunks=2,
            profile=True,
        )


def _training(model: torch.nn.Module, inputs: tuple, trace: str = "fx") -> tuple[list[str], object, object]:
    planned = trace_and_plan(model, {"cpu:0": "1GiB"}, inputs, {"trace": trace, "mode": "weights"})
    ops = planned.costs.ops
    work = op_work(planned.traced.graph_module, ops)
    return [op.name for op in ops], work, op_seconds(work, DEFAULT_SPEEDS["cpu"], training=True)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_first_product_computes_only_its_weight_gradient(trace: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False))
    names, work, seconds = _training(model, (torch.randn(64, 256),), trace)
    first, second = [i for i in range(len(names)) if work.products[i]]
    assert work.flops[first] == work.flops[second]  # the same forward...
    assert work.train_flops[second] == 2 * work.flops[second]  # ...the second: its input's and its weight's gradients
    assert work.train_flops[first] == work.flops[first]  # the model's input takes no gradient: the weight's only
    assert seconds[first] < seconds[second]


def test_ops_before_any_weight_have_no_backward() -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x * 2).relu()

    names, work, _ = _training(Scaled(), (torch.randn(8, 64),))
    scale, relu = names.index("mul"), names.index("relu")
    assert work.train_flops[scale] == 0 and work.train_nbytes[scale] == 0  # autograd never reaches it
    assert work.train_flops[relu] > 0


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_embedding_backward_writes_the_whole_table(trace: str) -> None:
    table = 60_000 * 64 * 4
    few, many = (torch.randint(0, 60_000, (2, 4)),), (torch.randint(0, 60_000, (8, 64)),)
    _, work_few, _ = _training(EmbeddingHeavy(), few, trace)
    _, work_many, _ = _training(EmbeddingHeavy(), many, trace)
    lookup = int(work_few.nbytes.argmax())
    assert work_few.nbytes[lookup] < table / 100  # the forward reads only the rows it returns...
    assert work_few.grad_nbytes[lookup] >= 3 * table  # ...the gradient is the dense table, added to .grad
    assert work_many.grad_nbytes[lookup] == work_few.grad_nbytes[lookup]  # however many rows were read


def test_batch_norm_is_elementwise_and_heavier_in_training() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU())
    x = torch.randn(4, 64, 16, 16)
    names, work, seconds = _training(model, (x,))
    norm, relu = names.index("_1"), names.index("_2")
    assert not work.products[norm] and work.flops[norm] == x.numel()  # not 2 FLOPs per weight per row
    assert work.norm_nbytes[norm] == 4 * x.numel() and not work.norm_nbytes[relu]  # its passes: the device's
    assert seconds[relu] < seconds[norm] < seconds[names.index("_0")]
    gpu, cpu = DEFAULT_SPEEDS["cuda"], DEFAULT_SPEEDS["cpu"]
    assert gpu.norm_passes == 7 < cpu.norm_passes  # by memory traffic; on one CPU core as measured
    fast = dataclasses.replace(cpu, norm_passes=gpu.norm_passes)
    assert op_seconds(work, fast, training=True)[norm] < seconds[norm]


def test_products_with_a_small_dimension_run_below_peak() -> None:
    def efficiency(size: int, kernel: int = 3, channels: int = 64) -> float:
        model = torch.nn.Conv2d(channels, 64, kernel, padding=kernel // 2)
        _, work, _ = _training(model, (torch.randn(2, channels, size, size),))
        return float(work.rate(CPU)[0]) / CPU.flops

    assert efficiency(3) < efficiency(6) < efficiency(24)  # small maps
    assert efficiency(24) / efficiency(48) > 0.99  # large ones alike
    assert efficiency(24, kernel=1) < 0.7 * efficiency(24)  # 64 multiply-adds per output against 576
    assert efficiency(24, kernel=1, channels=1024) > 0.95
    _, work, _ = _training(torch.nn.Linear(16, 64), (torch.randn(32, 16),))
    _, wide, _ = _training(torch.nn.Linear(2048, 64), (torch.randn(32, 2048),))
    assert work.rate(CPU)[0] < 0.5 * CPU.flops < 0.95 * CPU.flops < wide.rate(CPU)[0]
    assert (work.rate(DEFAULT_SPEEDS["cuda"]) == DEFAULT_SPEEDS["cuda"].flops).all()  # measured on CPU only


def test_a_convolution_over_few_channels_runs_below_peak() -> None:
    """ResNet-50's first convolution, over an image's 3 channels, ran at about 0.27x the rate of the others."""

    def rate(channels: int, kernel: int, speed=CPU) -> float:  # type: ignore[no-untyped-def]
        model = torch.nn.Conv2d(channels, 64, kernel, padding=kernel // 2)
        _, work, _ = _training(model, (torch.randn(2, channels, 24, 24),))
        assert work.channels is not None and work.channels[0] == channels
        return float(work.rate(speed)[0])

    k = 147  # the stem's reduction: 3 channels by 7x7, against 64 channels by a 1x1 kernel plus 83
    stem, wide = rate(3, 7), rate(147, 1)
    assert stem / wide == pytest.approx((3 / (3 + CPU.half_channels)) / (k / (k + CPU.half_channels)))
    assert stem < 0.3 * wide
    plain = Hardware.coerce({"devices": {"cpu": {"half_channels": 0}}}).speed("cpu:0")
    assert rate(3, 7, plain) == pytest.approx(rate(147, 1, plain))  # the reduction alone: alike


def test_hardware_for_a_device_no_budget_names_is_a_warning() -> None:
    """A typo in a device name under hardware would leave its speeds unused without a word: warned, by name."""
    model, x = _mlp(2, 64), torch.randn(8, 64)
    hardware = {"devices": {"cpu:7": {"flops": "1 TFLOP/s"}, "cpu": {"flops": "1 TFLOP/s"}}}
    with pytest.warns(fxsplit.FxsplitWarning, match=r"hardware names 'cpu:7', which no budget names"):
        fxsplit.plan(model, {"cpu:0": "1MiB", "cpu:1": "1MiB"}, example_inputs=(x,), pipeline=2, hardware=hardware)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kind ('cpu') or a budgeted device is used: nothing to say
        fxsplit.plan(
            model,
            {"cpu:0": "1MiB", "cpu:1": "1MiB"},
            example_inputs=(x,),
            pipeline=2,
            hardware={"devices": {"cpu": {"flops": "1 TFLOP/s"}, "cpu:1": {"flops": "2 TFLOP/s"}}},
        )


class _Routed(torch.nn.Module):
    """Rows picked by their values (as a router picks an expert's tokens): a size no example input gives."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        picked = h[h[:, 0] > 0]
        return self.c(h) + self.b(picked).sum(0)


@pytest.mark.parametrize("profile", [False, True])
def test_ops_of_data_dependent_sizes_are_said_not_estimated_and_the_plan_runs(profile: bool) -> None:
    """torch.export gives such an op an unbacked size: its time once failed deep in torch
    (``GuardOnDataDependentSymNode`` from the FLOP formula), so no time-balanced plan (a pipeline of Hugging Face's
    JetMoE) could be made. Now it counts no work, with a warning naming it, unless ``profile=True`` measures it."""
    model, x = _Routed().eval(), torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    budgets = {"cpu:0": "2200B", "cpu:1": "2200B"}  # room for two of the three Linears
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = fxsplit.fxsplit(model, budgets, example_inputs=(x,), objective="latency", mode="weights", profile=profile)
    said = [str(w.message) for w in caught if "is not estimated" in str(w.message)]
    if profile:
        assert not said
    else:
        assert len(said) == 1 and "'linear_2'" in said[0] and "profile=True" in said[0], said
    assert torch.equal(gm(x), model(x))
    assert all(gm.meta["fxsplit_plan"].modules[d] for d in budgets)
