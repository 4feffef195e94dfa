"""Emit the split model: a new ``GraphModule`` whose weights live on their devices.

Each op keeps its place in the graph; a value needed on a device other than
its home is copied with ``.to(device)`` once per destination device, right
before its first reader there. Ops that create tensors on a hard-coded device
(``device=...`` arguments, ``.to("cpu")``, ``.cuda()``) are rewritten to the
device of their stage. No hooks: the generated ``forward`` is all there is.

Moving the weights themselves onto their devices is :mod:`~fxsplit.codegen.weights`;
the class of the module built (export and grad-mode splits),
:mod:`~fxsplit.codegen.splitmodule`.
"""

from __future__ import annotations

import builtins
import contextlib
from typing import Any, Callable

import torch
import torch.fx

from fxsplit import runtime
from fxsplit.attrpath import attr_at
from fxsplit.codegen.fastattr import mirror_registries
from fxsplit.codegen.meta import COPY_META, DEVICE_META, REPLICA_STORE, CopyRecord, kept_on_copy
from fxsplit.codegen.nested import pin_device_arguments, pin_subgraph_devices
from fxsplit.codegen.splitmodule import ExportedSplit, GradModeSafeSplit, split_module
from fxsplit.codegen.splitmodule import InputGuard as InputGuard  # splits saved before it moved name it here
from fxsplit.codegen.tiednames import keep_tied_names
from fxsplit.codegen.unreadstate import hold_unread
from fxsplit.codegen.weights import (
    MovedWeights,
    check_input_writes,
    move_weights,
    weight_path,
    weight_tensor,
    weights_read,
)
from fxsplit.cost.build import Weight
from fxsplit.planning.build import Read, WriteVersions, reads_of
from fxsplit.planning.plan import Plan
from fxsplit.tracing.graphinfo import TENSOR, input_writers, tensor_origin, value_kind
from fxsplit.tracing.modulehooks import carry_root_hooks

__all__ = [
    "COPY_META",
    "DEVICE_META",
    "ExportedSplit",
    "GradModeSafeSplit",
    "MovedWeights",
    "check_input_writes",
    "emit",
    "move_weights",
]


