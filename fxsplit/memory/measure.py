"""Measure the activation memory a split module really uses, per logical device, on any device.

:class:`ActivationMeter` is a ``TorchDispatchMode`` that sees every tensor an
ATen op returns, tags it with the device it lives on and counts the bytes of
each new storage until the storage is freed. Logical devices that torch runs
on one CPU (``"cpu:0"``, ``"cpu:1"``) are told apart by the device the
generated code names: a forward op belongs to the device the split module
placed it on (``node.meta["fxsplit_device"]``), a backward op to the device of
the forward op it differentiates (a copy's backward to the copy's source).
Between logical devices a copy's backward (``grad.to(source)``) returns the
very same tensor; the meter clones it on the source device instead, as a
transfer between real devices would (values are unchanged).

What counts: storages created while the meter is on, that are not parameters,
buffers or parameter gradients (``.grad`` of a model tensor at the end) -
that is, activations, copies between devices, saved tensors and the
gradients of activations. Parameters, buffers and inputs made before the
meter started are never counted. Allocations inside a kernel that do not
come back from an ATen op (workspaces) are invisible to it.

It reads high where autograd sums gradients: while any dispatch mode is on,
torch treats every tensor as a subclass (``isTensorSubclassLike``), so a
gradient that arrives for a value read twice is added out of place (a new
tensor) where the unmetered backward adds it in place. The meter then sees
one more activation gradient at that moment than the run makes without it
(seen with torch's profiler on a conv net whose 1x1 convolution reads a
residual add: +2,048 B of 10,752). :mod:`fxsplit.memory.allocmeter` reads
the allocator's own record instead, and changes nothing.

>>> import torch, fxsplit
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
>>> gm = fxsplit.fxsplit(model, {"cpu:0": "24KiB", "cpu:1": "24KiB"}, example_inputs=(torch.randn(8, 64),),
...                      mode="inference")
>>> measure_forward(gm, torch.randn(8, 64))  # input copy + linear; linear + relu | copy + linear
{'cpu:0': 4096, 'cpu:1': 4096}
>>> {d: row["activations_peak"] for d, row in gm.meta["fxsplit_plan"].memory.items()}  # the estimate
{'cpu:0': 4096, 'cpu:1': 4096}
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fxsplit.codegen.meta import COPY_META, DEVICE_META, CopyRecord
from fxsplit.eagermode import EagerDispatchMode
from fxsplit.memory.seed import seeds
from fxsplit.runtime import ReplicaStore

__all__ = ["ActivationMeter", "flat_inputs", "measure_forward", "measure_training"]

UNTAGGED = "?"


class ActivationMeter(EagerDispatchMode):
    """Track live activation bytes per logical device while a split module runs.

    Use :meth:`run` to run the forward (and, given ``backward``, the backward)
    of a split module; then :meth:`peaks` gives the peak bytes per device.

    Attributes:
        untagged_bytes: bytes of storages whose device could not be told (a
            health check of the measurement: should be 0).
    """

    def __init__(self, split: torch.fx.GraphModule) -> None:
        super().__init__()
        self.split = split
        plan = split.meta["fxsplit_plan"]
        self._resident: set[StorageWeakRef] = set()
        replicas = [copy for m in split.modules() if isinstance(m, ReplicaStore) for _, copy in m.held.values()]
        for tensor in [*split.parameters(), *split.buffers(), *replicas]:  # replicas: weights, not activations
            self._resident.add(StorageWeakRef(tensor.untyped_storage()))
        self._live: dict[StorageWeakRef, tuple[str, int]] = {}
        self.events: list[tuple[str, StorageWeakRef, str, int]] = []
        self._current: str | None = None
        self._backward_devices: dict[Any, str] = {}
        self._tags: dict[StorageWeakRef, str] = {}
        self._params_by_storage = {
            StorageWeakRef(p.untyped_storage()): plan.param_devices.get(n, UNTAGGED)
            for n, p in split.named_parameters(remove_duplicate=False)
        }
        self.untagged_bytes = 0
        self.phase = "forward"
        self._paused = False

    # -- running ---------------------------------------------------------------------------------

    def run(self, *args: Any, backward: Callable[[Any], None] | None = None, **kwargs: Any) -> Any:
        """Run ``split(*args, **kwargs)`` node by node under the meter; then ``backward(outputs)`` if given.

        Returns the flat list of the graph's outputs.
        """
        flat = flat_inputs(self.split, args, kwargs)
        for tensor in tree_leaves(flat):
            if isinstance(tensor, torch.Tensor):  # the caller's inputs are not activations
                self._resident.add(StorageWeakRef(tensor.untyped_storage()))
        with self:
            outputs = _Runner(self.split, self).run(*flat)
            self._sweep()
            if backward is not None:
                self.phase = "backward"
                backward(outputs)
                self._sweep()
        return outputs

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Tensors made inside this block are never counted (e.g. a loss's gradients)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def peaks(self, phase: str | None = None) -> dict[str, int]:
        """Peak live bytes per device, excluding storages that ended as a parameter's ``.grad``.

        Args:
            phase: ``"forward"``, ``"backward"`` or None for both.
        """
        grads = {StorageWeakRef(p.grad.untyped_storage()) for p in self.split.parameters() if p.grad is not None}
        live: dict[str, int] = defaultdict(int)
        peak: dict[str, int] = defaultdict(int)
        for event_phase, key, device, delta in self.events:
            if key in grads:
                continue
            live[device] += delta
            if phase is None or event_phase == phase:
                peak[device] = max(peak[device], live[device])
        return dict(peak)

    # -- the dispatch mode -----------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self._sweep()
        out = func(*args, **kwargs)
        if self._paused:
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self._resident.add(StorageWeakRef(tensor.untyped_storage()))
            return out
        self._sweep()
        device = self._device_of(func, args, kwargs)
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._register(tensor, device)
        return out

    def _device_of(self, func: Any, args: Any, kwargs: Any) -> str:
        if self.phase == "forward" and self._current is not None:
            return self._current
        node = torch._C._current_autograd_node()
        if node is not None and node in self._backward_devices:
            return self._backward_devices[node]
        for tensor in tree_leaves((args, kwargs)):
            if isinstance(tensor, torch.Tensor):
                tag = self._tags.get(StorageWeakRef(tensor.untyped_storage()))
                if tag is None:
                    tag = self._params_by_storage.get(StorageWeakRef(tensor.untyped_storage()))
                if tag is not None:
                    return tag
        return UNTAGGED

    def _register(self, tensor: torch.Tensor, device: str) -> None:
        key = StorageWeakRef(tensor.untyped_storage())
        if key in self._resident or key in self._live:
            return
        nbytes = tensor.untyped_storage().nbytes()
        self._live[key] = (device, nbytes)
        self._tags[key] = device
        self.events.append((self.phase, key, device, nbytes))
        if device == UNTAGGED:
            self.untagged_bytes += nbytes

    def _sweep(self) -> None:
        for key in [k for k in self._live if k.expired()]:
            device, nbytes = self._live.pop(key)
            self._tags.pop(key, None)
            self.events.append((self.phase, key, device, -nbytes))

    # -- devices of backward ops -----------------------------------------------------------------

    def _after_node(self, node: torch.fx.Node, value: Any) -> None:
        """Remember which device the autograd nodes created by ``node`` belong to."""
        device = node.meta.get(DEVICE_META)
        copy: CopyRecord | None = node.meta.get(COPY_META)
        source = copy.source if copy is not None else None
        if source is not None:
            device = source  # a copy's backward sends the gradient back to the source
        if device is None:
            return
        for tensor in tree_leaves(value):
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                if source is not None and tensor.grad_fn not in self._backward_devices:
                    tensor.grad_fn.register_hook(self._arrived)
                self._claim(tensor.grad_fn, device)

    def _arrived(self, grad_inputs: Any, grad_outputs: Any) -> Any:
        """A copy's backward ran: make the gradient a new tensor on the source device, as a real copy is.

        Between logical devices of one CPU ``grad.to(source)`` returns the
        same tensor, which may still serve as another gradient on the
        device it came from (an add's backward hands one tensor to both
        inputs); a real transfer leaves that one where it was.
        """
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in grad_inputs)

    def _claim(self, grad_fn: Any, device: str) -> None:
        stack = [grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn in self._backward_devices:
                continue
            self._backward_devices[fn] = device
            stack.extend(next_fn for next_fn, _ in fn.next_functions)


class _Runner(torch.fx.Interpreter):
    """Runs the split graph node by node, telling the meter which device each node is on."""

    def __init__(self, split: torch.fx.GraphModule, meter: ActivationMeter) -> None:
        super().__init__(split, garbage_collect_values=True)
        self.meter = meter
        # The Interpreter frees a value after its last user; a value nobody reads
        # (``mul = a * 2;  mul = None`` in the generated code) it would keep to the
        # end, counting bytes the real forward frees at once.
        for node in split.graph.nodes:
            if not node.users and node.op != "output":
                self.user_to_last_uses.setdefault(node, []).append(node)

    def run_node(self, n: torch.fx.Node) -> Any:
        copy: CopyRecord | None = n.meta.get(COPY_META)
        self.meter._current = copy.destination if copy is not None else n.meta.get(DEVICE_META)
        value = super().run_node(n)
        if n.op not in ("placeholder", "output"):
            self.meter._after_node(n, value)
        self.meter._current = None
        return value


def flat_inputs(split: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The values of the graph's placeholders for ``split(*args, **kwargs)`` (defaults filled in)."""
    bound = inspect.signature(split.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    names, values = list(bound.arguments), list(bound.arguments.values())
    codegen = split.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if info is None:
        return values
    from torch.fx._pytree import tree_flatten_spec

    spec = info.in_spec
    if spec.type is tuple and spec.num_children == 2 and spec.child(1).type is dict:
        count = spec.child(0).num_children
        return list(tree_flatten_spec((values[:count], dict(zip(names[count:], values[count:], strict=True))), spec))
    return list(tree_flatten_spec(values, spec))


def measure_forward(split: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> dict[str, int]:
    """Peak activation bytes per device of one forward under ``torch.no_grad()``."""
    meter = ActivationMeter(split)
    with torch.no_grad():
        meter.run(*args, **kwargs)
    return meter.peaks()


def measure_training(split: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> dict[str, int]:
    """Peak activation bytes per device over one forward and backward.

    The gradients of the outputs (ones) count on the outputs' devices until
    the ops that made the outputs have used them, as a loss's backward makes
    them (:mod:`fxsplit.memory.seed`); parameter gradients are not counted.
    Parameters should have no ``.grad`` yet (``zero_grad(set_to_none=True)``).
    """
    meter = ActivationMeter(split)

    def backward(outputs: Any) -> None:
        tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        with meter.paused():
            scalars = seeds(tensors)
            ones = [torch.ones_like(scalar) for scalar in scalars]
        torch.autograd.backward(scalars, ones)

    with torch.enable_grad():
        meter.run(*args, backward=backward, **kwargs)
    return meter.peaks()
