"""In-place updates that do not glue (issue 11): the ops that write a tensor share its device, nothing else.

A tensor written in place lives where its writers run; ops between the writes go
anywhere, and a reader on another device gets a copy made after the latest write.
Each model here writes a tensor after blocks that do not fit one device together, so
the old rule (every op from the first to the last write on one device) could not
place them at all; each is compared with its unsplit copy under a DeviceChecker, over
several calls where state persists.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import split_and_compare

import fxsplit
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.result import placement_problems
from fxsplit.partition.solve import partition

TRACES = ("fx", "export")
WIDTH = 64
BLOCK = (WIDTH * WIDTH + WIDTH) * 4  # bytes of one Linear(WIDTH, WIDTH)
BUDGETS = {"cpu:0": int(2.5 * BLOCK), "cpu:1": int(2.5 * BLOCK)}  # two blocks each; four blocks in all


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(4)])


class Accumulator(Blocks):
    """``acc.add_(x)`` after every block; returned at the end."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = x.new_zeros(x.shape)
        for block in self.blocks:
            x = torch.tanh(block(x))
            acc.add_(x)
        return acc


class ReadBetweenWrites(Blocks):
    """Every block reads the accumulator, which the block before updated: a copy must be taken again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros_like(x)
        for block in self.blocks:
            x = torch.tanh(block(x + acc))
            acc.add_(x)
        return acc * 2


class ReadAfterWrites(Blocks):
    """Each block's ``reads`` module reads the accumulator as the block before wrote it (``tanh``: what it saves
    for the backward is its own output, not the accumulator)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = nn.ModuleList([nn.Tanh() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros_like(x)
        for block, read in zip(self.blocks, self.reads, strict=True):
            x = torch.tanh(block(x)) + read(acc)
            acc.add_(x)
        return acc * 2


class ViewOfWritten(Blocks):
    """A view taken before the writes is read after them, on the other half of the model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = x.new_zeros(x.shape[0], 2 * WIDTH)
        left = acc[:, :WIDTH]
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x + left))
            acc[:, (i % 2) * WIDTH : (i % 2 + 1) * WIDTH].add_(x)
        return acc.sum(1) + left.mean(1)


class RunningBuffer(Blocks):
    """A buffer updated in place by the first block's output and read by the last block, across calls."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](x))
        self.running.mul_(0.5).add_(h.detach().mean(0))
        for block in self.blocks[1:]:
            h = torch.tanh(block(h))
        return h + self.running


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("model_class", [Accumulator, ReadBetweenWrites, ViewOfWritten])
def test_a_written_activation_stays_with_its_writers_and_the_blocks_spread(
    model_class: type[nn.Module], trace: str
) -> None:
    torch.manual_seed(0)
    gm = split_and_compare(model_class(), BUDGETS, (torch.randn(3, WIDTH),), trace=trace, steps=2, check=True)
    plan = gm.meta["fxsplit_plan"]
    homes = {plan.param_devices[f"blocks.{i}.weight"] for i in range(4)}
    assert homes == {"cpu:0", "cpu:1"}, plan  # the blocks are spread, not glued to the writes


@pytest.mark.parametrize("trace", TRACES)
def test_a_copy_read_after_a_write_is_taken_again(trace: str) -> None:
    """Two blocks on each device, each reading the accumulator as the block before wrote it: the two on the device
    it does not live on read two versions of it, each a copy of its own."""
    torch.manual_seed(0)
    pins = {f"{kind}.{i}": f"cpu:{i // 2}" for kind in ("blocks", "reads") for i in range(4)}
    gm = split_and_compare(ReadAfterWrites(), BUDGETS, (torch.randn(3, WIDTH),), trace=trace, check=True, pins=pins)
    plan = gm.meta["fxsplit_plan"]
    acc_home = plan.placement[next(n for n in plan.placement if n.startswith(("zeros_like", "new_zeros", "zeros")))]
    again = [c for c in plan.cuts if c.source == acc_home and c.kind == "activation"]
    repeated = {(c.producer, c.destination) for c in again if sum(1 for d in again if d == c) > 1}
    if trace == "fx":  # fx reads the accumulator by one name throughout: it is cut again after each write
        assert repeated, plan.cuts


@pytest.mark.parametrize("trace", TRACES)
def test_a_buffer_written_in_place_persists_across_calls_where_its_writers_run(trace: str) -> None:
    torch.manual_seed(0)
    model = RunningBuffer()
    gm = split_and_compare(model, BUDGETS, (torch.randn(3, WIDTH),), trace=trace, steps=3, check=True)
    plan = gm.meta["fxsplit_plan"]
    writers = [n for n in plan.placement if n.startswith(("mul_", "add_"))]
    assert {plan.placement[n] for n in writers} == {plan.param_devices["running"]}


def test_batchnorm_in_training_updates_its_running_stats_across_a_cut() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(), *Blocks().blocks[:3]).train()
    split_and_compare(model, BUDGETS, (torch.randn(5, WIDTH),), trace="fx", steps=3, check=True)


def test_a_colocated_group_joins_the_device_that_copies_least_and_fits() -> None:
    problem = PartitionProblem(  # 'z' makes a tensor that 'w1' and 'w2' write; 'b1' and 'b2' are heavy blocks
        op_names=("z", "b1", "w1", "b2", "w2"),
        values=(
            Value("p1", 0, 1, (1,), weight=100),
            Value("p2", 0, 3, (3,), weight=100),
            Value("z", 4, 0, (2, 4)),
            Value("b1", 4, 1, (2, 3)),
            Value("b2", 4, 3, (4,)),
        ),
        colocated=((0, 2, 4),),
    )
    placed = partition(problem, [150, 150])
    assert len({placed.op_devices[i] for i in (0, 2, 4)}) == 1
    assert placed.op_devices[1] != placed.op_devices[3]  # the blocks spread
    assert placement_problems(problem, placed.op_devices, [150, 150]) == []
    assert placement_problems(problem, (0, 0, 0, 1, 1), [150, 150])[0].startswith("ops 'z', 'w1', 'w2' write one")
    # with the group held as a span (the old rule) nothing fits two devices of 150
    with pytest.raises(fxsplit.BudgetError):
        partition(problem.glued(), [150, 150])
    # contiguous placements (pipelines) hold the group as a span
    with pytest.raises(fxsplit.BudgetError):
        partition(problem, [150, 150], contiguous=True)


def test_the_old_glued_rule_is_the_fallback_when_no_device_takes_a_group() -> None:
    problem = PartitionProblem(  # the writers are pinned to different devices: no group placement exists
        op_names=("a", "b"),
        values=(Value("t", 4, 0, (1,)),),
        pinned={0: 0, 1: 1},
        colocated=((0, 1),),
    )
    with pytest.raises(fxsplit.BudgetError):
        partition(problem, [10, 10])


@pytest.mark.parametrize("trace", TRACES)
def test_the_unsplit_model_is_not_changed_by_splitting_a_mutating_model(trace: str) -> None:
    torch.manual_seed(0)
    model = RunningBuffer()
    before = copy.deepcopy(model.state_dict())
    fxsplit.plan(model, BUDGETS, example_inputs=(torch.randn(3, WIDTH),), trace=trace, mode="weights")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("devices", [2])
def test_static_cache_generation_prefills_a_prompt_of_any_length_then_decodes(devices: int) -> None:
    """A Hugging Face Llama in transformers' own export wrapper (a static KV cache the graph writes in
    place), split with the sequence length dynamic: one call prefills the whole prompt, then one token
    per call; the greedy tokens are model.generate's, and each layer's cache is on its layer's device."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=128,
        intermediate_size=352,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.cache_implementation = "static"
    prompt = torch.tensor([[5, 17, 42, 7, 9, 11]])
    expected = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, 6:].tolist()
    wrapped = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=32)
    total = sum(t.numel() * t.element_size() for t in [*wrapped.parameters(), *wrapped.buffers()])
    seq = torch.export.Dim("seq", min=1, max=31)
    split = fxsplit.fxsplit(
        wrapped,
        {f"cpu:{i}": int(1.1 * total / devices) for i in range(devices)},
        example_inputs=(torch.tensor([[1, 2]]),),
        example_kwargs={"cache_position": torch.tensor([0, 1])},
        dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}},
        mode="weights",
        check=True,
    )
    plan = split.meta["fxsplit_plan"]
    signatures = {**plan.tensors, **plan.constants}
    caches = {name: plan.param_devices[name] for name in plan.mutated if signatures[name].count(",") == 3}
    assert len(set(caches.values())) == devices, caches  # the layers' caches are spread with the layers
    assert "written in place:" in str(plan)
    logits = split(prompt, cache_position=torch.arange(6))
    tokens, position = [], 6
    for _ in range(16):
        tokens.append(int(logits[0, -1].argmax()))
        logits = split(torch.tensor([[tokens[-1]]]), cache_position=torch.tensor([position]))
        position += 1
    assert tokens == expected


class GrowingState(Blocks):
    """``self.cache = torch.cat([self.cache, x])``: a buffer that grows by every call's input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 0, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache = torch.cat([self.cache, x], dim=1)
        return self.blocks[0](x) + self.cache.mean(dim=1, keepdim=True)


def test_state_that_grows_per_call_is_refused_naming_the_buffer_and_the_static_alternative() -> None:
    # torch.export writes the longer tensor back into the buffer as traced: a split would drop what grows
    with pytest.raises(fxsplit.FxsplitError, match=r"buffer 'cache' is replaced on every call .*\[1, 0, 64\] -> "):
        fxsplit.fxsplit(GrowingState(), BUDGETS, example_inputs=(torch.randn(1, 1, WIDTH),), mode="weights")


ALIASES = {  # a write through each of these changes the tensor it came from (or may: contiguous, float, to)
    "contiguous": lambda h: h.contiguous(),
    "float": lambda h: h.float(),
    "to_float32": lambda h: h.to(torch.float32),
    "type_as": lambda h: h.type_as(h),
    "ravel": lambda h: torch.ravel(h),
    "diagonal": lambda h: torch.diagonal(h),
    "swapaxes": lambda h: torch.swapaxes(h, 0, 1),
    "broadcast_to": lambda h: torch.broadcast_to(h, h.shape),
    "as_strided": lambda h: torch.as_strided(h, (2,), (1,)),
    "atleast_2d": lambda h: torch.atleast_2d(h),
    "tensor_split": lambda h: h.tensor_split(2, 1)[0],
    "split_with_sizes": lambda h: h.split_with_sizes([1, 3], 1)[1],
    "setitem_method": lambda h: (h.__setitem__(0, 5.0), None)[1],  # writes h itself: nothing more to write
}


class Through(nn.Module):
    def __init__(self, write: object) -> None:
        super().__init__()
        self.write = write

    def forward(self, h: torch.Tensor) -> None:
        out = self.write(h)  # type: ignore[operator]
        if out is not None:
            out.mul_(-2)


class WriteThroughAlias(nn.Module):
    """``a`` makes h; ``b`` writes it through an alias; ``c`` reads it after."""

    def __init__(self, alias: str) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), Through(ALIASES[alias]), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).detach()
        self.b(h)
        return self.c(h)


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_a_write_through_an_alias_is_never_made_on_a_copy(alias: str, trace: str) -> None:
    """Pinned apart, the writer would write a copy: refused, or (where the trace drops a no-op alias) right;
    free, the split equals the model."""
    torch.manual_seed(0)
    x, budgets = torch.randn(3, 4), {"cpu:0": "1MiB", "cpu:1": "1MiB", "cpu:2": "1MiB"}
    reference = WriteThroughAlias(alias)
    for pins in ({"a": "cpu:0", "b": "cpu:1", "c": "cpu:2"}, {"a": "cpu:0", "c": "cpu:2"}):
        model = copy.deepcopy(reference)
        try:
            split = fxsplit.fxsplit(model, budgets, example_inputs=(x,), trace=trace, pins=pins)
        except fxsplit.FxsplitError as error:
            assert "b" in pins  # only the writer pinned away from the tensor may be refused, and says why
            assert "pins put ops that write one tensor in place" in str(error) and "in 'b') on 'cpu:1'" in str(error)
            continue
        with torch.no_grad():
            torch.testing.assert_close(split(x), reference(x))


