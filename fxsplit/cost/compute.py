"""What each op of a traced graph computes: FLOPs and bytes moved, from the shapes the trace recorded.

Shapes come from ``node.meta["val"]`` (fake tensors, so a model on ``meta``
is estimated like any other). FLOPs, per op:

* ATen ops (torch.export graphs): torch's own FLOP formulas
  (``torch.utils.flop_counter``'s registry: matmuls, convolutions, attention);
* torch.fx ops: matrix products (``linear``, ``matmul``, ``bmm``, ``addmm``,
  ``nn.Linear``), convolutions (functional and ``nn.Conv*``) and
  ``scaled_dot_product_attention`` by their formulas; an embedding lookup 0;
  another module with parameters 2 FLOPs per parameter per row of its output;
* anything else (elementwise ops, norms, reductions): one FLOP per output
  element.

Bytes moved: the tensors an op reads (its inputs, and a module's own
parameters) and writes; an embedding lookup reads only the rows it returns.
Views, ``getitem`` and other ops that make no new tensor cost nothing.
:func:`op_seconds` turns the work into seconds on a device
(:class:`~fxsplit.hardware.DeviceSpeed`: a roofline plus a cost per op).

What a training step adds per op (``Work.train_flops`` / ``train_nbytes``), from what autograd runs:

* a product computes one gradient per operand that requires one, each about
  the forward's FLOPs and bytes: a layer's first product, reading the model's
  input, computes its weight's gradient only; two activations multiplied
  (attention) both;
* an op that reads trainable weights adds their gradient to ``.grad`` every
  micro-batch, a memory-bound kernel of its own (``grad_nbytes``: the weights'
  bytes read twice and written once), on top of the kernels that compute it.
  An embedding's gradient is dense, the whole table
  (``embedding_dense_backward``: the table written as zeros, then the rows
  added), however few rows the lookup read;
* batch norm in training: the device's ``norm_passes`` passes over its input beyond the forward's
  read and write: 7 by memory traffic (the batch's mean and variance; the output's gradient and the
  input read for two reductions, then again, the input's gradient written); 14 on ``cpu``, whose
  loops run below the bandwidth (ResNet-50's 53 batch norms: 183 ms, about 16 passes at 10 GB/s);
* any other op: its forward again (its input's gradient from its output's).

Products run below the peak when a dimension is small (:meth:`Work.rate`, with the device's
``half_reduction``, ``half_map`` and ``half_channels``: 0, the peak, except on ``cpu``: 40, 2 and 8,
measured on one core):

* a short reduction (``K``: a matrix product's inner size, a convolution's
  input channels times its kernel) gives each output few multiply-adds for
  its load and store: ``K / (K + half_reduction)`` of the peak. ResNet-50's
  1x1 convolutions of 64 input channels ran at 38-55 GFLOP/s on one core,
  its 3x3 ones (K 576-2304) at 71-79;
* a convolution's kernels block over an image's output positions ``P``:
  ``P / (P + half_map)``. ResNet-50's ``layer4`` convolutions, on 3x3
  maps, ran at 50-57 GFLOP/s against 65-78 on 6x6 and larger maps;
* a convolution over few input channels ``C`` (per group): ``C / (C + half_channels)``.
  ResNet-50's first convolution, over an image's 3 channels, ran at about
  0.27x the rate of its others on one core (a later machine's, whose 3x3
  convolutions ran near 190 GFLOP/s).

In training a convolution's backward (two products of its forward's FLOPs) runs below its forward's rate
(:meth:`Work.backward_rate`; ``cpu``'s figures from ResNet-50's, micro-batch 16 at 96x96, on one core):
``P / (P + backward_half_map)`` of it for a kernel over more than one position (``layer4``'s 3x3 ones, on
3x3 maps, took 0.64-1.06 of their forward's time per FLOP against ~0.55 for the others; ``backward_half_map``
9), and ``1 + strided_backward`` times longer for a strided one (its 1x1 stride-2 downsamples: 0.77-1.16;
``strided_backward`` 0.6). Both are 0 (none) elsewhere.

Tensors above :data:`FRESH_ABOVE` (32 MiB) get fresh memory every time on a CPU:
the device's ``fresh_bandwidth`` (2 GB/s on ``cpu``, 0 elsewhere) charges the
forward's outputs and, in training, the weight gradients of that size (an
embedding's dense table of zeros: 154 MB for GPT-2, 47 ms fresh against 4 ms
zeroed in place on one core).

Which values require a gradient follows the whole graph: those computed from a
trainable parameter; the model's inputs and buffers do not.

>>> import torch, torch.fx
>>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()))
>>> from torch.fx.passes.shape_prop import ShapeProp
>>> _ = ShapeProp(gm).propagate(torch.randn(8, 64))
>>> work = op_work(gm, [n for n in gm.graph.nodes if n.op == "call_module"])
>>> work.flops.tolist(), work.nbytes.tolist()  # 2*8*64*32; 8*32; bytes: x + weight + bias + out, in + out
([32768.0, 256.0], [11392.0, 2048.0])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.fx

from fxsplit.cost.opwork import (
    LOOKUP_MODULES,
    LOOKUPS,
    bytes_moved,
    conv_stride,
    flops_of,
    is_batch_norm,
    is_free,
    is_product,
    numel,
    op_name,
    operands,
    product_sizes,
    value_of,
)
from fxsplit.hardware import DeviceSpeed
from fxsplit.tracing.dynamic import DataDependentSize
from fxsplit.tracing.graphinfo import element_size, value_bytes

__all__ = ["FRESH_ABOVE", "WEIGHT_GRADIENT_PASSES", "Work", "op_seconds", "op_work"]

WEIGHT_GRADIENT_PASSES = 3.0  # adding a weight's gradient to .grad: both read, the sum written
FRESH_ABOVE = 32 * 2**20  # glibc's largest mmap threshold: larger blocks are mapped anew on every allocation


@dataclass(frozen=True)
class Work:
    """FLOPs and bytes moved per op, in the order of the ops given.

    Attributes:
        flops: floating-point operations per op.
        nbytes: bytes each op reads and writes.
        free: True for ops that make no new tensor (views, ``getitem``): they cost no time.
        products: True for ops whose FLOPs are products (matmuls, convolutions, attention, their modules).
        train_flops: FLOPs a training step adds to the forward's (the backward; see the module's notes).
        train_nbytes: bytes a training step adds in the kernels of the backward (and batch statistics).
        grad_nbytes: bytes of adding weight gradients to ``.grad`` (and an embedding's dense gradient's zeros).
        reduction: a product's reduction length ``K`` (0: not a product), for the device's efficiency.
        positions: a convolution's output positions per image (0: not a convolution).
        channels: a convolution's input channels per group (0: not a convolution).
        stride: a convolution's largest stride (1: none; 0: not a convolution).
        norm_nbytes: a batch norm's output bytes, read and written ``norm_passes`` times more in training.
        fresh_nbytes: bytes of the tensors the forward makes that are larger than :data:`FRESH_ABOVE` (fresh
            memory at the device's ``fresh_bandwidth``); ``train_fresh_nbytes``: the same for the weight
            gradients a training step makes (an embedding's dense one, a large weight's).
        known: False when the graph had no shapes (every op then counts as one unit of work).
        unsized: the ops whose sizes depend on the values of the data (torch.export's unbacked sizes: the tokens a
            router sends to each expert), which no example input gives: they count no work.
    """

    flops: np.ndarray
    nbytes: np.ndarray
    free: np.ndarray
    products: np.ndarray
    train_flops: np.ndarray
    train_nbytes: np.ndarray
    grad_nbytes: np.ndarray
    reduction: np.ndarray | None = None
    positions: np.ndarray | None = None
    norm_nbytes: np.ndarray | None = None
    fresh_nbytes: np.ndarray | None = None
    train_fresh_nbytes: np.ndarray | None = None
    channels: np.ndarray | None = None
    stride: np.ndarray | None = None
    known: bool = True
    unsized: tuple[int, ...] = ()

    def rate(self, speed: DeviceSpeed) -> np.ndarray:
        """Per op, the FLOP/s it reaches on ``speed``'s device: products with a small dimension below the peak."""
        rate = np.full(len(self.flops), float(speed.flops))
        halves = (
            (self.reduction, speed.half_reduction),
            (self.positions, speed.half_map),
            (self.channels, speed.half_channels),
        )
        for sizes, half in halves:
            if sizes is not None and half > 0:
                rate *= np.where(sizes > 0, sizes / (sizes + half), 1.0)
        return rate

    def backward_rate(self, speed: DeviceSpeed, rate: np.ndarray) -> np.ndarray:
        """Per op, the FLOP/s its backward reaches: the forward's ``rate``, but for a convolution over more than
        one kernel position ``P / (P + backward_half_map)`` of it on maps of ``P`` positions, and for a strided
        one ``1 + strided_backward`` times slower (see the module's notes)."""
        if self.positions is None or self.stride is None or self.reduction is None or self.channels is None:
            return rate
        conv = self.positions > 0
        if speed.backward_half_map > 0:
            wide = conv & (self.reduction > self.channels)  # K = channels x kernel positions
            rate = rate * np.where(wide, self.positions / (self.positions + speed.backward_half_map), 1.0)
        if speed.strided_backward > 0:
            rate = rate / np.where(conv & (self.stride > 1), 1.0 + speed.strided_backward, 1.0)
        return rate


def op_work(graph_module: torch.fx.GraphModule, ops: Sequence[torch.fx.Node], *, dtype: Any = None) -> Work:
    """FLOPs and bytes per op of ``ops`` (nodes of ``graph_module``), from their recorded shapes.

    ``dtype`` (a floating dtype) counts floating tensors as if they had it, as planning with ``dtype=`` does.
    Without shapes every op counts one FLOP and one byte (``known`` False).
    """
    n = len(ops)
    flops, nbytes, free, products = np.zeros(n), np.zeros(n), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    train_flops, train_nbytes, grad_nbytes = np.zeros(n), np.zeros(n), np.zeros(n)
    reduction, positions, norm_nbytes = np.zeros(n), np.zeros(n), np.zeros(n)
    fresh, train_fresh, channels, stride = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    if not any("val" in node.meta or "tensor_meta" in node.meta for node in ops):
        return Work(np.ones(n), np.ones(n), free, products, np.ones(n), np.ones(n), np.zeros(n), known=False)
    modules = dict(graph_module.named_modules())
    grads = _requires_grad(graph_module, modules)
    unsized: list[int] = []
    for index, node in enumerate(ops):
        if is_free(node):
            free[index] = True
            continue
        module = modules.get(str(node.target)) if node.op == "call_module" else None
        try:
            try:
                flops[index] = flops_of(node, module)
            except DataDependentSize:
                raise
            except Exception:  # noqa: BLE001 - a formula that cannot read these shapes: count the op as elementwise
                flops[index] = numel(value_of(node))
            nbytes[index] = bytes_moved(node, module, dtype)
            products[index] = is_product(node, module)
            reduction[index], positions[index], channels[index] = product_sizes(node, module)
            stride[index] = conv_stride(node, module) if positions[index] else 0.0
            train_flops[index], train_nbytes[index], grad_nbytes[index] = _training_work(
                node, module, grads, (flops[index], nbytes[index]), products[index], dtype
            )
        except DataDependentSize:  # a size no example input gives (an expert's tokens): no estimate, said
            flops[index] = nbytes[index] = train_flops[index] = train_nbytes[index] = grad_nbytes[index] = 0.0
            unsized.append(index)
            continue
        if train_flops[index] and is_batch_norm(node, module):
            norm_nbytes[index] = float(value_bytes(node, float_dtype=dtype) or 0)
        fresh[index] = _large([float(value_bytes(node, float_dtype=dtype) or 0)])
        if grad_nbytes[index]:  # it makes weight gradients: each a tensor of its own every micro-batch
            train_fresh[index] = _large(_weight_sizes(node, module, grads, dtype))
    return Work(
        flops,
        nbytes,
        free,
        products,
        train_flops,
        train_nbytes,
        grad_nbytes,
        reduction,
        positions,
        norm_nbytes,
        fresh,
        train_fresh,
        channels,
        stride,
        unsized=tuple(unsized),
    )


def op_seconds(work: Work, speed: DeviceSpeed, *, training: bool = False) -> np.ndarray:
    """Seconds per op on a device of ``speed``: ``overhead + max(flops / peak, bytes / bandwidth)``; 0 for free ops.

    With ``training``, a forward and a backward: the backward a second op, whose roofline is that of
    :attr:`Work.train_flops` and :attr:`Work.train_nbytes`, then :attr:`Work.grad_nbytes` at the bandwidth.
    Tensors too large for the allocator to reuse memory for (:attr:`Work.fresh_nbytes`) add their bytes at the
    device's ``fresh_bandwidth`` (when it has one).
    """
    rate = work.rate(speed)
    roofline = np.maximum(work.flops / rate, work.nbytes / speed.bandwidth)
    forward = np.where(work.free, 0.0, speed.overhead + roofline) + _fresh_seconds(work.fresh_nbytes, speed)
    if not training:
        return forward
    norms = 0.0 if work.norm_nbytes is None else speed.norm_passes * work.norm_nbytes
    products = work.train_flops / work.backward_rate(speed, rate)
    backward = np.maximum(products, (work.train_nbytes + norms) / speed.bandwidth)
    reached = ~work.free & ((work.train_flops > 0) | (work.train_nbytes > 0))
    backward = np.where(reached, speed.overhead + backward, 0.0) + _fresh_seconds(work.train_fresh_nbytes, speed)
    return forward + backward + work.grad_nbytes / speed.bandwidth


def _fresh_seconds(nbytes: np.ndarray | None, speed: DeviceSpeed) -> np.ndarray | float:
    """Seconds to get fresh memory for ``nbytes`` on ``speed``'s device (0 where it reuses its blocks)."""
    if nbytes is None or not speed.fresh_bandwidth:
        return 0.0
    return nbytes / speed.fresh_bandwidth


def _large(sizes: Sequence[float]) -> float:
    """Bytes of the tensors of ``sizes`` larger than :data:`FRESH_ABOVE`."""
    return float(sum(size for size in sizes if size > FRESH_ABOVE))


def _requires_grad(graph_module: torch.fx.GraphModule, modules: dict[str, torch.nn.Module]) -> set[torch.fx.Node]:
    """The nodes whose value takes a gradient in training: floating values computed from a trainable parameter."""
    trainable = {name for name, p in graph_module.named_parameters(remove_duplicate=False) if p.requires_grad}
    found: set[torch.fx.Node] = set()
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            needs = str(node.target) in trainable
        elif node.op == "placeholder" or node.op == "output":
            needs = False
        else:
            module = modules.get(str(node.target)) if node.op == "call_module" else None
            own = module is not None and any(p.requires_grad for p in module.parameters())
            needs = own or any(source in found for source in node.all_input_nodes)
            value = value_of(node)
            dtype = getattr(value, "dtype", None)
            if dtype is not None and not dtype.is_floating_point:
                needs = False
        if needs:
            found.add(node)
    return found


def _weights_bytes(node: torch.fx.Node, module: torch.nn.Module | None, grads: set[torch.fx.Node], dtype: Any) -> float:
    """Bytes of the trainable weights ``node`` reads: a module's own, or parameters it takes as inputs."""
    return float(sum(_weight_sizes(node, module, grads, dtype)))


def _weight_sizes(
    node: torch.fx.Node, module: torch.nn.Module | None, grads: set[torch.fx.Node], dtype: Any
) -> list[float]:
    """Bytes of each trainable weight ``node`` reads."""
    if module is not None:
        return [float(p.numel() * element_size(p.dtype, dtype)) for p in module.parameters() if p.requires_grad]
    sources = [s for s in dict.fromkeys(node.all_input_nodes) if s.op == "get_attr" and s in grads]
    return [float(value_bytes(s, float_dtype=dtype) or 0) for s in sources]


def _training_work(
    node: torch.fx.Node,
    module: torch.nn.Module | None,
    grads: set[torch.fx.Node],
    forward: tuple[float, float],
    product: bool,
    dtype: Any,
) -> tuple[float, float, float]:
    """FLOPs and bytes of the backward's kernels for ``node``, and bytes of adding its weights' gradients."""
    flops, nbytes = forward
    if node not in grads and not any(s in grads for s in node.all_input_nodes):
        return 0.0, 0.0, 0.0  # nothing before it or in it takes a gradient: autograd never reaches it
    weights = _weights_bytes(node, module, grads, dtype)
    accumulate = WEIGHT_GRADIENT_PASSES * weights
    out = float(value_bytes(node, float_dtype=dtype) or 0)
    if isinstance(module, LOOKUP_MODULES) or op_name(node) in LOOKUPS:
        return numel(value_of(node)), 2.0 * out, accumulate + weights  # the rows added into a table of zeros
    if is_batch_norm(node, module):
        return flops, 0.0, accumulate  # its passes over ``out``: the device's ``norm_passes`` (op_seconds)
    if not product:
        return flops, nbytes, accumulate
    if module is not None:
        first = node.args[0] if node.args else None
        count = int(isinstance(first, torch.fx.Node) and first in grads) + int(weights > 0)
    else:
        count = sum(1 for a in operands(node) if isinstance(a, torch.fx.Node) and a in grads)
        if op_name(node) == "scaled_dot_product_attention":
            count = 2 * int(count > 0)  # its backward: about two forwards of matrix products
    return count * flops, count * nbytes, accumulate
