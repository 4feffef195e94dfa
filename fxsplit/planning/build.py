"""Turn a solved partition of a traced graph into a :class:`Plan`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Collection, Mapping, Sequence

import torch.fx

from fxsplit.cost.build import GraphCosts, Weight
from fxsplit.options import Budgets
from fxsplit.partition.solve import Partition
from fxsplit.planning.plan import Cut, Plan
from fxsplit.planning.unread import pack_unread, raise_unread, read_homes, set_aside_unread
from fxsplit.tracing.graphinfo import NONTENSOR, alias_root, is_guard, mutated_inputs, tensor_origin, value_kind

__all__ = ["Read", "WriteVersions", "cuts_for", "make_plan", "output_values", "reads_of", "weights_by_node"]


@dataclass(frozen=True)
class Read:
    """A value an op reads that lives somewhere: an activation, an input or a weight.

    ``key`` is the node name, or the canonical parameter name for weights (so
    tied tensors are one value); ``node`` is the graph node read, None for the
    parameters a ``call_module`` reads through its module.
    """

    key: str
    node: torch.fx.Node | None
    weight: Weight | None
    kind: str


def reads_of(node: torch.fx.Node, by_node: dict[str, list[Weight]]) -> list[Read]:
    """The values ``node`` reads that may have to be copied to its device, in argument order."""
    found: list[Read] = []
    if is_guard(node):
        return found
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            found.extend(Read(w.names[0], arg, w, "parameter") for w in by_node.get(arg.name, ()))
        elif value_kind(arg) != NONTENSOR:
            kind = "input" if arg.op == "placeholder" else "activation"
            found.append(Read(arg.name, arg, None, "output" if node.op == "output" else kind))
    if node.op == "call_module":
        found.extend(Read(w.names[0], None, w, "parameter") for w in by_node.get(node.name, ()))
    return found


class WriteVersions:
    """How often the tensor behind each value has been written in place so far, as the graph runs in order.

    A copy of a value made for another device holds the value as it was
    when copied; after a write to the tensor it shares storage with (its
    alias root), a reader there needs a new copy. The emitter and
    :func:`cuts_for` walk the graph with one of these, calling
    :meth:`written` after each node, and make a copy again when the version
    of what they read has changed. Weights are keyed by canonical name,
    other tensors by their alias root's node name.
    """

    def __init__(
        self,
        graph_module: torch.fx.GraphModule,
        by_node: dict[str, list[Weight]],
        writers: frozenset[str] | None = None,
    ) -> None:
        self.graph_module = graph_module
        self.by_node = by_node
        self.writers = writers  # the nodes that may write in place (None: any may)
        self.counts: dict[str, int] = {}

    @cached_property
    def modules(self) -> dict[str, torch.nn.Module]:
        """``dict(graph_module.named_modules())``, made when a node first needs it."""
        return dict(self.graph_module.named_modules())

    def _key(self, node: torch.fx.Node) -> str:
        root = alias_root(node)
        if root.op == "get_attr" and root.name in self.by_node:
            return self.by_node[root.name][0].names[0]
        return root.name

    def of(self, read: Read) -> int:
        """The version of what ``read`` reads: 0 until its tensor is first written."""
        if not self.counts:
            return 0
        return self.counts.get(read.key if read.node is None else self._key(read.node), 0)

    def written(self, node: torch.fx.Node) -> None:
        """Count the in-place writes ``node`` makes."""
        if self.writers is not None and node.name not in self.writers:
            return
        for target in mutated_inputs(node, self.modules):
            key = self._key(target)
            self.counts[key] = self.counts.get(key, 0) + 1


def weights_by_node(costs: GraphCosts) -> dict[str, list[Weight]]:
    """Graph node name -> the weights it reads (get_attr and call_module nodes)."""
    found: dict[str, list[Weight]] = {}
    for weight in costs.weights:
        for node in weight.nodes:
            readers = found.get(node)
            if readers is None:
                found[node] = [weight]
            else:
                readers.append(weight)
    return found


def make_plan(
    costs: GraphCosts,
    graph_module: torch.fx.GraphModule,
    solution: Partition,
    budgets: Budgets,
    *,
    caps: Sequence[int] | None = None,
    output_device: str | None,
    trace: str,
    objective: str,
    repartition: Callable[[Sequence[int]], Partition] | None = None,
) -> Plan:
    """Name where every node and parameter goes, and list the copies the forward makes.

    The plan's devices are those of ``budgets``, in order, and it records
    their full budgets and reserves (``Plan.budgets``, ``Plan.reserved``).
    Tensors no op reads (unused submodules, weights the graph never reads) go
    where room is left after ``solution``, largest first. When they do not
    fit the gaps and ``repartition`` (partition under other caps) is
    given, they are packed together with the ops: room is set aside for them
    in several ways (into the gaps, spread, or each device filled first),
    the ops partitioned again into what is left each time, and the cheapest
    result kept.

    Args:
        costs: the cost model ``solution`` partitioned.
        graph_module: the traced graph.
        solution: the partition of ``costs.problem``.
        budgets: the devices' budgets.
        caps: bytes each device may hold, in device order, as ``solution``
            was made under (default: ``budgets.caps()``, budget less reserve;
            lower where :func:`fxsplit.memory.fit_budgets` plans again).
        output_device: where the outputs go (None: where ``solution`` put them, when the partitioner placed them
            with the ops (:mod:`fxsplit.partition.outputs`); else the last device that runs ops).
        trace: how the graph was traced.
        objective: what the partitioner optimised.
        repartition: partitions the ops again under other caps, in device order.
    """
    devices = budgets.devices
    room = dict(zip(devices, budgets.caps() if caps is None else caps, strict=True))
    unread_home = pack_unread(costs, devices, room, solution)
    if unread_home is None and repartition is not None:
        solution, unread_home = set_aside_unread(costs, devices, room, repartition, solution)
    if unread_home is None:
        raise_unread(costs, devices, room, list(solution.device_weights))
    used = [devices[d] for d in solution.op_devices]  # the device of each op, in op order
    op_device = dict(zip([op.name for op in costs.ops], used, strict=True))
    out_device = output_device or (used[-1] if used else devices[0])
    if output_device is None and solution.output_device is not None:  # the partitioner placed them with the ops
        out_device = devices[solution.output_device]

    # device_bytes counts parameters and buffers only (the partitioner also charged activations,
    # gradients and optimizer state, when the problem carries them).
    weight_home = {**read_homes(costs, devices, solution), **unread_home}
    weight_home.update({alias: weight_home[target] for alias, target in costs.aliases.items()})
    device_bytes = dict.fromkeys(devices, 0)
    param_devices: dict[str, str] = {}
    for weight in [*costs.weights, *costs.unused]:
        home = weight_home[weight.names[0]]
        device_bytes[home] += weight.nbytes
        for name in weight.names:
            param_devices[name] = home

    by_node = weights_by_node(costs)
    placement = _placement(costs, graph_module, op_device, weight_home, by_node, out_device)
    modules: dict[str, dict[str, None]] = {d: {} for d in devices}  # ordered sets: first use order
    for device, label in zip(used, costs.problem.op_labels, strict=True):
        if label:
            modules[device].setdefault(label)
    cuts = cuts_for(costs, graph_module, placement, weight_home, by_node=by_node)
    return Plan(
        devices=devices,
        budgets=dict(budgets.limits),
        placement=placement,
        param_devices={name: param_devices[name] for name in sorted(param_devices)},
        device_bytes=device_bytes,
        cuts=tuple(cuts),
        output_device=out_device,
        trace=trace,
        objective=objective,
        modules={d: tuple(m) for d, m in modules.items()},
        reserved=dict(budgets.reserved),
        mutated=dict(costs.written),
    )


def output_values(costs: GraphCosts, graph_module: torch.fx.GraphModule) -> list[tuple[str, int, int]]:
    """``(name, bytes, start)`` of each tensor the graph returns that an op makes or reads (``start``: the op that
    makes it, or the first op that reads it; a weight by its canonical name), for
    :func:`~fxsplit.partition.outputs.with_output_reader`. Unknown sizes count one byte, as between ops."""
    output = next((node for node in reversed(graph_module.graph.nodes) if node.op == "output"), None)
    returned = [arg for arg in (output.all_input_nodes if output is not None else ()) if value_kind(arg) != NONTENSOR]
    if not returned:
        return []
    if costs.writers:  # a tensor an earlier node made, written in place and returned: copied under that node's name
        returned = [_origin_of(node) if node.name in costs.writers else node for node in returned]
    ops = costs.ops
    wanted = {node for node in returned if node.op not in ("placeholder", "get_attr")}
    start: dict[torch.fx.Node, int] = {}
    for index in range(len(ops) - 1, -1, -1):  # outputs come late: look from the end, until all are found
        if len(start) == len(wanted):
            break
        if ops[index] in wanted:
            start[ops[index]] = index
    readers = {user for node in returned if node.op == "placeholder" for user in node.users if user.op != "output"}
    for index, op in enumerate(ops):  # a model input lives where it is first read
        if not readers:
            break
        if op in readers:
            readers.discard(op)
            for node in op.all_input_nodes:
                if node.op == "placeholder":
                    start.setdefault(node, index)
    found = []
    for node in returned:
        if node in start:
            nbytes = costs.value_nbytes.get(node.name)
            found.append((node.name, 1 if nbytes is None else nbytes, start[node]))
    attrs = {node.name for node in returned if node.op == "get_attr"}
    if attrs:  # a weight returned as it is: copied from its home, which its first reader decides
        for weight, index in zip(costs.weights, costs.weight_values, strict=True):
            if index >= 0 and attrs.intersection(weight.nodes):
                found.append((weight.names[0], weight.nbytes, costs.problem.values[index].start))
    return found


def _origin_of(node: torch.fx.Node) -> torch.fx.Node:
    """:func:`tensor_origin` of ``node``, unless that is a weight (read as a weight, not copied as a value)."""
    origin = tensor_origin(node)
    return node if origin.op == "get_attr" else origin


def _placement(
    costs: GraphCosts,
    graph_module: torch.fx.GraphModule,
    op_device: dict[str, str],
    weight_home: dict[str, str],
    by_node: dict[str, list[Weight]],
    out_device: str,
) -> dict[str, str]:
    """Node name -> device, in graph order: an op's device; the output's; export's input check where the
    inputs first arrive; a weight read's, its weight's home; any other node's, its first reader's."""
    placement: dict[str, str] = {}
    order: dict[str, int] = {}  # op name -> index, made when a node first needs it
    for node in graph_module.graph.nodes:
        device = op_device.get(node.name)
        if node.op == "output":
            placement[node.name] = out_device
        elif device is not None:
            placement[node.name] = device
        elif is_guard(node):  # export's input check runs where the inputs first arrive
            inputs = [placement[arg.name] for arg in node.all_input_nodes if arg.name in placement]
            placement[node.name] = inputs[0] if inputs else out_device
        elif node.op == "get_attr" and node.name in by_node:
            placement[node.name] = weight_home[by_node[node.name][0].names[0]]
        else:
            readers = [u.name for u in node.users if u.name in op_device]
            if len(readers) > 1:  # the one that runs first
                order = order or {op.name: i for i, op in enumerate(costs.ops)}
                readers = [costs.ops[min(order[name] for name in readers)].name]
            placement[node.name] = op_device[readers[0]] if readers else out_device
    return placement


def cuts_for(
    costs: GraphCosts,
    graph_module: torch.fx.GraphModule,
    placement: dict[str, str],
    weight_home: dict[str, str],
    streamed: Mapping[str, str] | None = None,
    replicas: Mapping[str, Collection[str]] | None = None,
    *,
    by_node: dict[str, list[Weight]] | None = None,
) -> list[Cut]:
    """The copies a placement implies, in forward order (for a new plan, and for checking a saved one).

    ``streamed``: canonical weight name -> its storage tier, for weights
    offloaded off the devices: one ``"stream"`` cut per op that reads one.
    ``replicas``: canonical weight name -> the other devices that hold a copy
    of it (:attr:`Plan.replicas`): read there, it is not copied.
    ``by_node``: :func:`weights_by_node` of ``costs``, when the caller has it.
    """
    by_node = weights_by_node(costs) if by_node is None else by_node
    versions = WriteVersions(graph_module, by_node, costs.writers)
    writers = costs.writers
    sent: set[tuple[str, str, int]] = set()
    cuts: list[Cut] = []
    streams: set[str] = set()

    def send(key: str, node: torch.fx.Node | None, weight: Weight | None, source: str, kind: str) -> None:
        version = versions.of(Read(key, node, weight, kind)) if versions.counts else 0
        if (key, destination, version) not in sent:
            sent.add((key, destination, version))
            nbytes = weight.nbytes if weight is not None else costs.value_nbytes.get(key)
            cuts.append(Cut(key, source, destination, nbytes, kind))

    def read_weights(weights: Sequence[Weight], node: torch.fx.Node | None) -> None:
        for weight in weights:
            key = weight.names[0]
            if streamed and key in streamed:
                if key not in streams:
                    streams.add(key)
                    cuts.append(Cut(key, streamed[key], destination, weight.nbytes, "stream"))
            elif replicas and destination in replicas.get(key, ()):
                continue  # the device holds its own copy
            elif (source := weight_home[key]) != destination:
                send(key, node, weight, source, "parameter")

    # What reads_of(node) lists, in its order, without a Read per read: a value read where it lives is no cut.
    for node in graph_module.graph.nodes:
        op = node.op
        if op == "placeholder" or op == "get_attr":
            continue
        destination = placement[node.name]
        if streams:
            streams = set()  # one stream cut per weight per op
        if op != "call_module" or not is_guard(node):
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    if arg.name in by_node:
                        read_weights(by_node[arg.name], arg)
                    continue
                source = placement.get(arg.name)
                if source == destination or value_kind(arg) == NONTENSOR:
                    continue
                if writers is None or arg.name in writers:
                    arg = _origin_of(arg)  # the tensor an earlier node made, written in place: one copy serves both
                kind = "output" if op == "output" else "input" if arg.op == "placeholder" else "activation"
                send(arg.name, arg, None, placement[arg.name] if source is None else source, kind)
            if op == "call_module" and node.name in by_node:
                read_weights(by_node[node.name], None)
        if writers is None or node.name in writers:
            versions.written(node)
    return cuts