class _Emitter:
    def __init__(self, graph_module: torch.fx.GraphModule, plan: Plan, by_node: dict[str, list[Weight]]) -> None:
        self.source = graph_module
        self.plan = plan
        self.by_node = by_node
        self.graph = torch.fx.Graph()
        self.graph.set_codegen(graph_module.graph._codegen)
        self.env: dict[str, torch.fx.Node] = {}
        self.copies: dict[tuple[str, str], tuple[torch.fx.Node, int | None, int | None]] = {}
        self.versions = WriteVersions(graph_module, by_node)  # a copy taken before a write is not reused after it
        self.modules = dict(graph_module.named_modules())
        self.writers = input_writers(graph_module.graph, self.modules)
        self.last_writes: dict[str, list[str]] = {}
        for placeholder, writers in self.writers.items():
            self.last_writes.setdefault(writers[-1], []).append(placeholder)
        self.grad_region = 0  # bumped at each grad-mode change: copies made under another mode are not reused
        # per device, the emitted ops that read weights, with their grad region: where prefetches go
        self.weight_ops: dict[str, list[tuple[torch.fx.Node, int]]] = {}
        self.prefetch = int(plan.offload.get("prefetch", 1)) if plan.streamed else 0
        self.replicas: dict[tuple[str, str, int], torch.fx.Node] = {}  # (weight, device, grad region) -> its read

    def run(self) -> torch.fx.Graph:
        for node in self.source.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                self.env[node.name] = self.graph.node_copy(node, self._lookup_env)
                if node.op == "get_attr" and node.name in self.plan.placement:
                    self.env[node.name].meta[DEVICE_META] = self.plan.placement[node.name]
                continue
            device = self.plan.placement[node.name]
            replaced: dict[str, torch.fx.Node] = {}
            foreign: dict[str, tuple[Weight, torch.fx.Node]] = {}
            streamed: dict[str, torch.fx.Node] = {}  # one copy per op and streamed weight
            reads = reads_of(node, self.by_node)
            for read in reads:
                fetched: torch.fx.Node | None
                if read.weight is not None and read.key in self.plan.streamed:
                    fetched = streamed[read.key] = streamed.get(read.key) or self._stream(read, device)
                else:
                    fetched = self._fetch(read, device)
                if fetched is None:
                    continue
                if read.node is not None:
                    replaced[read.node.name] = fetched
                elif read.weight is not None:
                    foreign[read.key] = (read.weight, fetched)
            new = self._copy_node(node, replaced, foreign, device)
            if node.op != "output":
                new.meta[DEVICE_META] = device
            if any(read.weight is not None for read in reads):
                self.weight_ops.setdefault(device, []).append((new, self.grad_region))
            self.env[node.name] = new
            self.versions.written(node)
            for placeholder in self.last_writes.get(node.name, ()):
                self._write_back(placeholder)
            if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
                self.grad_region += 1
        for node in [n for n in self.graph.nodes if n.op == "get_attr" and not n.users]:
            self.graph.erase_node(node)  # a tied weight read through its other name: no dead line in the code
        inputs = [n for n in self.graph.nodes if n.op == "placeholder"]
        if self.writers and len(inputs) > 1:  # an input written in place must not be another input too
            with self.graph.inserting_after(inputs[-1]):
                names, written = tuple(n.name for n in inputs), tuple(self.writers)
                check = self.graph.call_function(runtime.refuse_shared_inputs, (tuple(inputs), names, written))
                check.meta[DEVICE_META] = self.plan.placement[next(iter(self.writers))]
        for node in self.graph.nodes:
            if isinstance(node.type, str):
                node.type = _annotation(node.type)
        return self.graph

    def _lookup_env(self, node: torch.fx.Node) -> torch.fx.Node:
        return self.env[node.name]

    def _copy_node(
        self,
        node: torch.fx.Node,
        replaced: dict[str, torch.fx.Node],
        foreign: dict[str, tuple[Weight, torch.fx.Node]],
        device: str,
    ) -> torch.fx.Node:
        def remap(arg: torch.fx.Node) -> torch.fx.Node:
            return replaced.get(arg.name) or self.env[arg.name]

        if foreign:
            return self._functional_call(node, foreign, remap)
        new = self.graph.node_copy(node, remap)
        if node.op != "output":
            pin_device_arguments(new, device)
        return new

    def _functional_call(
        self,
        node: torch.fx.Node,
        foreign: dict[str, tuple[Weight, torch.fx.Node]],
        remap: Callable[[torch.fx.Node], torch.fx.Node],
    ) -> torch.fx.Node:
        """A call_module whose weights live elsewhere: call it with copies of them."""
        module = self.modules[str(node.target)]
        copies = {id(weight_tensor(self.source, weight)): copy for weight, copy in foreign.values()}
        local: dict[str, torch.fx.Node] = {}
        tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        for name, tensor in tensors:
            if id(tensor) in copies:
                local[name] = copies[id(tensor)]
        module_node = self.graph.get_attr(str(node.target))
        module_node.meta[DEVICE_META] = self.plan.placement[node.name]
        args = torch.fx.map_arg(node.args, remap)
        kwargs = torch.fx.map_arg(node.kwargs, remap)
        new = self.graph.call_function(runtime.call_with_weights, (module_node, local, tuple(args), dict(kwargs)))
        new.meta = dict(node.meta)
        return new

    def _fetch(self, read: Read, device: str) -> torch.fx.Node | None:
        """The node that holds ``read`` on ``device``, copying it there on first need."""
        if read.weight is not None:
            home = self.plan.param_devices[read.key]
            if read.key in self.plan.replicas and device in self.plan.replicas[read.key].devices:
                return self._replica(read, device)
        else:
            home = self.plan.placement[read.key]
        is_input = read.node is not None and read.node.op == "placeholder"
        if home == device and not is_input:
            return None
        if read.weight is None and read.node is not None and not is_input:
            origin = tensor_origin(read.node)
            if origin is not read.node and origin.op != "get_attr":
                return self._fetch(Read(origin.name, origin, None, read.kind), device)  # one copy serves both names
        version = self.versions.of(read)
        cached, region, made_at = self.copies.get((read.key, device), (None, None, None))
        if cached is not None and region in (None, self.grad_region) and made_at in (None, version):
            return cached
        if is_input and home != device:
            source = self._fetch(read, home)
        elif read.node is not None:
            source = self.env[read.node.name]
        else:
            source = self._weight_node(read)
        known_tensor = read.weight is not None or (read.node is not None and value_kind(read.node) == TENSOR)
        if known_tensor:
            copy = self.graph.call_method("to", (source, device))
        else:
            copy = self.graph.call_function(runtime.move, (source, device))
        copy.meta[COPY_META] = CopyRecord(read.key, None if is_input and home == device else home, device)
        copy.meta[DEVICE_META] = device
        if read.node is not None and "val" in read.node.meta:
            copy.meta["val"] = read.node.meta["val"]
        # A copy made under no_grad carries no gradient: made again after the mode changes.
        # An input written in place keeps one copy at home, the one the writes reach.
        keep = is_input and home == device and read.key in self.writers  # the copy the writes go to
        self.copies[(read.key, device)] = (copy, None if keep else self.grad_region, None if keep else version)
        return copy

    def _stream(self, read: Read, device: str) -> torch.fx.Node:
        """An offloaded weight for one op: prefetched ``prefetch`` weight-reading ops earlier, waited for here."""
        assert read.weight is not None
        path = weight_path(self.source, read.weight)
        if path is None:  # pragma: no cover
            raise AssertionError(f"no attribute path reaches weight {read.key!r}")
        earlier = [n for n, region in self.weight_ops.get(device, []) if region == self.grad_region]
        before = earlier[-self.prefetch] if self.prefetch and len(earlier) >= self.prefetch else None
        if before is None and earlier and self.prefetch:
            before = earlier[0]
        base = path.replace(".", "_")
        with self.graph.inserting_before(before) if before is not None else contextlib.nullcontext():
            stored = self.graph.create_node("get_attr", path, name=f"stored_{base}")
            started = self.graph.create_node(
                "call_function", runtime.prefetch, (stored, device), name=f"prefetch_{base}"
            )
        stored.meta[DEVICE_META] = started.meta[DEVICE_META] = device  # the stage that streams it in
        started.meta[COPY_META] = CopyRecord(read.key, self.plan.streamed[read.key], device)
        started.meta[DEVICE_META] = device
        arrived = self.graph.create_node("call_function", runtime.arrive, (started,), name=f"{base}_on_{device}")
        arrived.meta[DEVICE_META] = device
        return arrived

    def _replica(self, read: Read, device: str) -> torch.fx.Node:
        """The device's own copy of a replicated weight (``plan.replicas``): one read per device, no copy."""
        assert read.weight is not None
        key = (read.key, device, self.grad_region)
        if key not in self.replicas:
            store = self.graph.get_attr(REPLICA_STORE)
            weight = self._weight_node(read)
            base = (weight_path(self.source, read.weight) or read.key).replace(".", "_")
            node = self.graph.create_node(
                "call_function", runtime.replica, (store, read.key, weight, device), name=f"{base}_replica"
            )
            node.meta[DEVICE_META] = device
            self.replicas[key] = node
            tensor = weight_tensor(self.source, read.weight)
            if tensor is not None and tensor.device.type != "meta":  # held from now on, not from the first call
                store_module = self.source.get_submodule(REPLICA_STORE)
                assert isinstance(store_module, runtime.ReplicaStore)
                store_module.get(read.key, tensor, device)
        return self.replicas[key]

    def _write_back(self, placeholder: str) -> None:
        """Copy the home copy of an input written in place back into the caller's tensor (as eager would)."""
        home = self.plan.placement[placeholder]
        moved, _, _ = self.copies.get((placeholder, home), (None, None, None))
        if moved is None:
            return
        write = self.graph.call_function(runtime.write_back, (self.env[placeholder], moved))
        write.meta[DEVICE_META] = home

    def _weight_node(self, read: Read) -> torch.fx.Node:
        assert read.weight is not None
        path = weight_path(self.source, read.weight)
        if path is None:  # pragma: no cover
            raise AssertionError(f"no attribute path reaches weight {read.key!r}")
        return self._home_attr(path, read.key)

    def _home_attr(self, path: str, key: str) -> torch.fx.Node:
        attr = self.graph.get_attr(path)
        attr.meta[DEVICE_META] = self.plan.param_devices[key]
        return attr