class TwoNames(nn.Module):
    """``v2 = v1.add_(1)``: one tensor under two node names, both read after the write (on another device)."""

    def __init__(self, write: str = "add_") -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.write = write

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v1 = self.a(x)
        v2 = v1.add_(1) if self.write == "add_" else torch.relu_(v1) if self.write == "relu_" else v1.mul_(2).tanh_()
        return self.b(v1) + self.c(v2), v2


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("write", ["add_", "relu_", "mul_tanh_"])
def test_a_tensor_read_under_two_names_after_a_write_is_copied_once_per_device(write: str, trace: str) -> None:
    """The generated code copied ``v1`` and ``v2`` once each, the same tensor twice; the plan's cuts, its bytes and
    the partitioner's objective now count the one copy the code makes, and the output (``v2``) is that copy too."""
    torch.manual_seed(0)
    x = torch.randn(3, WIDTH)
    pins = {"a": "cpu:0", "b": "cpu:1", "c": "cpu:1"}
    gm = split_and_compare(TwoNames(write), BUDGETS, (x,), trace=trace, check=True, pins=pins, output_device="cpu:1")
    plan = gm.meta["fxsplit_plan"]
    activations = [c for c in plan.cuts if c.source == "cpu:0" and c.kind in ("activation", "output")]
    assert len(activations) == 1 and activations[0].nbytes == 3 * WIDTH * 4, plan.cuts
    copies = [
        n
        for n in gm.graph.nodes
        if n.meta.get(fxsplit.codegen.COPY_META) and n.meta[fxsplit.codegen.COPY_META].source == "cpu:0"
    ]
    assert len(copies) == 1, gm.code
    free = fxsplit.plan(TwoNames(write), BUDGETS, example_inputs=(x,), trace=trace, mode="weights")
    assert free.transfer_bytes == sum(c.nbytes or 0 for c in free.cuts if c.kind != "stream")


