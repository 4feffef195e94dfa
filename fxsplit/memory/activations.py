"""Profile a traced graph's activations: run it once on fake tensors and watch its storages.

:func:`profile_activations` runs the graph node by node on fake tensors (no
data, no compute, no memory: a model on the ``meta`` device works) with the
weights replaced by fakes, and records, per op, which storages its result
holds (so views are told from new tensors exactly, as torch decides), which
storages autograd saves for backward (``saved_tensors_hooks``, in training),
and the peak of the intermediates a composite op makes inside (a dispatch
mode sees every ATen op under it). The result is an
:class:`~fxsplit.memory.lifetimes.ActivationProfile`: plain data that
:mod:`fxsplit.memory.lifetimes` simulates for any placement.

The model and the traced graph are not modified.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any, Iterator

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fxsplit.cost.build import GraphCosts, Weight
from fxsplit.memory.activationprofile import without_dead_gradients
from fxsplit.memory.allocations import Allocations
from fxsplit.memory.fakerun import SDPA, fake_input, fake_weights, fused_attention, inputs_device, slow_path
from fxsplit.memory.graphtensors import graph_tensors, replace_graph_tensors
from fxsplit.memory.lifetimes import ActivationProfile, ValueMemory
from fxsplit.memory.seed import seeds
from fxsplit.planning.build import weights_by_node
from fxsplit.tracing.dynamic import traced_size
from fxsplit.tracing.gradmode import modes_kept
from fxsplit.tracing.keptcheckpoint import checkpoint_of

__all__ = ["graph_tensors", "profile_activations", "replace_graph_tensors"]  # (the first and last: graphtensors)


class _Storages:
    """Stable small ids for storages (weak references keep addresses from being reused)."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.ids: dict[StorageWeakRef, int] = {}
        self.nbytes: dict[int, int] = {}
        self.dtype = dtype

    def key(self, tensor: torch.Tensor) -> int:
        ref = StorageWeakRef(tensor.untyped_storage())
        found = self.ids.get(ref)
        if found is None:
            found = self.ids[ref] = len(self.ids)
            self.nbytes[found] = self.scale(tensor.untyped_storage().nbytes(), tensor.dtype)
        return found

    def scale(self, nbytes: int, dtype: torch.dtype) -> int:
        """Bytes at the example inputs' sizes, as if floating-point tensors had the planning dtype."""
        if self.dtype is None or not dtype.is_floating_point:
            return traced_size(nbytes)
        return traced_size(nbytes) * self.dtype.itemsize // dtype.itemsize

    def value(self, value: Any) -> ValueMemory:
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        keys = tuple(dict.fromkeys(self.key(t) for t in tensors))
        nbytes = sum(self.scale(t.numel() * t.element_size(), t.dtype) for t in tensors)
        return ValueMemory(nbytes, keys, any(t.requires_grad for t in tensors))


