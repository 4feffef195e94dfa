"""Training memory in the backward, planned against what the allocator holds (:mod:`fxsplit.memory.allocmeter`).

Each case was planned short of the run before an op's backward was measured as one episode
(:mod:`fxsplit.memory.allocations`): gradients a composite op makes and frees inside (a leaf module, an RNN's
steps), the two gradients an in-place op holds for a moment, the gradient a loss gives the outputs. The plan must
cover the run on every device, and not by much more.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from random_programs import generate
from sink_graphs import sink_graph

import fxsplit
from fxsplit.codegen.emitter import emit, move_weights
from fxsplit.cost.build import build_problem
from fxsplit.memory.activations import profile_activations
from fxsplit.memory.allocmeter import allocated_peaks
from fxsplit.memory.lifetimes import ActivationProfile, ValueMemory, simulate
from fxsplit.options import Budgets
from fxsplit.partition.result import Partition
from fxsplit.planning.build import make_plan
from fxsplit.tracing.capture import trace


class InPlaceResidual(nn.Module):
    """``y = linear(h); y.add_(h); y.relu_()``: fx reads ``y``'s node after both writes."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            y = layer(h)
            y.add_(h)
            y.relu_()
            h = y
        return h


class ConvBlocks(nn.Module):
    """ResNet-style blocks with ``ReLU(inplace=True)`` after batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True))
        self.c1, self.b1 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.relu(self.b2(self.c2(self.relu(self.b1(self.c1(x))))) + x)
        return self.head(x)


class Attention(nn.Module):
    """Two ``nn.MultiheadAttention`` (fx leaf modules), one returning its attention weights unused."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.MultiheadAttention(64, 4, batch_first=True)
        self.b = nn.MultiheadAttention(64, 4, batch_first=True)
        self.mid = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.a(x, x, x, need_weights=False)[0]
        h = h + self.mid(h)
        return h + self.b(h, h, h)[0]


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module], hidden: int) -> None:
        super().__init__()
        self.rnn = cell(32, hidden, batch_first=True)
        self.out = nn.Linear(hidden, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0])


class CausalAttention(nn.Module):
    """q, k and v are views of one projection: split over three devices, each is copied on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o, self.f = nn.Linear(64, 192), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.f(self.o(y.transpose(1, 2).reshape(b, t, 64)) + x)


class ReturnsHidden(nn.Module):
    """Returns ``h`` as well as the head's result, which reads ``h`` again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return h, self.c(torch.relu(self.b(torch.relu(h))) + h)


class SharedLinear(nn.Module):
    """One Linear applied five times: over two devices its weight is copied to the second and read there four
    times, where the copy's gradients are summed; the sum is sent home and added to the first use's (held there
    until then when accumulating into an existing .grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.head = nn.Linear(96, 96), nn.Linear(96, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(5):
            x = torch.relu(self.shared(x)) + x
        return self.head(x)


@torch.fx.wrap
def _select_and_transpose(h: torch.Tensor) -> torch.Tensor:
    """One op of the graph whose backward sums two gradients of ``a``: the transpose's arrives first, a view of
    the gradient the op received, so the engine adds the select's (new zeros, which nothing else holds) out of
    place: it adds in place only into the gradient waiting. Planned 776 B under the allocator before."""
    a = h * 2
    return a[0] * 1 + a.t()


class SumOrder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 4)  # small next to the 64 x 64 gradients summed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_select_and_transpose(self.a(x)))


class ViewOutputs(nn.Module):
    """Three outputs viewing one value: the transpose's gradient reaches it first, a view, so the select's is
    added to it out of place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.b(torch.relu(self.a(x)))
        return h.view(-1), h[0], h.transpose(0, 1)


class ReluOnAView(nn.Module):
    """``h.view(-1)[:100].relu_()``: writing into a view gives ``h`` a new autograd node (CopySlices), whose
    backward makes a new gradient of all of ``h`` where ``h`` lives, not where its next reader runs."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(96, 96), nn.Linear(96, 96), nn.Linear(96, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        h.view(-1)[:100].relu_()
        return self.l3(F.gelu(self.l2(h * 1)))


class PassedTwice(nn.Module):
    """``(v2 + 1.0) + v2``: the two adds pass one gradient tensor to ``v2`` twice, so the engine sums it with
    itself out of place (it is held twice); found on a random DAG with mean sinks (0.86 of the allocator)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.head = nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v1 = self.l0(x).relu()
        v2 = (v1 * 0.5) * x
        v4 = torch.tanh((v1 + v2) * 1.0)
        v5 = (v2 + 1.0) + v2
        return self.head(v5 + v1.mean() + v4.mean())


class SplitQKV(nn.Module):
    """``q, k, v = linear(x).split(64, -1)`` read by one op: split's backward concatenates the three gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.a(x).split(64, -1)
        return self.b(torch.addcmul(v, q, k))


class Modulate(nn.Module):
    """``(h + 1) * h``: the add hands the gradient the multiply made for it on to ``h`` (a modulation,
    ``x * (1 + scale)``, reads its input so too)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return (h + 1) * h


class ScoresWithShifted(nn.Module):
    """``h @ (h + 1).t()``: the add hands on, through the transpose, the gradient the matmul made."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h @ (h + 1.0).t()


class TransposedOutput(nn.Module):
    """``(h.t(), h * 2)`` returned: the loss's gradient for ``h.t()`` reaches ``h`` first, from the start of the
    backward; the multiply's waits from its backward until the transpose's hands that one on."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(96, 96)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return h.transpose(-1, -2), h * 2


class PartReturnedBesideCat(nn.Module):
    """``c[:, 0]`` returned beside ``cat([h * 3, c])``: the loss's gradient for the part is the part's size until
    its backward makes one of all of ``c``, and ``c``'s first gradient is a view of ``cat``'s, which it holds until
    the two are added (0.89 of the allocator when ``c`` was counted as returned whole, from the start)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.l0(x)
        c = h * 2
        part = c[:, 0]
        return torch.cat([h * 3, c]), part


class WrittenTwice(nn.Module):
    """``v = h * 1.5; v.mul_(0.5); v.add_(h)``: the add hands the loss's gradient to ``h`` too, where it waits while
    the in-place multiply's backward makes a new one for ``v``."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(48, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l0(x)
        v = h * 1.5
        v.mul_(0.5)
        return v.add_(h)


