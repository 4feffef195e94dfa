"""A convolution's backward below its forward's rate (``backward_half_map``, ``strided_backward``) and the
documented table of default device speeds, checked against :data:`fxsplit.hardware.DEFAULT_SPEEDS`."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fxsplit.api import trace_and_plan
from fxsplit.cost.compute import Work, op_seconds, op_work
from fxsplit.cost.opwork import conv_stride
from fxsplit.errors import SpecError
from fxsplit.hardware import DEFAULT_SPEEDS, SPEED_KEYS, DeviceSpeed, Hardware

CPU = DEFAULT_SPEEDS["cpu"]
DOCS = Path(__file__).resolve().parent.parent / "docs"


def _work(model: torch.nn.Module, inputs: tuple, trace: str = "fx") -> tuple[list[torch.fx.Node], Work]:
    planned = trace_and_plan(model, {"cpu:0": "1GiB"}, inputs, {"trace": trace, "mode": "weights"})
    ops = list(planned.costs.ops)
    return ops, op_work(planned.traced.graph_module, ops)


class Functional(torch.nn.Module):
    """Convolutions called as functions, stride given by position, by keyword and not at all."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.nn.functional.conv2d(x, self.w, None, 2, 1)
        b = torch.nn.functional.conv2d(x, self.w, None, stride=(1, 3), padding=1)
        c = torch.nn.functional.conv2d(x, self.w, padding=1)
        return a.sum() + b.sum() + c.sum()


def _strides(model: torch.nn.Module, inputs: tuple, trace: str) -> list[float]:
    ops, work = _work(model, inputs, trace)
    assert work.stride is not None and work.positions is not None
    return [float(work.stride[i]) for i in range(len(ops)) if work.positions[i] > 0]


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_conv_stride_reads_modules_functions_and_aten(trace: str) -> None:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, stride=2, padding=1),
        torch.nn.Conv2d(8, 8, 1),
        torch.nn.Conv2d(8, 8, 3, stride=(1, 2), padding=1),
    )
    assert _strides(model, (torch.randn(2, 4, 16, 16),), trace) == [2.0, 1.0, 2.0]
    assert _strides(Functional(), (torch.randn(2, 4, 12, 12),), trace) == [2.0, 3.0, 1.0]


@pytest.mark.parametrize("trace", ["fx", "export"])
def test_a_transposed_convolution_and_other_ops_have_no_stride(trace: str) -> None:
    transposed = torch.nn.ConvTranspose2d(4, 4, 2, stride=2)
    model = torch.nn.Sequential(transposed, torch.nn.Flatten(), torch.nn.Linear(1024, 8))
    ops, work = _work(model, (torch.randn(2, 4, 8, 8),), trace)
    assert work.stride is not None and not work.stride.any()
    linear = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    node = next(n for n in linear.graph.nodes if n.op == "call_module")
    assert conv_stride(node, linear.get_submodule(node.target)) == 0.0


def _speed(**changes: float) -> DeviceSpeed:
    """The cpu's speed with products alone counted: no overhead, no memory time."""
    return dataclasses.replace(CPU, overhead=0.0, bandwidth=1e30, fresh_bandwidth=0.0, **changes)


def _backward_seconds(model: torch.nn.Module, inputs: tuple, speed: DeviceSpeed) -> float:
    ops, work = _work(model, inputs)
    conv = [i for i in range(len(ops)) if work.positions is not None and work.positions[i] > 0]
    assert len(conv) == 1
    train = op_seconds(work, speed, training=True)[conv[0]]
    forward = op_seconds(work, speed)[conv[0]]
    assert work.train_flops[conv[0]] > 0
    return float(train - forward)


def test_a_strided_convolutions_backward_takes_one_plus_strided_backward_times_longer() -> None:
    x = torch.randn(2, 16, 12, 12).requires_grad_()
    strided = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 1, stride=2))
    plain = _speed(backward_half_map=0.0, strided_backward=0.0)
    slow = _speed(backward_half_map=0.0, strided_backward=0.6)
    assert _backward_seconds(strided, (x,), slow) == pytest.approx(1.6 * _backward_seconds(strided, (x,), plain))
    unstrided = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 1))
    assert _backward_seconds(unstrided, (x,), slow) == pytest.approx(_backward_seconds(unstrided, (x,), plain))


