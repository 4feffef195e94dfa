"""Turn a solved partition of a traced graph into a :class:`Plan`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Collection, Mapping, NoReturn, Sequence

import torch.fx

from fxsplit.cost.build import GraphCosts, Weight
from fxsplit.errors import BudgetError
from fxsplit.options import Budgets
from fxsplit.partition.solve import Partition
from fxsplit.planning.plan import Cut, Plan
from fxsplit.tracing.graphinfo import NONTENSOR, alias_root, is_guard, mutated_inputs, value_kind
from fxsplit.units import format_size

__all__ = ["Read", "WriteVersions", "cuts_for", "make_plan", "reads_of", "unread_weights", "weights_by_node"]


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
            found.setdefault(node, []).append(weight)
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
        output_device: where the outputs go (None: the last device that runs ops).
        trace: how the graph was traced.
        objective: what the partitioner optimised.
        repartition: partitions the ops again under other caps, in device order.
    """
    devices = budgets.devices
    room = dict(zip(devices, budgets.caps() if caps is None else caps, strict=True))
    unread_home = _pack_unread(costs, devices, room, solution)
    if unread_home is None and repartition is not None:
        solution, unread_home = _set_aside_unread(costs, devices, room, repartition, solution)
    if unread_home is None:
        _raise_unread(costs, devices, room, list(solution.device_weights))
    used = [devices[d] for d in solution.op_devices]  # the device of each op, in op order
    op_device = dict(zip([op.name for op in costs.ops], used, strict=True))
    out_device = output_device or (used[-1] if used else devices[0])

    # device_bytes counts parameters and buffers only (the partitioner also charged activations,
    # gradients and optimizer state, when the problem carries them).
    weight_home = {**_read_homes(costs, devices, solution), **unread_home}
    weight_home.update({alias: weight_home[target] for alias, target in costs.aliases.items()})
    device_bytes = dict.fromkeys(devices, 0)
    for weight in [*costs.weights, *costs.unused]:
        device_bytes[weight_home[weight.names[0]]] += weight.nbytes

    by_node = weights_by_node(costs)
    placement = _placement(costs, graph_module, op_device, weight_home, by_node, out_device)
    param_devices = {name: weight_home[w.names[0]] for w in [*costs.weights, *costs.unused] for name in w.names}
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
            order = order or {op.name: i for i, op in enumerate(costs.ops)}
            readers = [order[u.name] for u in node.users if u.name in order]
            placement[node.name] = op_device[costs.ops[min(readers)].name] if readers else out_device
    return placement


def unread_weights(costs: GraphCosts) -> list[Weight]:
    """Parameters and buffers no op of the graph reads, in the model's order."""
    idle = [w for w, v in zip(costs.weights, costs.weight_values, strict=True) if v < 0]
    return idle + costs.unused


def _read_homes(costs: GraphCosts, devices: Sequence[str], solution: Partition) -> dict[str, str]:
    """Canonical name -> device of every weight some op reads: where its first reader runs."""
    homes: dict[str, str] = {}
    values, op_devices = costs.problem.values, solution.op_devices
    for weight, value_index in zip(costs.weights, costs.weight_values, strict=True):
        if value_index >= 0:
            homes[weight.names[0]] = devices[op_devices[values[value_index].start]]
    return homes


def _pack_unread(
    costs: GraphCosts, devices: Sequence[str], caps: dict[str, int], solution: Partition
) -> dict[str, str] | None:
    """Canonical name -> device for the tensors no op reads, in the room ``solution`` leaves, or None.

    Largest first (ties in the model's order); each goes beside its module's
    other tensors when some are read and it fits there, else to the device
    with the least room that holds it (big gaps stay for big tensors).
    """
    unread = unread_weights(costs)
    if not unread:
        return {}
    room = {d: caps[d] - int(load) for d, load in zip(devices, solution.device_weights, strict=True)}
    module_home: dict[str, str] = {}
    for name, device in _read_homes(costs, devices, solution).items():
        module_home.setdefault(name.rpartition(".")[0], device)
    homes: dict[str, str] = {}
    for weight in sorted(unread, key=lambda w: -w.nbytes):
        module = weight.names[0].rpartition(".")[0]
        beside = module_home.get(module)
        fitting = [d for d in devices if room[d] >= weight.nbytes]
        if not fitting:
            return None
        home = beside if beside in fitting else min(fitting, key=lambda d: room[d])
        homes[weight.names[0]] = home
        room[home] -= weight.nbytes
    return homes