class _Recorder(torch.fx.Interpreter):
    def __init__(self, graph_module: torch.fx.GraphModule, storages: _Storages, allocations: Allocations) -> None:
        super().__init__(graph_module)
        self.storages = storages
        self.allocations = allocations
        self.op_index: dict[str, int] = {}
        self.current = -1
        self.results: dict[str, ValueMemory] = {}
        self.internal: dict[int, int] = {}
        self.saved: dict[int, list[int]] = {}
        self.written: dict[str, str] = {}  # an op that writes in place -> the node whose tensor it writes
        self.items: set[int] = set()  # ops that take an item out of a tuple or list
        self.stashes: list[torch.Tensor] = []  # what kept checkpoints hold beside their inputs
        self.recompute_extra: dict[int, int] = {}  # a kept checkpoint -> bytes its backward holds beyond its ops'

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.ops.aten.scaled_dot_product_attention.default or target is SDPA:  # (export, fx)
            fused = fused_attention(args, kwargs)
            if fused is not None:
                return fused
        return super().call_function(target, args, kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = self.op_index.get(n.name, -1)
        if self.current >= 0:
            self._adopt_views(n)
        self.allocations.start()
        value = super().run_node(n)
        if _batched(value):  # inside a vmap region (transformers' masks): a wrapper over a tensor the region's end
            self.results[n.name] = _NOTHING  # returns, which is counted there
            self.allocations.extra()
            self.current = -1
            return value
        if n.op == "placeholder":
            self.results[n.name] = self.storages.value(value)
        if self.current >= 0:
            self.results[n.name] = self.storages.value(value)
            self.internal[self.current] = self.allocations.extra()
            # an op writing into a view gives the view's base a new autograd node (CopySlices): it is this op's
            inputs = [v for v in (self.env.get(a) for a in n.all_input_nodes) if not _batched(v)]
            if n.target is operator.getitem and inputs and isinstance(inputs[0], (tuple, list)):
                self.items.add(self.current)
            bases = [a._base for a in inputs if isinstance(a, torch.Tensor) and a._base is not None]
            self.allocations.claim((value, *bases) if bases else value, self.current)
            if isinstance(value, torch.Tensor):  # in place: it returns the very tensor it read
                written = next((a for a in n.all_input_nodes if self.env.get(a) is value), None)
                if written is not None:
                    self.written[n.name] = written.name
            if (kept := checkpoint_of(n)) is not None:  # held for its backward to recompute from: its inputs
                for held in (self.env.get(a) for a in n.all_input_nodes if a.op != "get_attr"):
                    for tensor in (t for t in tree_leaves(held) if isinstance(t, torch.Tensor)):
                        self.pack(tensor)
                if kept.stashed_bytes():  # and the generator's state, to replay random ops; its backward forks the
                    self.stashes.append(torch.empty(kept.stashed_bytes(), dtype=torch.uint8))  # generator: a copy
                    self.pack(self.stashes[-1])
                    self.recompute_extra[self.current] = kept.stashed_bytes()
        self.current = -1
        return value

    def _adopt_views(self, n: torch.fx.Node) -> None:
        """A view whose base was written in place since it was made gets a new autograd node when next read: still
        the view's op's (else the first op to read it would own it, and an add reading it too would seem to hand
        its gradient on to that op's result)."""
        for node in n.all_input_nodes:
            tensor = self.env.get(node)
            if _batched(tensor):
                continue
            if isinstance(tensor, torch.Tensor) and tensor._base is not None and node.name in self.op_index:
                self.allocations.claim(tensor, self.op_index[node.name], adding=True)

    def backward(self, outputs: Any) -> None:
        """Run the backward as a loss starts it (:mod:`fxsplit.memory.seed`), measuring each op's as one episode."""
        tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        self.allocations.in_backward = True
        torch.autograd.backward(seeds(tensors))
        self.allocations.backward_done()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.current >= 0 and not _batched(tensor):
            self.saved.setdefault(self.current, []).append(self.storages.key(tensor))
            self.allocations.note_saved(self.current, tensor)
        return tensor


def _batched(value: Any) -> bool:
    """Whether ``value`` is a tensor of a ``vmap`` region: a wrapper with no storage of its own."""
    return isinstance(value, torch.Tensor) and torch._C._functorch.is_batchedtensor(value)


_NOTHING = ValueMemory(0, (), False)


def profile_activations(
    graph_module: torch.fx.GraphModule,
    costs: GraphCosts,
    *,
    training: bool,
    dtype: torch.dtype | None = None,
) -> ActivationProfile | None:
    """Storages, reads and saved tensors of every op of ``graph_module``; None without shapes.

    Args:
        graph_module: the traced graph, with ``meta["val"]`` on its inputs.
        costs: its cost model (ops in partition order, weights).
        training: record what autograd saves for backward (weights keep
            their ``requires_grad``); else run under ``torch.no_grad()``.
        dtype: plan floating-point activations as if they had this dtype.
    """
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    if any("val" not in n.meta for n in placeholders):
        return None
    mode = torch._guards.detect_fake_mode([n.meta["val"] for n in placeholders])
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    storages = _Storages(dtype)
    allocations = Allocations(storages.scale)
    recorder = _Recorder(graph_module, storages, allocations)
    recorder.op_index = {op.name: i for i, op in enumerate(costs.ops)}
    from torch.nn.utils.stateless import _reparametrize_module

    with mode:
        fakes = fake_weights(graph_module, mode, training, inputs_device(placeholders))
        inputs = [fake_input(n.meta["val"], mode) for n in placeholders]
    grad = torch.enable_grad() if training else torch.no_grad()
    hooks = torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t)
    with (
        modes_kept(),  # the graph's recorded regions set them (autocast too); an op that raises leaves them set
        mode,
        allocations,
        grad,
        hooks,
        _reparametrize_module(graph_module, fakes, tie_weights=True, strict=False),
        slow_path(),
    ):
        for fake in fakes.values():
            storages.key(fake)
            # a weight is no op's allocation: first read inside an op (after the op's peak, say), it would be
            # taken off that op's intermediates as if it were part of the result
            allocations.seen.add(StorageWeakRef(fake.untyped_storage()))
        outputs = recorder.run(*inputs)
        if training:
            recorder.backward(outputs)
    return _profile(graph_module, costs, recorder, storages, fakes, training)