def test_the_partitioner_reads_a_tensor_written_in_place_as_one_value_per_version() -> None:
    """Its objective charges one copy of ``v1``/``v2`` per device and version read, not one per name: ``add_``
    reads ``a`` as the linear made it; ``b`` and ``c`` read it as ``add_`` wrote it, one value made by ``add_``."""
    from fxsplit.cost.build import build_problem

    model = TwoNames()
    gm = torch.fx.symbolic_trace(model)
    costs = build_problem(gm, model, device_index={"cpu:0": 0, "cpu:1": 1})
    names = [v.name for v in costs.problem.values if not v.weight]
    assert "add_" not in names, names
    found = [v for v in costs.problem.values if v.name == "a"]
    op_names = costs.problem.op_names
    assert [{op_names[i] for i in v.consumers} for v in found] == [{"add_"}, {"b", "c"}], found
    assert op_names[found[1].start] == "add_"


class ReadWriteRead(nn.Module):
    """``h`` is read by ``b`` before a slice of it is written in place, and by ``c`` after (random program 14072)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(h)
        h[:, : WIDTH // 2].add_(0.5)
        return y + self.c(h)


@pytest.mark.parametrize("trace", TRACES)
def test_the_partitioner_charges_the_copies_of_each_version_the_code_makes(trace: str) -> None:
    """With ``b`` and ``c`` on cpu:1 and ``h`` on cpu:0, the code copies ``h`` twice (before and after the write);
    the partitioner charged one copy, and chose placements by bytes the run does not copy (random program 14072:
    scored 58,368 B, copied 95,232 B, more than a smaller budget's 92,160 B)."""
    from fxsplit.cost.build import build_problem
    from fxsplit.partition.result import transfer_bytes

    torch.manual_seed(0)
    model, x = ReadWriteRead(), torch.randn(3, WIDTH)
    pins = {"a": "cpu:0", "b": "cpu:1", "c": "cpu:1"}
    options = {"example_inputs": (x,), "trace": trace, "mode": "weights", "output_device": "cpu:1"}
    plan = fxsplit.plan(model, BUDGETS, pins=pins, **options)
    traced = fxsplit.tracing.trace(model, example_inputs=(x,), mode=trace)
    costs = build_problem(traced.graph_module, model, device_index={"cpu:0": 0, "cpu:1": 1})
    placed = [int(plan.placement[name].removeprefix("cpu:")) for name in costs.problem.op_names]
    copies = [c for c in plan.cuts if c.kind == "activation"]
    if trace == "fx":  # export's functional graph reads the written tensor under a new name: copied once
        assert len(copies) == 2 and {c.producer for c in copies} == {"a"}, plan.cuts
    assert transfer_bytes(costs.problem, placed) == plan.transfer_bytes, plan.cuts


class InputTwoNames(nn.Module):
    """``y = x.mul_(2)`` on the model's input; ``x`` and ``y`` are both read on another device."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        y = x.mul_(2)
        return self.b(x) + self.c(y) + h, y


@pytest.mark.parametrize("trace", TRACES)
def test_an_input_read_under_two_names_after_a_write_is_copied_once_and_written_back(trace: str) -> None:
    torch.manual_seed(0)
    model, x = InputTwoNames(), torch.randn(3, WIDTH)
    pins = {"a": "cpu:0", "mul_": "cpu:0", "b": "cpu:1", "c": "cpu:1"}
    split = fxsplit.fxsplit(copy.deepcopy(model), BUDGETS, example_inputs=(x.clone(),), trace=trace, pins=pins)
    plan = split.meta["fxsplit_plan"]
    assert sorted(c.kind for c in plan.cuts if c.kind != "output") == ["activation", "input"], plan.cuts  # x and h
    fxsplit.check.verify_split(split)
    mine, theirs = x.clone(), x.clone()
    with torch.no_grad():
        got, expected = split(mine), model(theirs)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(mine, theirs)  # the caller's tensor is written as eager writes it


def test_a_plan_that_copies_a_written_tensor_once_per_name_is_refused_saying_to_plan_again() -> None:
    """A plan saved before one copy served both names lists a cut of ``add_`` beside that of ``a``."""
    import dataclasses

    x, pins = torch.randn(3, WIDTH), {"a": "cpu:0", "b": "cpu:1", "c": "cpu:1"}
    options = {"example_inputs": (x,), "trace": "fx", "pins": pins, "output_device": "cpu:1", "mode": "weights"}
    plan = fxsplit.plan(TwoNames(), BUDGETS, **options)
    (cut,) = [c for c in plan.cuts if c.producer == "a"]
    old = dataclasses.replace(plan, cuts=(*plan.cuts, dataclasses.replace(cut, producer="add_")))
    with pytest.raises(
        fxsplit.PlanMismatchError,
        match=r"copies 'add_', the result of an in-place write.*plan again\):\n  plan lists add_: cpu:0 -> cpu:1",
    ):
        fxsplit.apply(TwoNames(), old, example_inputs=(x,))
    fxsplit.apply(TwoNames(), plan, example_inputs=(x,))  # the plan as made now applies
