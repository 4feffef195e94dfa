"""What ATen ops allocate while one node of a graph, or one op's backward, runs (a dispatch mode).

:class:`Allocations` sits under :mod:`fxsplit.memory.activations`' fake run. In the forward it
measures each node's intermediates: its peak beyond what is still alive at its end (its result).
In the backward it measures each op's backward as one *episode*: every autograd node the op's
forward made (:meth:`Allocations.claim`), however many there are - a composite op (a leaf module,
an RNN's steps) makes many. The simulation holds, through the op's backward, all that the op saved,
the gradient of its result, and the gradients it hands on (of the op's inputs; a weight's is its
``.grad``). The run holds less and more: what the op saved and the gradient it received go as its
nodes run, the gradients it hands on come when they are made (often at its end), and what it
allocates and frees before it ends (the gradients of its own intermediates, a weight's per-step
gradients summed inside) comes and goes. ``backward_internal`` is the episode's peak of the
difference, counted in the order it happens: negative where the simulation holds more than the run.
The engine's sums of gradients are taken as torch makes them on real tensors: in place into the
summand nothing else holds (on fake tensors it always makes a new one).

It also notes two facts about gradients the simulation needs: an op whose backward passes the
gradient of its result on as is (an add: one tensor, not two; ``passthrough``), and the bytes of
the fresh gradient an op's backward returns for each earlier op's result (``fresh``) together with
the gradient it received (``incoming``): where the two results share a storage (an in-place op, a
view), the simulation's one gradient per storage is then two tensors for a moment.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fxsplit.eagermode import EagerDispatchMode
from fxsplit.memory.losscapacity import CAPACITY_OPS, with_capacity
from fxsplit.memory.rnnworkspace import RNN_OPS, with_workspace

__all__ = ["Allocations"]


def _sole(tensor: Any) -> bool:
    """Nothing but ``tensor`` holds its storage, laid out densely: what the engine adds a gradient into."""
    if not isinstance(tensor, torch.Tensor):
        return False
    dense = tensor.is_contiguous() or tensor.is_contiguous(memory_format=torch.channels_last)
    return dense and torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) <= 2  # 2: with this call's own


def _refs(value: Any) -> list[StorageWeakRef]:
    return [StorageWeakRef(t.untyped_storage()) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class Allocations(EagerDispatchMode):
    """Peak bytes of the storages ATen ops create while one node (forward) or one op's backward runs.

    Args:
        scale: ``(nbytes, dtype) -> bytes`` as planned (a planning dtype scales floating-point storages).
    """

    def __init__(self, scale: Callable[[int, torch.dtype], int]) -> None:
        super().__init__()
        self.scale = scale
        self.seen: set[StorageWeakRef] = set()  # storages that exist already: weights, earlier results
        self.live: dict[StorageWeakRef, int] = {}
        self.peak = 0
        self.backward_ops: dict[Any, int] = {}  # autograd node -> the op whose forward made it
        self.roots: dict[int, set[Any]] = {}  # op -> the autograd nodes of its result (and of bases it wrote)
        self._fed_within: set[Any] = set()  # roots whose gradient came from their own op's nodes, not another's
        self.backward_internal: dict[int, int] = {}
        self.backward_accumulating: dict[int, int] = {}  # the same, adding each weight's gradient to its .grad
        self.passthrough: set[tuple[int, int]] = set()
        self.incoming: dict[int, int] = {}  # op -> bytes of the gradient its result receives
        self.fresh: dict[int, dict[int, int]] = {}  # op -> earlier op -> bytes of a new gradient returned for it
        self.in_backward = False
        self._node: Any = None
        self._episode: int | None = None
        self._step = 0
        self._made: dict[StorageWeakRef, list[int]] = {}  # this episode's: [nbytes, made, freed or -1, handed on,
        # added to its weight's existing .grad or -1]
        self._result_grads: dict[int, set[StorageWeakRef]] = {}
        self._targets: set[Any] = set()  # nodes this episode handed a gradient to
        self.foreign: dict[int, dict[int, int]] = {}  # op -> earlier op -> bytes of a sum out of place into the
        # gradient of that op's result, made in this op's backward (on the earlier op's device when they differ)
        self._handed_tensors: dict[int, tuple[int, Any]] = {}  # id of a gradient handed on -> (op, weak ref)
        self._handed_on: dict[StorageWeakRef, tuple[int, StorageWeakRef]] = {}  # a gradient an op handed on ->
        # the op it is for (and its own reference: a storage freed since may share the key of a new one)
        self._weight_readers: dict[Any, set[int]] = {}  # a weight's AccumulateGrad -> the ops that read it
        self._accumulating = False  # a node has returned: the engine adds its gradients to those waiting
        self.saved: dict[int, dict[StorageWeakRef, int]] = {}  # op -> storages its autograd nodes saved
        self._held: dict[StorageWeakRef, int] = {}  # the episode op's saved storages still alive
        self._released: list[tuple[int, int]] = []  # (step, bytes) the episode's op released of them

    def start(self) -> None:
        """A node of the forward starts."""
        self.live.clear()
        self.peak = 0

    def extra(self) -> int:
        """Peak bytes made since :meth:`start` beyond those still alive (its results)."""
        self._prune()
        return max(0, self.peak - sum(self.live.values()))

    def claim(self, value: Any, op: int, adding: bool = False) -> None:
        """The autograd nodes that ``value``'s computation created belong to op ``op`` (``adding``: more of them,
        found since its own ran)."""
        owners = self.backward_ops
        stack: list[Any] = [
            t.grad_fn for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
        roots = {fn for fn in stack if fn not in owners}
        if adding:
            self.roots.setdefault(op, set()).update(roots)
        else:
            self.roots[op] = roots
        for fn in roots:
            fn.register_prehook(functools.partial(self._arriving, op, fn))
        while stack:
            fn = stack.pop()
            if hasattr(fn, "variable"):  # a weight's AccumulateGrad
                self._weight_readers.setdefault(fn, set()).add(op)
            if fn is not None and fn not in owners:
                owners[fn] = op
                fn.register_hook(functools.partial(self._node_done, op, fn))
                stack.extend(next_fn for next_fn, _ in fn.next_functions)

    def backward_done(self) -> None:
        """The backward has finished: measure the last op's episode."""
        self._close_episode()
        self.in_backward = False

    def _node_done(self, op: int, fn: Any, grad_inputs: Any, grad_outputs: Any) -> None:
        """A backward node of op ``op`` returned: which earlier ops get the gradient of op ``op``'s result
        passed on as is (an add's backward), and which get a new tensor (its bytes, in ``fresh``)."""
        if hasattr(fn, "variable"):  # a weight's AccumulateGrad: added here to a .grad that exists (a weight
            for ref in _refs(grad_outputs):  # several ops read: what is made here is the sum of theirs, out of
                made = self._made.get(ref)  # place; theirs are simulated)
                if made is not None and made[2] < 0 and not made[3]:
                    made[4] = self._step + 1
            return
        self._accumulating = True
        incoming = self._result_grads.setdefault(op, set())
        if fn in self.roots.get(op, ()) and fn not in self._fed_within:
            refs = _refs(grad_outputs)
            incoming.update(refs)
            self.incoming[op] = self.incoming.get(op, 0) + sum(
                self.scale(t.untyped_storage().nbytes(), t.dtype)
                for t in tree_leaves(grad_outputs)
                if isinstance(t, torch.Tensor)
            )
        for tensor, (next_fn, _) in zip(grad_inputs, fn.next_functions, strict=False):
            other = self.backward_ops.get(next_fn)
            if not isinstance(tensor, torch.Tensor) or other is None:
                continue
            if other == op and next_fn in self.roots.get(op, ()):  # a base's node fed by its written view's
                self._fed_within.add(next_fn)
            ref = StorageWeakRef(tensor.untyped_storage())
            if other != op and ref in incoming:
                self.passthrough.add((op, other))
            elif other != op and ref in self._made:
                returned = self.fresh.setdefault(op, {})
                returned[other] = returned.get(other, 0) + self._made[ref][0]
            weight = hasattr(next_fn, "variable")
            if not weight and other != op:
                self._handed_on[ref] = (other, ref)
                self._handed_tensors[id(tensor)] = (other, weakref.ref(tensor))
            shared = len(self._weight_readers.get(next_fn, ())) > 1
            if ((weight and shared) or (not weight and other != op)) and next_fn not in self._targets:
                # handed on: the first gradient for another op's result, or for a weight other ops read too, is
                # simulated, as are their sums across ops; more from this op to the same one are its own sums (a
                # weight only this op reads: what ends as its .grad is alive at the end; the rest is this op's)
                self._targets.add(next_fn)
                if weight:
                    self._made.pop(ref, None)
                elif ref in self._made:
                    self._made[ref][3] = 1

    def _sum_in_place(self, args: Any, out: torch.Tensor) -> bool:
        """The engine adds a node's gradient to one waiting for the same input. On real tensors it adds into the
        waiting one when nothing else holds it (a view's base does), else makes a new tensor (whatever the new
        summand is); on fake ones it cannot tell, and always makes a new tensor. Where the real engine adds in
        place the sum is that summand: what this episode made, or none of its own (a gradient handed on, summed
        with those from other ops: simulated), and the other summand is freed as it goes. Out of place into the
        gradient another op handed on for a third op's result, which the simulation sums in place, the new sum
        is more for a moment (three outputs viewing one value were 0.84 of the allocator without it). False:
        out of place within the episode, as the fake run did."""
        into = args[0]
        if not _sole(into) or into.shape != out.shape or args[1] is into:  # one tensor twice: held by two
            handed = self._handed_on.get(StorageWeakRef(into.untyped_storage()))
            if handed is None or handed[1].expired():
                return False
            exact = self._handed_tensors.get(id(into))  # the view handed to this op (views share the storage:
            target = exact[0] if exact is not None and exact[1]() is into else handed[0]  # stack's, to each input)
            if target == self._episode:
                return False
            # into the gradient of another op's result, handed on by a third (the simulation's gradient of that
            # result, which it sums in place): the new sum is more while both summands live
            self._step += 1
            self._prune()
            ref = StorageWeakRef(out.untyped_storage())
            self.seen.add(ref)
            nbytes = self.scale(out.untyped_storage().nbytes(), out.dtype)
            self._made[ref] = [nbytes, self._step, self._step + 1, 0, -1]
            sums = self.foreign.setdefault(self._episode, {}) if self._episode is not None else {}
            sums[target] = max(sums.get(target, 0), nbytes)
            return True
        self._step += 1
        self._prune()
        ref = StorageWeakRef(out.untyped_storage())
        self.seen.add(ref)
        made = self._made.pop(StorageWeakRef(into.untyped_storage()), None)
        if made is not None:
            self._made[ref] = made
            self.live[ref] = made[0]
        return True

    def _arriving(self, op: int, fn: Any, grad_outputs: Any) -> None:
        """The gradient of op ``op``'s result reaches its backward: like what it saved, it goes as it runs."""
        if fn in self._fed_within:
            return
        for tensor in tree_leaves(grad_outputs):
            if isinstance(tensor, torch.Tensor):
                ref, nbytes = self.note_saved(op, tensor)
                if self._episode == op:  # its episode has begun (it was alive since): held from now
                    self._held[ref] = nbytes

    def note_saved(self, op: int, tensor: torch.Tensor) -> tuple[StorageWeakRef, int]:
        """Op ``op``'s forward saved ``tensor`` for its backward (a saved-tensors hook): its storage and bytes."""
        storage = tensor.untyped_storage()
        ref, nbytes = StorageWeakRef(storage), self.scale(storage.nbytes(), tensor.dtype)
        self.saved.setdefault(op, {})[ref] = nbytes
        return ref, nbytes

    def _prune(self) -> None:
        for ref in [r for r in self._held if r.expired()]:
            self._released.append((self._step, -self._held.pop(ref)))
        for ref in [r for r in self.live if r.expired()]:
            del self.live[ref]
            made = self._made.get(ref)
            if made is not None and made[2] < 0:
                made[2] = self._step

    def _close_episode(self) -> None:
        """The episode's peak beyond what the simulation holds through it: all that the op saved and the
        gradient of its result (which go as its nodes run), and the gradients it hands on to earlier ops'
        results (which come when they are made, often at its end). What it made and is still alive at the end,
        not handed on, is a weight's gradient, which becomes its ``.grad`` (charged as gradients). Accumulating
        into a ``.grad`` that exists (``backward_accumulating``: gradient accumulation, a pipeline's later
        micro-batches), it is added to it when its ``AccumulateGrad`` runs, and freed. Negative: the simulation
        holds more than the run ever does."""
        op = self._episode
        if op is not None:
            self._step += 1  # what is found freed now went after the episode's last op made its result
            self._prune()
            handed = sum(entry[0] for entry in self._made.values() if entry[3])
            for peaks, accumulating in ((self.backward_internal, False), (self.backward_accumulating, True)):
                events = list(self._released)
                for nbytes, made, freed, gone, added in self._made.values():
                    if accumulating and freed < 0:
                        freed = added
                    if gone or freed >= 0:  # else alive at the end, not handed on: a weight's .grad
                        events.append((made, nbytes))
                    if freed >= 0:
                        events.append((freed, -nbytes))
                running = peak = 0
                for _, delta in sorted(events):  # at one step, frees (negative) before allocations
                    running += delta
                    peak = max(peak, running)
                before = peaks.get(op)
                peaks[op] = peak - handed if before is None else max(before, peak - handed)
        self._made.clear()
        self._released.clear()
        self._targets.clear()
        self.live.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.in_backward:
            node = torch._C._current_autograd_node()
            if node is not self._node:
                self._node = node
                self._accumulating = False
                op = self.backward_ops.get(node)
                if op != self._episode:
                    self._close_episode()
                    self._episode = op
                    saved = self.saved.get(op, {}) if op is not None else {}
                    self._held = {ref: nbytes for ref, nbytes in saved.items() if not ref.expired()}
        out = func(*args, **(kwargs or {}))
        if self._accumulating and func is torch.ops.aten.add.Tensor and self._sum_in_place(args, out):
            return out
        if func in RNN_OPS:  # its fake kernel leaves out the workspace saved for backward
            out = with_workspace(func, args, out)
        elif func in CAPACITY_OPS:  # its fake kernel returns a scalar of its own size; the real one keeps more
            out = with_capacity(func, args, kwargs or {}, out)
        self._step += 1
        self._prune()
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                ref = StorageWeakRef(tensor.untyped_storage())
                if ref not in self.seen:
                    self.seen.add(ref)
                    nbytes = self.live[ref] = self.scale(tensor.untyped_storage().nbytes(), tensor.dtype)
                    if self.in_backward and self._episode is not None:
                        self._made[ref] = [nbytes, self._step, -1, 0, -1]
        self.peak = max(self.peak, sum(self.live.values()))
        return out