class SliceBesideTranspose(nn.Module):
    """``h.t() @ h[..., :24]``: the slice's gradient waits beside the transpose's, a gradient of all of ``h``, from
    the matmul's backward until the slice's own (0.947 of the allocator when the one gradient of ``h`` stood for
    both)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(48, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l0(x)
        return h.transpose(-1, -2) @ h[..., :24]


class ChunkBesideScores(nn.Module):
    """``softmax(c @ c.t()) @ chunk(c, 2)[0]``: the item's gradient waits from the last matmul's backward until
    ``chunk``'s, beside the two of all of ``c`` that the first matmul makes (0.886 of the allocator without)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(48, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.cat([self.l0(x), x, self.l0(x)], dim=-1)
        v = torch.chunk(c, 2, dim=2)[0]
        return torch.softmax(c @ c.transpose(-1, -2) / 8.0, dim=-1) @ v


class SliceWrittenThenRead(nn.Module):
    """``g[..., 19:45].mul_(2)``, then ``g`` read by a matmul and an add and returned: ``g``'s autograd node is made
    anew when the matmul reads it after the write; it is still ``g``'s op's, so the add hands its gradient on to
    ``g`` (0.877 of the allocator when the node was taken for the matmul's)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(48, 48)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.l1(x)
        g[..., 19:45].mul_(2.0)
        o = torch.softmax(x @ x.transpose(-1, -2) / 8.0, dim=-1) @ g
        return o * o + g, g


class CloneWrittenThenScores(nn.Module):
    """``c = h.clone(); c.mul_(2); c @ h.t()``: ``c``'s gradient comes from the matmul, through the write."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(48, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        c = h.clone()
        c.mul_(2.0)
        return c @ h.transpose(-1, -2)


class ItemOfReturnedSplit(nn.Module):
    """``l2(split(h, 18)[2])`` with ``h`` returned: the item's gradient waits at its own size, from ``l2``'s backward
    until ``split``'s, beside the loss's gradient of ``h`` (0.97 of the allocator when counted only from the
    items' ``getitem``)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l2 = nn.Linear(48, 48), nn.Linear(12, 128)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.l0(x)
        return self.l2(torch.split(h, 18, dim=2)[2]), h


class ResidualOverAttention(nn.Module):
    """``v3 + sdpa(q, x, v3)`` returned, the attention's result also read by a softmax (the loss's input): the
    add hands the loss's gradient to it and to ``v3``; the softmax's is added to it while ``v3``'s still holds it,
    out of place, so the attention's gradient is a tensor apart (0.958 of the allocator when taken as one tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.l0(x)
        v3 = torch.maximum(h, x)
        v4 = F.scaled_dot_product_attention(torch.softmax(h, dim=-1), x, v3)
        v7 = torch.softmax(v4, dim=-1)
        return F.mse_loss(v7, torch.zeros_like(v7)), v3 + v4, v7.detach()


class ResidualThroughIdentity(nn.Module):
    """Pre-norm residual blocks with ``Dropout(0.0)`` and ``Identity`` between the projection and the add (timm's
    ViT): the add's gradient reaches the projection through them as is, one tensor with the residual's (planned
    1.05x the allocator, fx, accumulating, when they were taken for readers sending gradients of their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(64) for _ in range(3)])
        self.projs = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])
        self.drop, self.ident = nn.Dropout(0.0), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, proj in zip(self.norms, self.projs, strict=True):
            x = x + self.ident(self.drop(proj(torch.relu(norm(x)))))
        return x


class ReturnedThrice(nn.Module):
    """``(y, y, y)`` returned: the loss gives each its own gradient, added one by one into the first as the backward
    starts (0.69 of the allocator on cpu:1 without the second)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 512))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.layers(x)
        return (y, y, y)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


CASES = {  # name -> (model, input, traces, devices[, budget per device as a part of the whole's total])
    "in-place residual": (InPlaceResidual, (16, 64), ("fx", "export"), 2),
    "views of one storage copied to another device": (CausalAttention, (7, 32, 64), ("fx", "export"), 3, 0.7),
    "an output read again": (ReturnsHidden, (32, 64), ("fx", "export"), 2),
    "in-place relu after batch norm": (ConvBlocks, (2, 3, 16, 16), ("fx", "export"), 2, 0.85),
    "multi-head attention leaves": (Attention, (4, 16, 64), ("fx",), 2),
    "gru steps": (lambda: Recurrent(nn.GRU, 256), (4, 20, 32), ("fx",), 1),
    "lstm": (lambda: Recurrent(nn.LSTM, 64), (4, 20, 32), ("fx",), 1),
    "transformer encoder leaf": (Encoder, (4, 16, 64), ("fx",), 1),
    "one weight read five times, on two devices": (SharedLinear, (32, 96), ("fx", "export"), 2, 0.8),
    "a sum into a view's gradient, out of place": (SumOrder, (64, 16), ("fx",), 1),
    "outputs viewing one value": (ViewOutputs, (32, 64), ("fx", "export"), 2),
    "relu_ on a view, its base read on the next device": (ReluOnAView, (32, 96), ("fx", "export"), 2),
    "one gradient passed twice to a value": (PassedTwice, (3, 64), ("fx", "export"), 1),
    "q, k and v split from one projection": (SplitQKV, (64, 64), ("fx", "export"), 1),
    "an add hands on a gradient the next op made": (Modulate, (8, 32), ("fx", "export"), 1),
    "a matmul of h and (h + 1).t()": (ScoresWithShifted, (64, 32), ("fx", "export"), 1),
    "a transposed view returned beside another output": (TransposedOutput, (8, 16, 96), ("fx", "export"), 1),
    "a part of a value returned beside a cat of it": (PartReturnedBesideCat, (16, 4, 32), ("fx", "export"), 1),
    "written in place twice, the add handing its gradient on": (WrittenTwice, (8, 4, 48), ("fx", "export"), 1),
    "a slice of h beside its transpose": (SliceBesideTranspose, (4, 8, 48), ("fx", "export"), 1),
    "an item of chunk(c) waiting beside c's gradients": (ChunkBesideScores, (4, 8, 48), ("fx", "export"), 1),
    "a slice written in place, its base read after": (SliceWrittenThenRead, (4, 8, 48), ("fx", "export"), 1),
    "a clone written in place, then scores with its source": (CloneWrittenThenScores, (16, 4, 48), ("fx", "export"), 1),
    "an item of a split of a returned value": (ItemOfReturnedSplit, (8, 6, 48), ("fx", "export"), 1),
    "an add over attention, the attention read again": (ResidualOverAttention, (16, 16, 32), ("fx", "export"), 1),
    "residual adds through Dropout(0) and Identity": (ResidualThroughIdentity, (8, 16, 64), ("fx", "export"), 1),
    "one value returned three times": (ReturnedThrice, (4, 8, 32), ("fx", "export"), 2, 0.95),
    "wide output": (lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4096)), (16, 64), ("fx",), 1),
}