def _annotation(text: str) -> Any:
    """The object a string annotation names (``from __future__ import annotations``), or None.

    torch.fx copies such annotations as strings, which it prints as ``x : _torch_Tensor_`` and
    cannot pickle. ``"torch.Tensor"`` and builtins (``"int"``) are resolved; anything else is
    dropped (annotations do not change what the code does).
    """
    head, _, rest = text.partition(".")
    if head == "torch":
        found = attr_at(torch, rest, None) if rest else torch
    else:
        found = None if rest else getattr(builtins, head, None)
    return found if isinstance(found, type) else None


def emit(graph_module: torch.fx.GraphModule, plan: Plan, model: torch.nn.Module | None = None) -> torch.fx.GraphModule:
    """Build the split ``GraphModule`` from the traced graph and its plan; it shares (not copies) the graph's weights.

    The plan names every parameter and buffer, the graph says which node
    reads which (:func:`~fxsplit.codegen.weights.weights_read`): nothing
    else is needed, so a plan saved and loaded again generates the same code.
    Given the ``model``, the split also holds the model's tensors no op reads
    (:func:`~fxsplit.codegen.unreadstate.hold_unread`), so that its
    ``state_dict()`` is the model's, and the model's own hooks that the graph
    lacks (:func:`~fxsplit.tracing.modulehooks.carry_root_hooks`).
    """
    check_input_writes(graph_module, plan)
    if plan.replicas:  # where the split keeps its replicas (a module, so that get_attr reaches it)
        graph_module.add_module(REPLICA_STORE, runtime.ReplicaStore())
    graph = _Emitter(graph_module, plan, weights_read(graph_module, plan)).run()
    graph.lint()
    split = split_module(graph_module, graph, plan)
    if model is not None:
        hold_unread(split, model)
        kept_on_copy(split, **carry_root_hooks(split, model, plan.trace))  # the model's own hooks its graph lacks
    pin_subgraph_devices(split, {n.name: n.meta[DEVICE_META] for n in split.graph.nodes if DEVICE_META in n.meta})
    split.recompile()
    mirror_registries(split)  # weights by path at dict speed (see fxsplit.codegen.fastattr)
    split.meta["fxsplit_plan"] = plan
    keep_tied_names(split, plan)
    return split
