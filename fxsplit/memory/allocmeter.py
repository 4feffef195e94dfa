"""Measure a split module's activation memory from the allocator's own record, changing nothing it measures.

:class:`~fxsplit.memory.measure.ActivationMeter` watches ATen ops through a
dispatch mode, and while any dispatch mode is on torch treats every tensor as a
subclass: autograd then sums a value's gradients out of place, and composite
ops such as ``linear`` add a bias out of place, so it sees tensors the
unmetered run never makes. This meter runs the split as it is and reads what
the allocator did from torch's profiler (``profile_memory=True``): every
allocation and free, in order, inside the op that made it.

Each allocation belongs to a logical device: in the forward, the device of the
node it is made under (a copy's destination); in the backward, the device of
the forward op whose autograd node runs (by sequence number; a copy's backward
belongs to its source, and makes a new tensor there, as a real transfer does).
What counts is memory made while the split runs that is not a parameter's
``.grad`` at the end; parameters, buffers and inputs made before are never
seen. The backward starts as a loss's would: each output's gradient is made on
the output's device and freed once the op that made the output has used it
(:mod:`fxsplit.memory.seed`). With ``internal=False`` (the default), an
allocation freed before the end of the top-level op that made it (a kernel's
workspace, a composite op's intermediate) is not counted; with ``internal=True``
everything is, which is what the device really needs at the peak.

>>> import torch, fxsplit
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
>>> gm = fxsplit.fxsplit(model, {"cpu:0": "24KiB", "cpu:1": "24KiB"}, example_inputs=(torch.randn(8, 64),),
...                      mode="inference")
>>> with torch.no_grad():
...     allocated_peaks(gm, torch.randn(8, 64))
{'cpu:0': 4096, 'cpu:1': 4096}
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.fx
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._pytree import tree_leaves

from fxsplit.codegen.meta import COPY_META, DEVICE_META, CopyRecord
from fxsplit.memory.measure import flat_inputs
from fxsplit.memory.seed import seeds

__all__ = ["UNTAGGED", "allocated_peaks"]

UNTAGGED = "?"
_DEVICE = "fxsplit.device="
_UNCOUNTED = "fxsplit.uncounted"
_EVALUATE = "autograd::engine::evaluate_function: "
_WRAPPED_NUMBER = 16  # bytes of the largest 0-dim tensor Python wraps a number in (complex128)


def allocated_peaks(
    split: torch.fx.GraphModule, *args: Any, backward: bool = False, internal: bool = False, **kwargs: Any
) -> dict[str, int]:
    """Peak activation bytes per logical device of one forward of ``split`` (and, with ``backward``, its backward
    from ones at the outputs that need a gradient), as the allocator made them.

    Parameters should have no ``.grad`` yet. Bytes the meter could not place on a device are under ``"?"``.
    """
    runner = _Runner(split)
    flat = flat_inputs(split, args, kwargs)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        outputs = runner.run(*flat)
        if backward:  # the outputs' gradients, as a loss's backward makes them, count where the outputs are
            tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
            with record_function(_UNCOUNTED):
                scalars = seeds(tensors)
                ones = [torch.ones_like(scalar) for scalar in scalars]
            for scalar, tensor in zip(scalars, tensors, strict=True):
                runner.devices[scalar.grad_fn._sequence_nr()] = runner.held_on.get(id(tensor), UNTAGGED)  # type: ignore[union-attr]
            torch.autograd.backward(scalars, ones)
        del outputs
    kept = {p.grad.untyped_storage().data_ptr() for p in split.parameters() if p.grad is not None}
    return _peaks(prof.profiler.kineto_results.experimental_event_tree(), runner.devices, kept, internal)


class _Runner(torch.fx.Interpreter):
    """Runs the split node by node under a profiler range naming the node's device; remembers the device of each
    autograd node the forward makes (by sequence number)."""

    def __init__(self, split: torch.fx.GraphModule) -> None:
        super().__init__(split, garbage_collect_values=True)
        self.devices: dict[int, str] = {}  # autograd sequence number -> device
        self.held_on: dict[int, str] = {}  # id of a tensor the split made -> its device
        for node in split.graph.nodes:  # a value nobody reads is freed at once, as the generated code does
            if not node.users and node.op != "output":
                self.user_to_last_uses.setdefault(node, []).append(node)

    def run_node(self, n: torch.fx.Node) -> Any:
        copy: CopyRecord | None = n.meta.get(COPY_META)
        device = copy.destination if copy is not None else n.meta.get(DEVICE_META)
        if device is None or n.op in ("placeholder", "output"):
            return super().run_node(n)
        with record_function(_DEVICE + str(device)):
            value = super().run_node(n)
        for tensor in tree_leaves(value):
            if isinstance(tensor, torch.Tensor):
                self.held_on[id(tensor)] = str(device)
        source = copy.source if copy is not None else None
        for tensor in tree_leaves(value):
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                self._claim(tensor.grad_fn, source or str(device), copied=source is not None)
        return value

    def _claim(self, grad_fn: Any, device: str, copied: bool) -> None:
        if copied and grad_fn._sequence_nr() not in self.devices:
            grad_fn.register_hook(_arrived)  # a copy's backward sends a new tensor to the source
        stack = [grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn._sequence_nr() in self.devices or type(fn).__name__ == "AccumulateGrad":
                continue
            self.devices[fn._sequence_nr()] = device
            stack.extend(next_fn for next_fn, _ in fn.next_functions)


def _arrived(grad_inputs: Any, grad_outputs: Any) -> Any:
    """Between logical devices ``grad.to(source)`` returns the very tensor; a real transfer makes a new one."""
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in grad_inputs)


def _allocations(roots: Any, devices: dict[int, str]) -> Iterator[tuple[int, int, int, str | None, int]]:
    """``(time, ptr, bytes, device, end of its top-level op)`` of every allocation event (``bytes`` < 0: a free);
    device None: not counted.

    Python's argument parser wraps a number in a 0-dim tensor before the op runs (the 8.0 of ``x / 8.0``, which
    autograd may keep for the backward): a host scalar on every device, not counted. Such an allocation is one a
    forward node makes outside its ops of at most 16 bytes (a complex128's); ``torch.tensor(...)`` allocates inside
    an op, and the generator state a checkpoint stashes outside any (host memory too, which the plan counts on the
    device) is kilobytes."""
    stack: list[tuple[Any, str | None, int | None, bool]] = [(root, UNTAGGED, None, False) for root in reversed(roots)]
    while stack:
        event, device, top_end, in_node = stack.pop()
        kind = str(event.typed[0]).rpartition(".")[2]
        if kind == "Allocation":
            fields = event.typed[1]
            host = in_node and top_end is None and 0 < fields.alloc_size <= _WRAPPED_NUMBER
            yield (
                event.start_time_ns,
                fields.ptr,
                fields.alloc_size,
                None if host else device,
                top_end or event.start_time_ns,
            )
            continue
        name, context = event.name, False
        if name.startswith(_DEVICE):
            device, context, in_node = name[len(_DEVICE) :], True, True
        elif name == _UNCOUNTED:
            device, context, in_node = None, True, False
        elif name.startswith(_EVALUATE):
            device, context, in_node = devices.get(event.typed[1].sequence_number, UNTAGGED), True, False
        if context:
            top_end = None
        elif kind == "TorchOp" and top_end is None:
            top_end = event.end_time_ns
        stack.extend((child, device, top_end, in_node) for child in reversed(event.children))


def _peaks(roots: Any, devices: dict[int, str], kept: set[int], internal: bool) -> dict[str, int]:
    events = sorted(_allocations(roots, devices), key=lambda e: e[0])
    frees: dict[int, list[int]] = {}
    for time, ptr, nbytes, _, _ in events:
        if nbytes < 0:
            frees.setdefault(ptr, []).append(time)
    live: dict[int, tuple[str, int]] = {}
    totals: dict[str, int] = {}
    peaks: dict[str, int] = {}
    for time, ptr, nbytes, device, top_end in events:
        if nbytes > 0:
            freed = next((t for t in frees.get(ptr, ()) if t >= time), None)
            if (
                device is None
                or (freed is None and ptr in kept)
                or (not internal and freed is not None and freed <= top_end)
            ):
                continue
            live[ptr] = (device, nbytes)
            totals[device] = totals.get(device, 0) + nbytes
            peaks[device] = max(peaks.get(device, 0), totals[device])
        elif ptr in live:
            device, size = live.pop(ptr)
            totals[device] -= size
    return dict(sorted(peaks.items()))