def _reads(node: torch.fx.Node, by_node: dict[str, list[Weight]]) -> Iterator[str]:
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            yield from (w.names[0] for w in by_node.get(arg.name, ()))
        else:
            yield arg.name
    if node.op == "call_module":
        yield from (w.names[0] for w in by_node.get(node.name, ()))


def _versioned_reads(
    costs: GraphCosts, by_node: dict[str, list[Weight]], values: dict[str, ValueMemory], written: dict[str, str]
) -> tuple[tuple[tuple[str, ...], ...], dict[str, str]]:
    """Per op, the values it reads; a node read after an op wrote its tensor in place (``y.add_(h)`` traced by fx:
    later ops read ``y``'s node) reads that op's version: one value read by several ops, not several reads of one.
    And each written node -> its last version (what the graph's output reads when it returns that node)."""
    origin: dict[str, str] = {}  # a version -> the node that made the tensor
    newest: dict[str, str] = {}  # that node -> the op that wrote it last
    found = []
    for op in costs.ops:
        reads = (newest.get(origin.get(r, r), r) for r in _reads(op, by_node) if r in values)
        found.append(tuple(dict.fromkeys(reads)))
        target = written.get(op.name)
        if target is not None:
            origin[op.name] = first = origin.get(target, target)
            newest[first] = op.name
    return tuple(found), newest


def _profile(
    graph_module: torch.fx.GraphModule,
    costs: GraphCosts,
    recorder: _Recorder,
    storages: _Storages,
    fakes: dict[str, torch.Tensor],
    training: bool,
) -> ActivationProfile:
    by_node = weights_by_node(costs)
    values: dict[str, ValueMemory] = dict(recorder.results)
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    weight_names: set[str] = set()
    attr_targets = {n.name: str(n.target) for n in graph_module.graph.nodes if n.op == "get_attr"}
    for weight in costs.weights:
        targets = [attr_targets[name] for name in weight.nodes if name in attr_targets]
        fake = next((fakes[n] for n in (*weight.names, *targets) if n in fakes), None)
        if fake is not None:
            values[weight.names[0]] = storages.value(fake)
            weight_names.add(weight.names[0])
    reads, newest = _versioned_reads(costs, by_node, values, recorder.written)
    saved: list[tuple[int, ...]] = []
    internal_saved: list[int] = []
    for i, op in enumerate(costs.ops):
        known = {k for name in (*reads[i], op.name) if name in values for k in values[name].storages}
        keys = list(dict.fromkeys(recorder.saved.get(i, ())))
        saved.append(tuple(k for k in keys if k in known))
        internal_saved.append(sum(storages.nbytes[k] for k in keys if k not in known))
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    outputs: list[str] = []
    for arg in output.all_input_nodes:
        names = [w.names[0] for w in by_node.get(arg.name, ())] if arg.op == "get_attr" else [arg.name]
        outputs.extend(newest.get(n, n) for n in names if n in values)  # fx: a node written in place, as written
    if training:  # a result no gradient reaches (dropped by the model) sends none back
        values = without_dead_gradients(tuple(op.name for op in costs.ops), reads, values, tuple(outputs), weight_names)
    returned = Counter(
        newest.get(leaf.name, leaf.name) for leaf in tree_leaves(output.args) if isinstance(leaf, torch.fx.Node)
    )
    return ActivationProfile(
        op_names=tuple(op.name for op in costs.ops),
        reads=reads,
        values=values,
        storage_bytes=dict(storages.nbytes),
        inputs=tuple(n.name for n in placeholders),
        outputs=tuple(dict.fromkeys(outputs)),
        weights=frozenset(weight_names),
        saved=tuple(saved) if training else (),
        internal=tuple(recorder.internal.get(i, 0) for i in range(len(costs.ops))),
        internal_saved=tuple(internal_saved) if training else (),
        backward_internal=_backward_internal(costs, recorder, storages, False) if training else (),
        backward_accumulating=_backward_internal(costs, recorder, storages, True) if training else (),
        grad_passthrough=tuple(sorted(recorder.allocations.passthrough)) if training else (),
        extracts=_extracts(costs, reads, values),
        in_place=frozenset(i for i, op in enumerate(costs.ops) if op.name in recorder.written),
        items=frozenset(recorder.items),
        foreign_sums={op: dict(sums) for op, sums in recorder.allocations.foreign.items()} if training else {},
        repeated_outputs=frozenset(name for name, times in returned.items() if times > 1 and name in values),
        renewed=_renewed(costs, recorder) if training else (),
        training=training,
    )