def _set_aside_unread(
    costs: GraphCosts,
    devices: Sequence[str],
    caps: dict[str, int],
    repartition: Callable[[Sequence[int]], Partition],
    first: Partition,
) -> tuple[Partition, dict[str, str]]:
    """Set room aside for the unread tensors, partition the ops into what is left, then pack the tensors into
    the room that leaves; over several ways of setting room aside (:func:`_reservations`), the one that copies
    fewest bytes (ties: the first). Refuses when none fits."""
    weights = sorted(unread_weights(costs), key=lambda w: -w.nbytes)
    reservations = _reservations(weights, devices, caps, first)
    if not reservations:
        _raise_unread(costs, devices, caps, [0] * len(devices))
    best: tuple[Partition, dict[str, str]] | None = None
    error: BudgetError | None = None
    for aside in reservations:
        try:
            solution = repartition([caps[d] - sum(w.nbytes for w in aside[d]) for d in devices])
        except BudgetError as refused:
            error = error or refused
            continue
        homes = _pack_unread(costs, devices, caps, solution) or {w.names[0]: d for d in devices for w in aside[d]}
        if best is None or solution.transfer_bytes < best[0].transfer_bytes:
            best = (solution, homes)
    if best is None:
        unread = sum(w.nbytes for w in weights)
        raise BudgetError(
            f"the ops fit the budgets only if the {format_size(unread)} of tensors no op reads "
            f"({_largest_unread(costs)}) are left out; with room set aside for them first: {error}"
        ) from None
    return best


def _reservations(
    weights: list[Weight], devices: Sequence[str], caps: dict[str, int], first: Partition
) -> list[dict[str, list[Weight]]]:
    """Ways to pack ``weights`` (largest first) into ``caps``, each as device -> its tensors, distinct by the
    bytes each device keeps: into the gaps ``first`` leaves (the tightest that holds each, else the device
    with the most room); each onto the device with the most room (spread); and, for each device, onto it
    first, then onto the next ones in order (so the ops keep other devices whole)."""
    gaps = {d: caps[d] - int(load) for d, load in zip(devices, first.device_weights, strict=True)}

    def into_gaps(room: dict[str, int], nbytes: int) -> str:
        held = [d for d in devices if gaps[d] - (caps[d] - room[d]) >= nbytes]
        return min(held, key=lambda d: gaps[d] - caps[d] + room[d]) if held else max(devices, key=room.__getitem__)

    def spread(room: dict[str, int], nbytes: int) -> str:
        return max(devices, key=room.__getitem__)

    def in_order(order: list[str]) -> Callable[[dict[str, int], int], str]:
        return lambda room, nbytes: next((d for d in order if room[d] >= nbytes), order[0])

    rules = [into_gaps, spread, *(in_order([*devices[k:], *devices[:k]]) for k in range(len(devices)))]
    found: list[dict[str, list[Weight]]] = []
    seen: set[tuple[int, ...]] = set()
    for rule in rules:
        room, aside = dict(caps), {d: list[Weight]() for d in devices}
        for weight in weights:
            home = rule(room, weight.nbytes)
            room[home] -= weight.nbytes
            aside[home].append(weight)
        kept = tuple(room[d] for d in devices)
        if min(kept) >= 0 and kept not in seen:
            seen.add(kept)
            found.append(aside)
    return found


def _largest_unread(costs: GraphCosts) -> str:
    weights = sorted(unread_weights(costs), key=lambda w: -w.nbytes)
    listed = ", ".join(f"'{w.names[0]}' {format_size(w.nbytes)}" for w in weights[:3])
    return listed + (f" and {len(weights) - 3} more" if len(weights) > 3 else "")


def _raise_unread(costs: GraphCosts, devices: Sequence[str], caps: dict[str, int], loads: list[int]) -> NoReturn:
    room = {d: caps[d] - load for d, load in zip(devices, loads, strict=True)}
    weights = sorted(unread_weights(costs), key=lambda w: -w.nbytes)
    largest = weights[0]
    total = sum(w.nbytes for w in weights)
    raise BudgetError(
        f"the tensors no op of the graph reads ({format_size(total)}: {_largest_unread(costs)}) do not fit what "
        f"the budgets leave ({', '.join(f'{d!r} {format_size(max(r, 0))}' for d, r in room.items())}); "
        f"raise a budget by {format_size(largest.nbytes)} or more, or delete the unused tensors"
    )


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
                kind = "output" if op == "output" else "input" if arg.op == "placeholder" else "activation"
                send(arg.name, arg, None, placement[arg.name] if source is None else source, kind)
            if op == "call_module" and node.name in by_node:
                read_weights(by_node[node.name], None)
        if writers is None or node.name in writers:
            versions.written(node)
    return cuts
