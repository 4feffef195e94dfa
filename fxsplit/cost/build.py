"""From a traced graph to a :class:`PartitionProblem`: bytes per value, weights once.

Every parameter and buffer is one *weight*, however many names or graph
nodes refer to it (tied embeddings, shared layers): it is found by tensor
identity and counted once. Values whose size is unknown (no shapes) count as
one byte, so the partitioner then minimises the number of values cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import torch
import torch.fx
from torch.fx.passes.shape_prop import TensorMetadata

from fxsplit.attrpath import attr_at
from fxsplit.cost.keptdtype import kept_tensors
from fxsplit.cost.pins import path_matches, resolve_pins, resolve_together
from fxsplit.cost.scan import module_tensors, scan_graph
from fxsplit.cost.sharedwrites import refuse_written_views
from fxsplit.cost.versions import split_by_version
from fxsplit.cost.walk import ModulePaths, module_table, named_tensors
from fxsplit.gcpause import gc_paused
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.tracing.graphinfo import (
    NONTENSOR,
    TENSOR,
    _numel,
    alias_root,
    element_size,
    mutated_inputs,
    tensor_origin,
    value_bytes,
    value_kind,
)
from fxsplit.tracing.rowsplit import covered_sources
from fxsplit.tracing.writers import writing_ops

__all__ = [
    "GraphCosts",
    "Weight",
    "build_problem",
    "model_tensors",
    "named_tensors",
    "path_matches",
    "storage_key",
    "tensor_reads",
    "written_tensors",
]

UNKNOWN_VALUE_BYTES = 1


class Weight(NamedTuple):
    """One parameter or buffer tensor, with every name it has in the model (a named tuple, as
    :class:`~fxsplit.partition.problem.Value` is: one per tensor; change one with ``weight._replace(...)``).

    Attributes:
        names: qualified names in the user's model (several when tied); the
            first is the canonical one. Constants that exist only in the traced
            graph are named by their graph target.
        nbytes: bytes of the tensor.
        is_buffer: True for buffers (state), False for parameters.
        nodes: names of the graph nodes that read it (get_attr and call_module).
    """

    names: tuple[str, ...]
    nbytes: int
    is_buffer: bool
    nodes: tuple[str, ...]


@dataclass
class GraphCosts:
    """The problem plus what is needed to turn its solution into a plan."""

    problem: PartitionProblem
    ops: list[torch.fx.Node]
    weights: list[Weight]
    weight_values: list[int]
    unused: list[Weight] = field(default_factory=list)
    value_nbytes: dict[str, int | None] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # unread weight -> the read weight whose storage it is
    written: dict[str, int] = field(default_factory=dict)  # weights the forward writes in place -> bytes
    writers: frozenset[str] | None = None  # ops that write an input in place (None: not known, ask each node)


def model_tensors(model: torch.nn.Module) -> dict[int, tuple[list[str], torch.Tensor, bool]]:
    """``id(tensor) -> (qualified names, tensor, is_buffer)`` for every parameter and buffer."""
    found: dict[int, tuple[list[str], torch.Tensor, bool]] = {}
    for name, tensor, is_buffer in named_tensors(model):
        found.setdefault(id(tensor), ([], tensor, is_buffer))[0].append(name)
    return found


def _unread_aliases(
    weights: list[Weight],
    weight_values: list[int],
    unused: list[Weight],
    read: Mapping[int, tuple[Any, ...]],
    known: Mapping[int, tuple[list[str], torch.Tensor, bool]],
    rows: Mapping[int, str],
) -> dict[str, str]:
    """Unread weight -> the read weight it is: two tensor objects over the same storage (export's lifted
    constants alias the buffers they came from; the buffer's get_attr reads nothing), or row parameters that
    hold all of its rows (``rows``: :func:`~fxsplit.tracing.rowsplit.covered_sources`). It costs nothing
    more and goes where the read one goes."""
    unread = [w.names[0] for w, index in zip(weights, weight_values, strict=True) if index < 0]
    unread += [w.names[0] for w in unused]
    if not unread:
        return {}
    tensors = {entry[0][0]: entry[1] for entry in [*read.values(), *known.values()]}
    read_names = {w.names[0] for w, index in zip(weights, weight_values, strict=True) if index >= 0}
    by_storage = {key: name for name in read_names if (key := storage_key(tensors[name])) is not None}
    found = {}
    for name in unread:
        key = storage_key(tensors[name]) if name in tensors else None
        if key is not None and key in by_storage:
            found[name] = by_storage[key]
        elif name in tensors and id(tensors[name]) in rows:
            found[name] = rows[id(tensors[name])]
    return found


def storage_key(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """What makes two tensor objects the same tensor: storage, offset, shape, strides, dtype (None on meta)."""
    if tensor.device.type == "meta":
        return None
    pointer = tensor.untyped_storage().data_ptr()
    if not pointer:
        return None
    return (pointer, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)


def _tensor_bytes(
    tensor: torch.Tensor, dtype: torch.dtype | None = None, kept: Mapping[int, torch.dtype] | None = None
) -> int:
    """``tensor``'s bytes held at ``dtype`` (None: its own), or at the dtype in ``kept`` (by ``id``) the model keeps
    it at (:mod:`fxsplit.cost.keptdtype`)."""
    if dtype is None or not tensor.dtype.is_floating_point:
        return tensor.nbytes
    return tensor.numel() * element_size(tensor.dtype, kept.get(id(tensor), dtype) if kept else dtype)


@gc_paused()
def build_problem(
    graph_module: torch.fx.GraphModule,
    model: torch.nn.Module,
    *,
    device_index: Mapping[str, int],
    pins: Mapping[str, str] | None = None,
    together: Sequence[Sequence[str]] = (),
    dtype: torch.dtype | None = None,
) -> GraphCosts:
    """Describe the graph's ops, values, weights and constraints for the partitioner.

    Args:
        graph_module: the traced graph.
        model: the user's model (for the names of its parameters and buffers).
        device_index: device name -> stage index.
        pins: module path, glob or node name -> device name.
        together: groups of module patterns whose ops must all share a device.
        dtype: plan as if floating-point parameters, buffers and activations
            had this dtype (None: as they are).
    """
    modules = ModulePaths(graph_module)
    known = model_tensors(model)
    scan = scan_graph(graph_module, modules, known)
    ops, index, read = scan.ops, scan.index, scan.read
    mutations = writing_ops(ops, modules)
    writes = written_tensors(graph_module, ops, modules, mutations)
    values, value_nbytes = _op_values(scan.valued, index, dtype, mutations)
    if mutations:  # a value read before and after a write to its tensor: one per version (copies of each)
        values = split_by_version(values, scan.valued, index, mutations)
    refuse_written_views(read, {key for kind, key in writes if kind == "weight" and isinstance(key, int)})
    kept = kept_tensors(model, dtype)  # (counted at the dtype: a MoE router's gate the model keeps at float32)

    weights: list[Weight] = []
    weight_values: list[int] = []
    module_buffers = scan.module_buffers
    for key, (names, tensor, is_buffer, users, nodes) in read.items():
        nbytes = _tensor_bytes(tensor, dtype, kept)
        weights.append(_new(Weight, (tuple(names), nbytes, is_buffer, tuple(nodes))))
        if not users:
            weight_values.append(-1)
            continue
        readers = tuple(sorted(set(users))) if len(users) > 1 else tuple(users)
        weight_values.append(len(values))
        movable = not module_buffers or key not in module_buffers
        values.append(_new(Value, (names[0], nbytes, readers[0], readers, nbytes, movable)))
        if writes and ("weight", key) in writes:  # a written buffer lives where its first reader runs
            writes[("weight", key)].add(readers[0])
    unused = (
        [  # the model's tensors no node reads (none when the graph reads every one)
            Weight(tuple(names), _tensor_bytes(t, dtype, kept), b, ())
            for key, (names, t, b) in known.items()
            if key not in read
        ]
        if scan.known_read < len(known)
        else []
    )
    aliases = _unread_aliases(weights, weight_values, unused, read, known, covered_sources(graph_module))
    if aliases:
        weights = [w._replace(nbytes=0) if w.names[0] in aliases else w for w in weights]
        unused = [w._replace(nbytes=0) if w.names[0] in aliases else w for w in unused]

    labels = scan.labels
    problem = PartitionProblem(
        op_names=tuple(n.name for n in ops),
        values=tuple(values),
        pinned=resolve_pins(pins or {}, ops, labels, device_index),
        together=resolve_together(together, ops, labels),
        colocated=tuple(tuple(sorted(group)) for group in writes.values() if len(group) > 1),
        op_labels=labels,
    )
    written = {
        read[key][0][0]: _tensor_bytes(read[key][1], dtype, kept)
        for kind, key in writes
        if kind == "weight" and isinstance(key, int) and key in read
    }
    writers = frozenset(node.name for node in mutations)
    return GraphCosts(problem, ops, weights, weight_values, unused, value_nbytes, aliases, written, writers)


def _op_values(
    valued: list[torch.fx.Node],
    index: Mapping[torch.fx.Node, int],
    dtype: torch.dtype | None,
    writers: Mapping[torch.fx.Node, object] | None = None,
) -> tuple[list[Value], dict[str, int | None]]:
    """A :class:`Value` for each placeholder or op whose value some op reads, and every such node's bytes.

    An op that returns the tensor it wrote in place (``y = x.add_(1)``; ``writers``: the ops that write) is no
    value of its own: its readers read its :func:`tensor_origin`'s value, as the copies the code makes do."""
    values: list[Value] = []
    value_nbytes: dict[str, int | None] = {}
    sizes: dict[torch.dtype, int] = {}
    position = index.get
    made: dict[torch.fx.Node, int] = {}  # origin of a written tensor -> its value's index
    for node in valued:
        if writers and node in writers and _merged(values, made, tensor_origin(node), node, index):
            value_nbytes[node.name] = _value_facts(node, dtype, sizes)[0]
            continue
        users = node.users
        if len(users) == 1:  # most values: one reader, no set to sort
            reader = position(next(iter(users)))
            consumers: tuple[int, ...] = () if reader is None else (reader,)
        else:
            consumers = tuple(sorted({index[u] for u in users if u in index}))
        meta = node.meta  # one tensor of known shape (most values): its bytes here, without a call
        value: Any = meta["val"] if "val" in meta else meta.get("tensor_meta")
        nbytes: int | None = None
        kind: str | None = None
        if dtype is None and isinstance(value, torch.Tensor):  # its own dtype: one call, not shape and dtype (each
            try:  # costs as much on a fake tensor: together, a third of this pass on a 100k-op graph)
                found: object = value.nbytes  # numel * element size; symbolic: a SymInt; sparse: it fails
            except Exception:  # noqa: BLE001
                found = None
            if type(found) is int:
                nbytes, kind = found, TENSOR
        elif type(value) is TensorMetadata or isinstance(value, torch.Tensor):
            try:
                numel = value.shape.numel()  # torch.Size's own product; a symbolic size: a SymInt, or it fails
            except Exception:  # noqa: BLE001
                numel = None
            if type(numel) is int:
                per = sizes.get(value.dtype)
                if per is None:
                    per = sizes[value.dtype] = element_size(value.dtype, dtype)
                nbytes, kind = numel * per, TENSOR
        if kind is None:
            nbytes, kind = _value_facts(node, dtype, sizes)
        name = node.name
        value_nbytes[name] = nbytes
        if not consumers:
            continue
        if kind is None:
            kind = value_kind(node)
        at = position(node)
        if writers:
            made[node] = len(values)
        size = 0 if kind == NONTENSOR else (nbytes if nbytes is not None else UNKNOWN_VALUE_BYTES)
        values.append(_new(Value, (name, size, consumers[0] if at is None else at, consumers, 0, True)))
    return values, value_nbytes


def _merged(
    values: list[Value],
    made: dict[torch.fx.Node, int],
    origin: torch.fx.Node,
    node: torch.fx.Node,
    index: Mapping[torch.fx.Node, int],
) -> bool:
    """Whether ``node``'s readers were added to the value of ``origin``, the tensor ``node`` returns (False: it is
    no such op, or ``origin`` has no value to add them to)."""
    if origin is node or origin not in made:
        return False
    readers = {index[u] for u in node.users if u in index}
    value = values[made[origin]]
    values[made[origin]] = value._replace(consumers=tuple(sorted({*value.consumers, *readers})))
    return True


_new = tuple.__new__  # a named tuple from a tuple of all its fields, without its ``__new__``'s keyword handling


def _value_facts(
    node: torch.fx.Node, dtype: torch.dtype | None, sizes: dict[torch.dtype, int]
) -> tuple[int | None, str | None]:
    """``value_bytes(node)`` and, where it comes for free (one tensor), ``value_kind(node)`` (else None).
    ``sizes``: bytes per element by dtype, filled as met."""
    meta = node.meta
    value = meta["val"] if "val" in meta else meta.get("tensor_meta")
    if type(value) is TensorMetadata or isinstance(value, torch.Tensor):
        shape = value.shape
        try:
            numel = shape.numel()  # torch.Size's own product; a symbolic size may give a SymInt, or fail
        except Exception:  # noqa: BLE001
            numel = None
        if type(numel) is not int:
            numel = _numel(shape)
            if numel is None:
                return None, TENSOR
        size = sizes.get(value.dtype)
        if size is None:
            size = sizes[value.dtype] = element_size(value.dtype, dtype)
        return numel * size, TENSOR
    return value_bytes(node, float_dtype=dtype), None


def written_tensors(
    graph_module: torch.fx.GraphModule,
    ops: Sequence[torch.fx.Node],
    modules: Mapping[str, torch.nn.Module],
    mutations: Mapping[torch.fx.Node, list[torch.fx.Node]] | None = None,
) -> dict[tuple[str, object], set[int]]:
    """Each tensor some op writes in place -> the ops that must run where it lives (op indices).

    A tensor is its storage: the alias root of what an op writes (a view's
    base, followed back). Its group holds every op that writes it or makes a
    view of it, and the op that makes it (an activation) or first reads it (a
    model input: its copy lives where that op runs; a weight: the caller adds
    its first reader). Readers elsewhere get copies, made again after each
    write (:class:`~fxsplit.planning.build.WriteVersions`). Keys:
    ``("weight", id(tensor))``, ``("node", name)``. ``mutations``: :func:`mutated_inputs` of the
    ops that write something, when the caller has it.
    """
    if mutations is None:
        mutations = {node: targets for node in ops if (targets := mutated_inputs(node, modules))}
    index = {node: i for i, node in enumerate(ops)}
    groups: dict[tuple[str, object], set[int]] = {}
    roots: dict[torch.fx.Node, tuple[str, object]] = {}
    for node, targets in mutations.items():
        for target in targets:
            root = alias_root(target)
            weight = attr_at(graph_module, str(root.target)) if root.op == "get_attr" else None
            key: tuple[str, object] = ("weight", id(weight)) if weight is not None else ("node", root.name)
            group = groups.setdefault(key, set())
            group.add(index[node])
            roots[root] = key
            if root in index:
                group.add(index[root])
            elif root.op == "placeholder":
                group.add(min((index[u] for u in root.users if u in index), default=index[node]))
    if roots:
        for node in ops:  # views of a written tensor go with it: a copy of one would not see the writes
            root = alias_root(node)
            if root is not node and root in roots:
                groups[roots[root]].add(index[node])
    return groups


def tensor_reads(
    graph_module: torch.fx.GraphModule, modules: Mapping[str, torch.nn.Module] | None = None
) -> Iterator[tuple[torch.fx.Node, str, torch.Tensor]]:
    """``(node, path, tensor)`` for each tensor a node reads from the module, in graph order.

    A ``get_attr`` node reads its target when that is a tensor; a
    ``call_module`` node reads each parameter and buffer of its module
    (:func:`named_tensors` order, so a tensor the module holds under two names
    twice), at ``"<module path>.<name>"``. This is what a :class:`Weight`'s
    ``nodes`` are made of; paths are the graph module's.

    Args:
        graph_module: the traced graph and the module it reads from.
        modules: ``dict(graph_module.named_modules())``, when the caller has it.
    """
    modules = modules if modules is not None else module_table(graph_module)
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            attr = attr_at(graph_module, str(node.target))
            if isinstance(attr, torch.Tensor):
                yield node, str(node.target), attr
        elif node.op == "call_module":
            for name, tensor in module_tensors(modules[str(node.target)]):
                yield node, f"{node.target}.{name}", tensor