def _renewed(costs: GraphCosts, recorder: _Recorder) -> tuple[tuple[int, int], ...]:
    """``(i, k)``: op ``i``'s result shares a storage with op ``k``'s (it writes it in place, or is a view of it) and
    its backward returns a new tensor for ``k``'s (:attr:`~fxsplit.memory.activationprofile.ActivationProfile.renewed`):
    a slice's backward makes its base's gradient anew, apart from the one a ``cat`` reading the slice handed on (a
    view of the ``cat``'s gradient), which still waits for the ``cat``'s other inputs (0.93 of the allocator when the
    two were counted as one tensor)."""
    found = []
    for i, returned in sorted(recorder.allocations.fresh.items()):
        mine = recorder.results.get(costs.ops[i].name)
        for k in sorted(returned):
            theirs = recorder.results.get(costs.ops[k].name)
            if mine and theirs and set(mine.storages) & set(theirs.storages):
                found.append((i, k))
    return tuple(found)


def _backward_internal(
    costs: GraphCosts, recorder: _Recorder, storages: _Storages, accumulating: bool
) -> tuple[int, ...]:
    """Per op, its backward's peak beyond the gradients it hands on (``accumulating``: each weight's added to
    a ``.grad`` that exists); where its result shares a storage with an earlier op's (in place, a view) and
    its backward returns a new tensor for that one, the gradient it received and that new one are two tensors
    for a moment, where the simulation holds one gradient per storage: the difference is added (``relu_``'s
    backward: twice the storage's bytes)."""
    allocations = recorder.allocations
    peaks = allocations.backward_accumulating if accumulating else allocations.backward_internal
    found = []
    for i, op in enumerate(costs.ops):
        extra = 0
        mine = recorder.results.get(op.name)
        for k, nbytes in allocations.fresh.get(i, {}).items():
            theirs = recorder.results.get(costs.ops[k].name)
            shared = set(mine.storages) & set(theirs.storages) if mine and theirs else set()
            if shared:
                held = max(storages.nbytes[key] for key in shared)
                extra = max(extra, allocations.incoming.get(i, 0) + nbytes - held)
        found.append(peaks.get(i, 0) + extra + recorder.recompute_extra.get(i, 0))
    return tuple(found)


def _extracts(
    costs: GraphCosts, reads: tuple[tuple[str, ...], ...], values: dict[str, ValueMemory]
) -> dict[int, frozenset[int]]:
    """Ops that take some storages out of the one tuple they read (``getitem``) -> those storages."""
    found = {}
    for i, op in enumerate(costs.ops):
        if op.target is not operator.getitem or len(reads[i]) != 1 or op.name not in values:
            continue
        mine, theirs = set(values[op.name].storages), set(values[reads[i][0]].storages)
        if mine < theirs:
            found[i] = frozenset(mine)
    return found