OVER = {  # (case, accumulating) -> how far over the allocator the plan may be (else 2%)
    # v's gradient, addcmul's result's handed on, counted in the projection's and in addcmul's backward: 1.125
    # (1.25 when the projection's gradient was held from addcmul's result's on, at the projection's size)
    ("q, k and v split from one projection", False): 1.13,
    ("q, k and v split from one projection", True): 1.13,
    ("lstm", True): 1.03,  # oneDNN's weight gradients, added to the .grads one by one: planned 2.5% over
    # the part's gradient is freed in its backward after the one of all of c is made, before they are added
    ("a part of a value returned beside a cat of it", False): 1.03,
    ("a part of a value returned beside a cat of it", True): 1.03,
    # the attention's gradient is its own tensor from the softmax's backward on (the sum is not the add's); 16 KiB
    # more than the allocator inside the attention's backward, not traced to its node
    ("an add over attention, the attention read again", False): 1.05,
    ("an add over attention, the attention read again", True): 1.05,
    ("outputs viewing one value", True): 1.18,  # the seeds of the views' outputs are held from the start
    ("one weight read five times, on two devices", False): 1.61,  # the copy's gradient, first home, is held
    # as if accumulating (it is the .grad only in a first backward): 99,072 B planned, 61,824 B measured
}


def _planned_and_allocated(name: str, trace: str, accumulate: bool) -> tuple[dict[str, int], dict[str, int]]:
    """The plan's activation peaks, and the allocator's in a backward into no ``.grad`` (``accumulate``: into the
    ``.grad`` tensors a first backward made)."""
    build, shape, _, devices, *part = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(*shape)
    options = {"example_inputs": (x,), "mode": "training", "optimizer": "sgd", "trace": trace}
    options["accumulate_grads"] = accumulate
    whole = fxsplit.plan(build().train(), {"cpu:0": 1 << 32}, **options).memory["cpu:0"]["total"]
    share = part[0] if part else 0.75 if devices > 1 else 1.1
    budgets = {f"cpu:{i}": int(whole * share) for i in range(devices)}
    torch.manual_seed(0)
    gm = fxsplit.fxsplit(build().train(), budgets, **options)
    planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items() if row.get("total")}
    for parameter in gm.parameters():
        parameter.grad = None
    allocated = allocated_peaks(gm, x, backward=True)  # no .grad yet: a weight's first gradient becomes it
    if accumulate:  # into the .grads: each weight's new gradient is held until it is added
        allocated = allocated_peaks(gm, x, backward=True)
    return planned, allocated


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize(
    ("name", "trace"), [(name, trace) for name, (_, _, traces, *_) in CASES.items() for trace in traces]
)
def test_the_plan_covers_the_backward_the_allocator_sees_and_not_by_much(
    name: str, trace: str, accumulate: bool
) -> None:
    planned, allocated = _planned_and_allocated(name, trace, accumulate)
    assert set(allocated) <= set(planned), (planned, allocated)
    assert len(allocated) == CASES[name][3], allocated  # split as asked: every device runs something
    for device, nbytes in allocated.items():  # 64 B: scalars torch wraps into tensors outside any op
        assert planned[device] >= nbytes - 64, (device, planned, allocated)
        assert planned[device] <= nbytes * OVER.get((name, accumulate), 1.02) + 64, (device, planned, allocated)


def test_the_gradient_a_loss_gives_the_output_counts_where_the_output_is() -> None:
    # op 0 makes the output on cpu:0, which is returned on cpu:1: its gradient comes to cpu:1 and is copied back
    profile = ActivationProfile(
        op_names=("a",),
        reads=(("x",),),
        values={"x": ValueMemory(8, (0,)), "a": ValueMemory(64, (1,), requires_grad=True)},
        storage_bytes={0: 8, 1: 64},
        inputs=("x",),
        outputs=("a",),
        training=True,
    )
    here = simulate(profile, ["cpu:0"], {"x": "cpu:0"}, "cpu:0")
    assert here.backward == {"cpu:0": 64 + 64}  # the output the caller holds, and its gradient
    there = simulate(profile, ["cpu:0"], {"x": "cpu:0"}, "cpu:1")
    assert there.backward == {"cpu:0": 64, "cpu:1": 64 + 64}  # the copy and its gradient; that gradient copied back


def test_an_unused_tuple_element_gets_no_gradient() -> None:
    # op 0 returns a pair (storages 1 and 2), op 1 takes out the first: only that one gets a gradient
    values = {
        "x": ValueMemory(8, (0,)),
        "pair": ValueMemory(96, (1, 2), requires_grad=True),
        "first": ValueMemory(32, (1,), requires_grad=True),
    }
    profile = ActivationProfile(
        op_names=("pair", "first"),
        reads=(("x",), ("pair",)),
        values=values,
        storage_bytes={0: 8, 1: 32, 2: 64},
        inputs=("x",),
        outputs=("first",),
        training=True,
        extracts={1: frozenset({1})},
    )
    taken = simulate(profile, ["cpu:0", "cpu:0"], {"x": "cpu:0"}, "cpu:0").backward["cpu:0"]
    whole = simulate(dataclasses.replace(profile, extracts={}), ["cpu:0", "cpu:0"], {"x": "cpu:0"}, "cpu:0").backward[
        "cpu:0"
    ]
    assert whole - taken == 64  # without it, the unused element's gradient was counted