@pytest.mark.parametrize("size", [3, 6, 12])
def test_backward_half_map_slows_wide_kernels_on_small_maps_only(size: int) -> None:
    x = torch.randn(2, 16, size, size).requires_grad_()
    plain = _speed(backward_half_map=0.0, strided_backward=0.0)
    half = _speed(backward_half_map=9.0, strided_backward=0.0)
    wide = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, padding=1))
    positions = size * size
    ratio = _backward_seconds(wide, (x,), half) / _backward_seconds(wide, (x,), plain)
    assert ratio == pytest.approx((positions + 9.0) / positions)
    pointwise = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 1))  # one kernel position: unaffected
    assert _backward_seconds(pointwise, (x,), half) == pytest.approx(_backward_seconds(pointwise, (x,), plain))


def test_the_forward_and_inference_are_unaffected() -> None:
    x = torch.randn(2, 16, 6, 6)
    ops, work = _work(torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, stride=2, padding=1)), (x,))
    plain = _speed(backward_half_map=0.0, strided_backward=0.0)
    slow = _speed(backward_half_map=9.0, strided_backward=0.6)
    assert (op_seconds(work, plain) == op_seconds(work, slow)).all()


def test_the_new_keys_parse_roundtrip_and_default_per_kind() -> None:
    hw = Hardware.coerce({"devices": {"cpu": {"backward_half_map": 4, "strided_backward": 0.25}}})
    speed = hw.speed("cpu:1")
    assert (speed.backward_half_map, speed.strided_backward) == (4.0, 0.25)
    assert Hardware.coerce({"devices": {"cpu": speed.to_dict()}}).speed("cpu:0") == speed
    assert (CPU.backward_half_map, CPU.strided_backward) == (9.0, 0.6)  # measured on one core: docs/TIME.md
    for kind in ("cuda", "other"):  # not measured there: none
        assert (DEFAULT_SPEEDS[kind].backward_half_map, DEFAULT_SPEEDS[kind].strided_backward) == (0.0, 0.0)
    for key in ("backward_half_map", "strided_backward"):
        with pytest.raises(SpecError, match=key):
            Hardware.coerce({"devices": {"cpu": {key: -1}}})


def _number(cell: str) -> float:
    """A table cell as a number in the units of :class:`DeviceSpeed`: '50 G (one core)' -> 5e10, '5 µs' -> 5e-6."""
    match = re.match(r"\s*([\d.]+)\s*(T|G|TB/s|GB/s|µs)?", cell)
    assert match, cell
    scale = {None: 1.0, "T": 1e12, "G": 1e9, "TB/s": 1e12, "GB/s": 1e9, "µs": 1e-6}[match.group(2)]
    return float(match.group(1)) * scale


def test_the_documented_default_speeds_are_the_defaults() -> None:
    """docs/TIME.md's table of defaults, row by row and column by column, is what fxsplit.hardware holds."""
    text = (DOCS / "TIME.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = next(line for line in lines if "peak FLOP/s" in line)
    columns = [cell.strip().strip("`") for cell in header.strip("|").split("|")]
    fields = {"peak FLOP/s": "flops", "memory bandwidth": "bandwidth", "per op": "overhead"}
    keys = [fields.get(column, column) for column in columns[1:]]
    assert set(keys) == set(SPEED_KEYS), "a speed the table does not show, or a column no speed has"
    rows = {line.split("|")[1].strip().split()[0].strip("`"): line for line in lines[lines.index(header) + 1 :][:3]}
    assert set(rows) == {"cuda", "cpu", "other"}
    for kind, line in rows.items():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")][1:]
        documented = {key: _number(cell) for key, cell in zip(keys, cells, strict=True)}
        assert documented == pytest.approx(DEFAULT_SPEEDS[kind].to_dict()), kind