def test_t5s_encoder_states_returned_and_read_by_the_decoder_on_the_outputs_device() -> None:
    """The encoder's states are copied to the decoder's device, read there by cross-attention and returned: their
    gradient (the loss's) waits there until cross-attention's backward, as the allocator sees."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 8), generator=generator)
    kwargs = {"decoder_input_ids": torch.randint(0, 128, (2, 6), generator=generator), "use_cache": False}
    options = {"example_inputs": (ids,), "example_kwargs": kwargs, "mode": "training", "optimizer": "sgd"}
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).train()
    whole = fxsplit.plan(model, {"cpu:0": 1 << 32}, **options).memory["cpu:0"]["total"]
    gm = fxsplit.fxsplit(model, {"cpu:0": int(0.7 * whole), "cpu:1": int(0.7 * whole)}, **options)
    planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
    for parameter in gm.parameters():
        parameter.grad = None
    allocated = allocated_peaks(gm, ids, backward=True, decoder_input_ids=kwargs["decoder_input_ids"])
    assert len(allocated) == 2, allocated
    for device, nbytes in allocated.items():
        assert nbytes - 64 <= planned[device] <= nbytes * 1.05, (device, planned, allocated)


class ReluOnATranspose(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(96, 96), nn.Linear(96, 96), nn.Linear(96, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x).t().relu_().t()
        return self.l3(F.gelu(self.l2(h)))


def test_a_gradient_passed_from_a_written_view_to_its_base_is_not_received_twice() -> None:
    """Writing into ``h.t()`` gives ``h`` a new autograd node, owned by the writing op. The gradient reaching the
    view's node goes on to the base's inside that op's backward: one gradient received, not two (1.37x the
    allocator when counted twice). What is left over is the simulation's upper bound for in-place ops."""
    torch.manual_seed(0)
    x = torch.randn(32, 96)
    gm = fxsplit.fxsplit(ReluOnATranspose(), {"cpu:0": "1GiB"}, example_inputs=(x,), mode="training", trace="fx")
    planned = gm.meta["fxsplit_plan"].memory["cpu:0"]["activations_peak"]
    allocated = allocated_peaks(gm, x, backward=True)["cpu:0"]
    assert allocated <= planned <= 1.2 * allocated


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(v, q, k) @ self.w


class QKV(nn.Module):
    """q, k and v are views of one projection (``select`` after a reshape, or slices), read by one module; pinned
    to another device, each view is copied there on its own (as an exported ``nn.MultiheadAttention``'s)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.a, self.mix, self.b = how, nn.Linear(64, 256), Mix(), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.how == "select":
            h = h.unflatten(-1, (4, 64)).transpose(0, 1).contiguous()
            q, k, v = h[0], h[1], h[2]
        else:
            q, k, v = h[..., :64], h[..., 64:128], h[..., 128:192]
        return self.b(self.mix(q, k, v))


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("how", ["select", "slice"])
def test_views_whose_gradients_come_back_one_by_one_wait_beside_the_sum_so_far(how: str, trace: str) -> None:
    """The three gradients come back from the other device together; each view's backward makes a projection-sized
    tensor, and the views not yet there wait beside the sum (0.91 of the allocator on cpu:0 when not counted)."""
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    options = {"example_inputs": (x,), "mode": "training", "optimizer": "sgd", "trace": trace}
    budgets = {"cpu:0": "1GiB", "cpu:1": "1GiB"}
    gm = fxsplit.fxsplit(QKV(how), budgets, pins={"a": "cpu:0", "mix": "cpu:1"}, **options)
    assert len(gm.meta["fxsplit_plan"].cuts) == 3, "q, k and v cross to cpu:1 one by one"
    planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
    for parameter in gm.parameters():
        parameter.grad = None
    allocated = allocated_peaks(gm, x, backward=True)
    assert allocated["cpu:0"] - 64 <= planned["cpu:0"] <= allocated["cpu:0"] * 1.02
    # cpu:1 holds all three copies as saved (they share a storage at home); the run saves q and k only
    assert allocated["cpu:1"] - 64 <= planned["cpu:1"] <= allocated["cpu:1"] * 1.4


class LossAndHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.head = nn.Linear(64, 48), nn.Linear(48, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.l0(x).mean(1)
        return F.cross_entropy(self.head(h), labels), h


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_an_output_copied_to_the_outputs_device_and_read_there(trace: str) -> None:
    """``h`` is made on cpu:0, copied to cpu:1 for the head and returned there: the loss's gradient for the copy
    the caller holds comes first, and the head's is added to it (0.83 of the allocator on cpu:1 without)."""
    torch.manual_seed(0)
    x, labels = torch.randn(4, 6, 64), torch.randint(0, 10, (4,))
    options = {"example_inputs": (x, labels), "mode": "training", "optimizer": "sgd", "trace": trace}
    budgets = {"cpu:0": "1GiB", "cpu:1": "1GiB"}
    gm = fxsplit.fxsplit(LossAndHidden(), budgets, pins={"l0": "cpu:0", "head": "cpu:1"}, **options)
    planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
    for parameter in gm.parameters():
        parameter.grad = None
    allocated = allocated_peaks(gm, x, labels, backward=True)
    for device in ("cpu:0", "cpu:1"):
        assert allocated[device] - 64 <= planned[device] <= allocated[device] * 1.02, (device, planned, allocated)


def _exact_on_cpu0_covered_on_cpu1(gm: torch.fx.GraphModule, x: torch.Tensor) -> None:
    """The plan of ``gm``'s training step is within 2% of the allocator on cpu:0 and at or above it on cpu:1."""
    planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
    for parameter in gm.parameters():
        parameter.grad = None
    allocated = allocated_peaks(gm, x, backward=True)
    assert allocated["cpu:0"] - 64 <= planned["cpu:0"] <= allocated["cpu:0"] * 1.02, (planned, allocated)
    assert planned["cpu:1"] >= allocated["cpu:1"] - 64, (planned, allocated)


class SentAndBack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(96, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v1 = self.l0(x)
        v3 = v1 * torch.maximum(v1, v1)
        return torch.cat([v3, v1])


def test_a_sum_where_a_copys_gradient_comes_home_into_a_view_of_another() -> None:
    """At these budgets the balanced partitioner sends ``v1`` to cpu:1 for the product and brings it back beside
    ``v1`` for ``cat`` (49,152 B; the default objective now tries the caps loosened by the charge's slack too, and
    keeps ``cat`` on cpu:1: 24,576 B). ``v1``'s first gradient is a view of ``cat``'s; the copy's, arriving from
    cpu:1, is added out of place on cpu:0, not on cpu:1 where the product's backward ran (0.87 of the allocator on
    cpu:0 when charged there)."""
    torch.manual_seed(0)
    x = torch.randn(12, 8, 96)
    budgets = {"cpu:0": 240_000, "cpu:1": 240_000}
    options = {"mode": "training", "optimizer": "sgd", "trace": "fx", "objective": "balanced"}
    gm = fxsplit.fxsplit(SentAndBack(), budgets, example_inputs=(x,), **options)
    placement = gm.meta["fxsplit_plan"].placement
    assert (placement["l0"], placement["mul"], placement["cat"]) == ("cpu:0", "cpu:1", "cpu:0"), (
        "the partitioner no longer sends v1 away and back at these budgets: pick budgets where it does",
        placement,
    )
    _exact_on_cpu0_covered_on_cpu1(gm, x)


class _Tail(nn.Module):
    def __init__(self, first: str) -> None:
        super().__init__()
        self.first, self.out = first, nn.Linear(32, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.first == "shape":
            return self.out(F.layer_norm(h, (h.shape[-1],)))
        mask = h > 0
        return self.out(F.gelu(h) * mask)


class FirstReadSendsNoGradient(nn.Module):
    """On the second device (``tail``) ``h`` is first read by an op whose result needs no gradient (fx's
    ``h.shape``, a comparison), then by one whose does."""

    def __init__(self, first: str) -> None:
        super().__init__()
        self.l0, self.l1, self.tail = nn.Linear(128, 32), nn.Linear(32, 16), _Tail(first)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.l0(x)
        return self.l1(h), self.tail(h)


@pytest.mark.parametrize(("first", "trace"), [("shape", "fx"), ("compare", "fx"), ("compare", "export")])
def test_a_copy_whose_first_reader_sends_no_gradient_still_sends_one_home(first: str, trace: str) -> None:
    """``h``'s copy on cpu:1 gets its gradient from the op after the first reader; sent home, it is the first
    to arrive, and ``l1``'s is added to it there (0.87 of the allocator on cpu:0 when the copy was taken for a
    reader that sends none back)."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, 128)
    options = {"example_inputs": (x,), "mode": "training", "optimizer": "sgd", "trace": trace}
    pins = {"l0": "cpu:0", "l1": "cpu:0", "tail": "cpu:1"}
    gm = fxsplit.fxsplit(FirstReadSendsNoGradient(first), {"cpu:0": "1GiB", "cpu:1": "1GiB"}, pins=pins, **options)
    assert gm.meta["fxsplit_plan"].cuts[0].producer in ("l0", "linear"), "h crosses to cpu:1"
    planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
    for parameter in gm.parameters():
        parameter.grad = None
    allocated = allocated_peaks(gm, x, backward=True)
    for device in ("cpu:0", "cpu:1"):
        assert allocated[device] - 64 <= planned[device] <= allocated[device] * 1.02, (device, planned, allocated)


class _WrittenThenRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = nn.Linear(32, 32), nn.Linear(32, 128)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.l0(x)
        h.mul_(2)
        return h, self.l1(h)


class _Double(nn.Module):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y * 2


class OutputWrittenInPlace(nn.Module):
    """``h`` written in place, read by ``l1`` and returned; ``l1``'s result is read on the next device. fx's graph
    returns ``h``'s node, not the write's: the output is the written version, whose readers' gradients are added
    to the loss's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = _WrittenThenRead(), _Double()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, y = self.a(x)
        return self.c(y), h


def _pinned_against_allocator(model: nn.Module, x: torch.Tensor, pins: dict[str, str], trace: str) -> None:
    """Split ``model`` with ``pins`` over as many devices; each device's plan covers the allocator, within 2%."""
    options = {"example_inputs": (x,), "mode": "training", "optimizer": "sgd", "trace": trace}
    budgets = dict.fromkeys(pins.values(), "1GiB")
    gm = fxsplit.fxsplit(model, budgets, pins=pins, **options)
    planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
    for parameter in gm.parameters():
        parameter.grad = None
    allocated = allocated_peaks(gm, x, backward=True)
    for device in budgets:
        assert allocated[device] - 64 <= planned[device] <= allocated[device] * 1.02, (device, planned, allocated)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_an_output_written_in_place_gets_its_readers_gradients_added(trace: str) -> None:
    """fx: 0.875 of the allocator on cpu:0 when the output was taken as ``h``'s node, whose readers are none."""
    torch.manual_seed(0)
    _pinned_against_allocator(OutputWrittenInPlace(), torch.randn(12, 6, 32), {"a": "cpu:0", "c": "cpu:1"}, trace)


class _CloneWritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = nn.Linear(64, 96), nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.l0(x)
        c = h.clone()
        c.relu_()
        return h, c, self.l1(c)


class _Mix(nn.Module):
    def forward(self, h: torch.Tensor, c: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
        return torch.lerp(conv, h, 0.3) * c


class CloneWrittenSentOn(nn.Module):
    """``c = h.clone(); c.relu_()``; ``h``, ``c`` and a conv of ``c`` are read on the next device. ``c``'s gradient
    comes back from there before ``h``'s: the clone hands it on to ``h`` only at its own backward, so the two are
    tensors apart until then (0.82 of the allocator on cpu:0 when the clone's was taken to be made at the
    ``relu_``'s backward, the first reader of ``c`` in the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _CloneWritten(), _Mix()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(*self.a(x))


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_clone_written_in_place_gets_its_gradient_from_the_readers_of_the_write(trace: str) -> None:
    torch.manual_seed(0)
    _pinned_against_allocator(CloneWrittenSentOn(), torch.randn(12, 8, 64), {"a": "cpu:0", "b": "cpu:1"}, trace)


class StackBesideSent(nn.Module):
    """``v`` is read on another device (``mean``, ``mul``) and by ``stack`` beside it, on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l0(x)
        s = torch.softmax(x @ h.transpose(-1, -2) / 8.0, dim=-1)
        v = torch.matmul(s, x).permute(0, 2, 1)
        return torch.stack([v, v * v.mean(-1, keepdim=True)])


def _placed_against_allocator(
    model: nn.Module, x: torch.Tensor, away: set[str], training: bool = True
) -> ActivationProfile:
    """Split ``model`` with the ops named in ``away`` on cpu:1 and the rest on cpu:0 (out of stage order, as the
    partitioner may place them); the simulation of that placement covers the allocator on each device, within 2%
    (``training``: forward and backward, else the forward under ``no_grad``)."""
    traced = trace(model, example_inputs=(x,), mode="fx")
    costs = build_problem(traced.graph_module, model, device_index={"cpu:0": 0, "cpu:1": 1})
    names = costs.problem.op_names
    profile = profile_activations(traced.graph_module, costs, training=training)
    assert profile is not None
    solution = Partition(tuple(1 if name in away else 0 for name in names), 0, (0, 0))
    budgets = Budgets({"cpu:0": 1 << 30, "cpu:1": 1 << 30})
    made = make_plan(
        costs, traced.graph_module, solution, budgets, output_device=None, trace="fx", objective="min_transfer"
    )
    simulated = simulate(profile, [made.placement[name] for name in names], {"x": "cpu:0"}, made.output_device)
    move_weights(traced.graph_module, made, costs.weights + costs.unused)
    split = emit(traced.graph_module, made)
    for parameter in split.parameters():
        parameter.grad = None
    with torch.set_grad_enabled(training):
        allocated = allocated_peaks(split, x, backward=training)
    for device in ("cpu:0", "cpu:1"):
        planned = max(simulated.forward[device], simulated.backward.get(device, 0))
        assert allocated[device] - 64 <= planned <= allocated[device] * 1.02, (device, simulated, allocated)
    return profile


def test_a_sum_into_a_view_of_stacks_gradient_made_where_the_value_lives() -> None:
    """``stack``'s backward hands its gradient to both inputs as views of one tensor; the multiply's gradient for
    ``v`` is added to ``v``'s view out of place. With the multiply on another device, that sum is made on ``v``'s
    device as the copy's gradient comes home: the meter took the view for the multiply's own (the storage's last
    recipient) and recorded no sum (0.857 of the allocator on cpu:0, found by the random-graph fuzzer)."""
    torch.manual_seed(0)
    profile = _placed_against_allocator(StackBesideSent().train(), torch.randn(16, 8, 64), {"softmax", "mean", "mul"})
    names = profile.op_names
    assert profile.foreign_sums.get(names.index("mul")) == {names.index("permute"): 16 * 8 * 64 * 4}


class WrittenAfterSent(nn.Module):
    """``t`` is read on another device, then written in place through a slice, then read there again."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.tanh(x)
        d = F.dropout(t, 0.1)
        t[..., 58:98].add_(0.5)
        h = self.l0(x)
        c = h.clone()
        return torch.softmax(t, dim=-1) + d + c.sum()


def test_a_value_written_after_it_was_copied_is_copied_again_and_lives_until_then() -> None:
    """The generated code copies ``t`` to cpu:1 again after the write; ``t`` stays on cpu:0 until that copy (the
    simulation reused the first copy and freed ``t`` at the write: 0.80 of the allocator on cpu:0 here, 0.83 in
    the training run where the random-graph fuzzer found it)."""
    torch.manual_seed(0)
    model, x = WrittenAfterSent().eval(), torch.randn(8, 16, 128)
    _placed_against_allocator(model, x, {"dropout", "softmax", "add"}, training=False)


class _WrittenWithGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = (x * 0.5).mul_(self.l0(x))
        return m, torch.relu(self.l1(m))


class _Sinks(nn.Module):
    def forward(self, m: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return r.mean() + m.mean()


class GradientWrittenIn(nn.Module):
    """``m = (x * 0.5).mul_(l0(x))``: ``x * 0.5`` needs no gradient, the write makes ``m`` need one. ``m`` is read
    on the next device too, whose gradient comes back to ``m``'s storage (counted as needing none: 0.889 of the
    allocator on the device of ``m``, found on a random graph reducing every value with ``sum`` and ``mean``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _WrittenWithGrad(), _Sinks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(*self.a(x))


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_storage_written_with_a_value_needing_a_gradient_gets_one(trace: str) -> None:
    torch.manual_seed(0)
    _pinned_against_allocator(GradientWrittenIn(), torch.randn(24, 64), {"a": "cpu:0", "b": "cpu:1"}, trace)


class _ItemSentOn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(96, 10)

    def forward(self, q: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out(h).mean(), q.chunk(2, dim=2)[0]


class ItemBesideADroppedReader(nn.Module):
    """``q``, an item of ``chunk(h)``, is read on another device by an op whose result is returned: its gradient
    comes home from there early and waits until ``chunk``'s backward. ``p``, the other item, is read only by a
    convolution whose result the model drops, which sends no gradient; when it counted as one that does, ``chunk``
    looked like a view of all of ``h`` and ``q``'s gradient did not wait (0.914 of the allocator)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(128, 96, bias=False), nn.Linear(96, 96)
        self.conv, self.tail = nn.Conv1d(6, 16, 3, padding=1), _ItemSentOn()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        p, q = h.chunk(2, dim=2)
        self.conv(p)  # dropped: no gradient reaches it
        return self.tail(q, self.b(h))


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_an_op_whose_result_is_dropped_sends_no_gradient(trace: str) -> None:
    torch.manual_seed(0)
    pins = {"a": "cpu:0", "b": "cpu:0", "conv": "cpu:0", "tail": "cpu:1"}
    _pinned_against_allocator(ItemBesideADroppedReader(), torch.randn(8, 6, 128), pins, trace)


class SliceBesideStackedWhole(nn.Module):
    """``h`` is returned whole through ``stack([h])``, whose backward hands the loss's gradient on as ``h``'s from the
    start; the gradient of ``h.narrow(...)`` from the scores waits beside it until the narrow's backward (0.907 of the
    allocator when the whole gradient was taken to arrive only at the stack's backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.l0(x)
        v = h.narrow(1, 0, 2)
        whole = torch.stack([h], dim=1)
        w = v * v.mean(-1, keepdim=True)
        scores = torch.softmax(w @ v.transpose(-1, -2) / 8.0, dim=-1)
        a, b = torch.chunk(scores, 2, dim=2)
        out = torch.unbind(b, dim=1)[0] + 1.0
        out.relu_()
        return F.mse_loss(out, torch.zeros_like(out)), out, whole, a


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_slice_waits_beside_a_whole_gradient_handed_on_from_an_output(trace: str) -> None:
    torch.manual_seed(0)
    _pinned_against_allocator(SliceBesideStackedWhole(), torch.randn(4, 4, 32), {"l0": "cpu:0"}, trace)


class SliceBesideItsSiblingInACat(nn.Module):
    """``cat([l1(v), v[..., 3:48]])``: the ``cat``'s backward hands each input a view of its gradient; the slice's
    backward then makes ``v``'s gradient anew, a tensor apart from the ``cat``'s, which ``l1``'s part keeps alive until
    ``l1``'s backward (0.93 of the allocator when the two were counted as one tensor: the random program 30705)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = nn.Linear(64, 64), nn.Linear(64, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = torch.relu(self.l0(x)) * 2
        return torch.cat([self.l1(v), v[..., 3:48]], dim=-1)


@pytest.mark.parametrize("trace", ["fx", "export"])
@pytest.mark.parametrize("pins", [{"*": "cpu:0"}, {"l0": "cpu:0", "l1": "cpu:1"}], ids=["one", "two"])
def test_a_slices_new_gradient_waits_beside_the_cat_gradient_its_sibling_holds(
    pins: dict[str, str], trace: str
) -> None:
    torch.manual_seed(0)
    _pinned_against_allocator(SliceBesideItsSiblingInACat(), torch.randn(16, 12, 64), pins, trace)


class ReturnedAndFlattenedIntoALoss(nn.Module):
    """``v`` is returned and read by the loss through ``v.view(...)``; export's ``mse_loss`` reads the view through
    the items of ``broadcast_tensors``. The view's gradient is made at the loss's backward and waits beside ``v``'s
    from the start (0.833 of the allocator under export when it was taken as made at ``broadcast_tensors``')."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.l(x)
        flat = v.view(8, -1)
        return F.mse_loss(flat, torch.zeros_like(flat)), v


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_views_gradient_is_made_where_the_op_reading_it_through_items_runs_backward(trace: str) -> None:
    torch.manual_seed(0)
    _pinned_against_allocator(ReturnedAndFlattenedIntoALoss(), torch.randn(8, 16, 64), {"l": "cpu:0"}, trace)


class _SumBesideCat(nn.Module):
    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([v + v * v, v], dim=-1)


class CopySummedWhereItIsRead(nn.Module):
    """``v`` is copied to cpu:1 and read there by ``cat`` and by an add that hands its gradient on to it: the add's
    backward sums the two out of place on cpu:1, where the copy's gradient waits (0.885 of the allocator there when
    that sum was charged on ``v``'s home)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.tail = nn.Linear(128, 32, bias=False), _SumBesideCat()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.l0(x))


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_sum_into_a_copys_gradient_is_made_where_the_copy_is_read(trace: str) -> None:
    torch.manual_seed(0)
    pins = {"l0": "cpu:0", "tail": "cpu:1"}
    _pinned_against_allocator(CopySummedWhereItIsRead(), torch.randn(12, 6, 128), pins, trace)


class _SplitAndSent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(48, 96)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.l0(x)
        a, b = torch.split(h, 48, dim=2)
        return h, a, b, F.silu(h)


class _ReadsTheParts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return h.permute(0, 2, 1), self.l1(s), torch.addcdiv(b, a, a.abs() + 1.0)


class SplitWholeAndPartsSent(nn.Module):
    """``h``, both halves of ``split(h)`` and ``silu(h)`` are read on the next device. The halves' gradients come
    home first and wait, one tensor each, for ``split``'s backward, beside the one ``h``'s own copy sends home:
    two ``h``-sized tensors, not one (0.818 of the allocator on cpu:0 when a tuple of views covering all of ``h``
    counted as a view of all of it; fuzz seed 20530)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _SplitAndSent(), _ReadsTheParts()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.b(*self.a(x))


class _SplitBesideALinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l2 = nn.Linear(48, 96), nn.Linear(48, 384)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.l0(x)
        a, b = torch.split(h, 48, dim=2)
        return h, a, b, self.l2(x)


class _ScalesThem(nn.Module):
    def forward(self, h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return h.permute(0, 2, 1) * 2, torch.addcdiv(b, a, a.abs() + 1.0), g * 3


class SplitSentBesideABiggerLinear(nn.Module):
    """As :class:`SplitWholeAndPartsSent`, with a larger linear between ``split`` and the cut whose backward is the
    peak: the halves' gradients wait through it beside the one ``h``'s copy (a view, ``permute``, on the other
    device) sends home (0.846 of the allocator on cpu:0 when a view read only elsewhere counted as sending none)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _SplitBesideALinear(), _ScalesThem()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.b(*self.a(x))


@pytest.mark.parametrize("model", [SplitWholeAndPartsSent, SplitSentBesideABiggerLinear])
@pytest.mark.parametrize("trace", ["fx", "export"])
def test_the_items_of_a_split_covering_a_value_wait_apart_from_its_gradient(model: type, trace: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, 48)
    options = {"example_inputs": (x,), "mode": "training", "optimizer": "sgd", "trace": trace}
    budgets = dict.fromkeys(["cpu:0", "cpu:1"], "1GiB")
    gm = fxsplit.fxsplit(model(), budgets, pins={"a": "cpu:0", "b": "cpu:1"}, **options)
    _exact_on_cpu0_covered_on_cpu1(gm, x)


def _sink_graph_split(seed: int) -> tuple[dict[str, int], dict[str, int], dict[str, str]]:
    """The random sink graph of ``seed`` split over 2-3 devices at the first budget (a part of its one-device total)
    that fits: planned and allocated activation peaks, and the placement."""
    model, x, how = sink_graph(seed)
    options = {"example_inputs": (x,), "mode": "training", "optimizer": "sgd", "trace": how}
    total = fxsplit.plan(model, {"cpu:0": 1 << 34}, **options).memory["cpu:0"]["total"]
    for part in (0.6, 0.7, 0.8, 0.9, 1.0):
        try:
            gm = fxsplit.fxsplit(
                sink_graph(seed)[0], {f"cpu:{i}": int(total * part) for i in range(2 + seed % 2)}, **options
            )
            break
        except fxsplit.BudgetError:
            continue
    else:
        raise AssertionError(f"seed {seed}: no budget up to the one-device total fits")
    plan = gm.meta["fxsplit_plan"]
    for parameter in gm.parameters():
        parameter.grad = None
    planned = {d: row["activations_peak"] for d, row in plan.memory.items()}
    return planned, allocated_peaks(gm, x, backward=True), dict(plan.placement)


def test_a_gradient_apart_on_another_device_still_waits_at_home() -> None:
    """Seed 288: ``m`` and ``l1(m)`` are read on the next device by ``cat``, whose gradient is summed there with the
    reductions' (a tensor apart on that device). On ``m``'s own device ``l1``'s gradient for ``m`` still waits
    beside the one ``m``'s copy sends home (0.833 of the allocator when that device's rule dropped it)."""
    planned, allocated, placement = _sink_graph_split(288)
    assert placement["cat"] != placement["mul_"], ("cat no longer runs away from m: pick another seed", placement)
    for device, nbytes in allocated.items():
        assert planned[device] >= nbytes - 64, (device, planned, allocated)


@pytest.mark.parametrize("seed", range(0, 300, 12))
def test_random_graphs_reducing_every_value_are_planned_at_or_above_the_allocator(seed: int) -> None:
    """Random graphs of linears, in-place activations and adds, concatenations, every value reduced with ``sum`` and
    ``mean`` into the loss, over 2-3 devices (seeds 0-299 were 5 below the allocator, 0.83-0.90, before the rule
    for gradients handed on to several values on another device; all 300 are at or above it now)."""
    planned, allocated, _ = _sink_graph_split(seed)
    for device, nbytes in allocated.items():
        if device != "?":  # bytes the meter could not place on a device
            assert planned.get(device, 0) >= nbytes - 64, (device, planned, allocated)


def _program_split(seed: int) -> tuple[dict[str, int], dict[str, int]]:
    """The random program of ``seed`` (:mod:`random_programs`) split over 1-3 devices as its seed says: each
    segment pinned, or budgets at a part of the one-device total. Planned and allocated activation peaks."""
    source, segments = generate(seed)
    namespace: dict[str, object] = {"__name__": "program"}
    exec(compile(source, f"<program {seed}>", "exec"), namespace)  # noqa: S102 (our own generated source)
    make = namespace["make"]
    draw = random.Random(seed * 7919 + 13)
    how, count = draw.choice(["fx", "export"]), draw.choice([1, 2, 2, 3, 3])
    devices = [f"cpu:{i}" for i in range(count)]
    pins = None
    if count > 1 and draw.random() < 0.5:
        pins = dict(zip(segments, [devices[k] for k in sorted(draw.randrange(count) for _ in segments)], strict=True))
    part = draw.uniform(0.4, 0.9)
    options = {"mode": "training", "optimizer": "sgd", "trace": how}
    if pins or count == 1:
        budgets = dict.fromkeys(devices, 1 << 34)
    else:
        model, args = make()  # type: ignore[operator]
        total = fxsplit.plan(model, {"cpu:0": 1 << 34}, example_inputs=args, **options).memory["cpu:0"]["total"]
        budgets = {device: int(total * part) for device in devices}
    model, args = make()  # type: ignore[operator]
    gm = fxsplit.fxsplit(model, budgets, example_inputs=args, pins=pins, **options)
    for parameter in gm.parameters():
        parameter.grad = None
    planned = {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}
    return planned, allocated_peaks(gm, *args, backward=True)


KNOWN_UNDER = {  # seed -> why its plan is below the allocator (docs/MEMORY.md, known gaps)
    15507: "relu_ into a narrow view of a value returned from another device: inside CopySlices' backward",
}
PROGRAMS = [  # seeds whose program traces, fits and runs (of 14000-14066), and the known gaps
    *(14000, 14001, 14003, 14004, 14005, 14006, 14007, 14009, 14012, 14013, 14017, 14018, 14019, 14020, 14021),
    *(14023, 14028, 14029, 14031, 14032, 14033, 14037, 14038, 14042, 14045, 14046, 14049, 14051, 14052, 14053),
    15725,  # fx: one tensor read under two node names after an in-place write (0.714 when copied once per name)
    16034,  # an item of chunk beside one read only by a dropped op (0.914 when that op counted as sending a gradient)
    2659,  # a slice beside the whole gradient stack([h]) hands on from an output (0.907 once dropped ops sent none)
    14494,  # SDPA(v, v, v) after an in-place slice write (0.958 before views of views were followed to the sender)
    18648,  # a view read through broadcast_tensors' items by mse_loss (0.833 when its gradient was made at the view)
    19087,  # a sum into a copy's gradient where the copy is read (0.885 when charged on the value's home)
    20530,  # both items of a split read on another device beside the whole (0.818 when they counted as one view)
    30705,  # a slice read by cat on its own device: the slice's backward makes its base's gradient anew (0.931 before)
    *KNOWN_UNDER,
]


@pytest.mark.parametrize(
    "seed",
    [
        pytest.param(s, marks=pytest.mark.xfail(reason=KNOWN_UNDER[s], strict=True)) if s in KNOWN_UNDER else s
        for s in PROGRAMS
    ],
)
def test_random_programs_are_planned_at_or_above_the_allocator(seed: int) -> None:
    """Random training programs (views, slices, tuples, in-place writes, attention, several outputs) over 1-3
    devices, pinned or split by budget: every device's plan covers what the allocator holds (bytes the meter
    cannot place on a device aside). The fuzzer these come from measured 1,188 such programs on this code: 4 below."""
    planned, allocated = _program_split(seed)
    for device, nbytes in allocated.items():
        if device != "?":
            assert planned.get(device, 0) >= nbytes - 64, (device, planned, allocated)


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_an_input_that_needs_a_gradient_gets_it_planned(trace: str) -> None:
    """The gradient backward makes for an example input that requires grad is counted on fx graphs too (their
    shapes pass keeps detached copies of the inputs, so it was left out: 160 B short here)."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.head = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x + self.b(torch.tanh(self.a(x))))

    peaks = {}
    for needs in (False, True):
        torch.manual_seed(0)
        x = torch.randn(5, 8, requires_grad=needs)
        options = {"mode": "training", "optimizer": "sgd", "trace": trace}
        gm = fxsplit.fxsplit(Residual().train(), {"cpu:0": 1 << 20}, example_inputs=(x,), **options)
        planned = gm.meta["fxsplit_plan"].memory["cpu:0"]["activations_peak"]
        assert planned == allocated_peaks(gm, x, backward=True, internal=True)["cpu:0"]
        peaks[needs] = planned
    assert peaks[True] == peaks[False] + 5 * 8 * 4  # x's gradient
