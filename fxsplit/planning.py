"""Turn a solved partition of a traced graph into a :class:`Plan`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.fx

from fxsplit.cost import GraphCosts, Weight
from fxsplit.errors import BudgetError
from fxsplit.graphinfo import NONTENSOR, is_guard, value_kind
from fxsplit.partition import Partition
from fxsplit.plan import Cut, Plan
from fxsplit.units import format_size

__all__ = ["Read", "cuts_for", "make_plan", "reads_of", "weights_by_node"]


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
    devices: Sequence[str],
    budgets: dict[str, int],
    *,
    output_device: str | None,
    trace: str,
    objective: str,
) -> Plan:
    """Name where every node and parameter goes, and list the copies the forward makes."""
    op_device = {op.name: devices[d] for op, d in zip(costs.ops, solution.op_devices, strict=True)}
    used = [devices[d] for d in solution.op_devices]
    out_device = output_device or (used[-1] if used else devices[0])

    weight_home: dict[str, str] = {}
    # device_bytes counts parameters and buffers only; load is everything the partitioner
    # charged (activations, gradients, optimizer state too, when the problem carries them).
    device_bytes = dict.fromkeys(devices, 0)
    load = {d: int(solution.device_weights[k]) for k, d in enumerate(devices)}
    for weight, value_index in zip(costs.weights, costs.weight_values, strict=True):
        if value_index >= 0:
            start = costs.problem.values[value_index].start
            weight_home[weight.names[0]] = devices[solution.op_devices[start]]
            device_bytes[weight_home[weight.names[0]]] += weight.nbytes
    idle = [w for w, v in zip(costs.weights, costs.weight_values, strict=True) if v < 0]
    for weight in idle + costs.unused:
        home = weight_home[weight.names[0]] = _place_unused(weight, weight_home, load, budgets)
        device_bytes[home] += weight.nbytes
        load[home] += weight.nbytes

    placement: dict[str, str] = {}
    order = {op.name: i for i, op in enumerate(costs.ops)}
    by_node = weights_by_node(costs)
    for node in graph_module.graph.nodes:
        if node.op == "output":
            placement[node.name] = out_device
        elif node.name in op_device:
            placement[node.name] = op_device[node.name]
        elif is_guard(node):  # export's input check runs where the inputs first arrive
            inputs = [placement[arg.name] for arg in node.all_input_nodes if arg.name in placement]
            placement[node.name] = inputs[0] if inputs else out_device
        elif node.op == "get_attr" and node.name in by_node:
            placement[node.name] = weight_home[by_node[node.name][0].names[0]]
        else:
            readers = [order[u.name] for u in node.users if u.name in order]
            placement[node.name] = op_device[costs.ops[min(readers)].name] if readers else out_device

    param_devices = {name: weight_home[w.names[0]] for w in [*costs.weights, *costs.unused] for name in w.names}
    modules: dict[str, dict[str, None]] = {d: {} for d in devices}  # ordered sets: first use order
    for op, label in zip(costs.ops, costs.problem.op_labels, strict=True):
        if label:
            modules[op_device[op.name]].setdefault(label)
    cuts = _cuts(costs, graph_module, placement, weight_home)
    return Plan(
        devices=tuple(devices),
        budgets=dict(budgets),
        placement=placement,
        param_devices=dict(sorted(param_devices.items())),
        device_bytes=device_bytes,
        cuts=tuple(cuts),
        output_device=out_device,
        trace=trace,
        objective=objective,
        modules={d: tuple(m) for d, m in modules.items()},
    )


def _place_unused(weight: Weight, home: dict[str, str], load: dict[str, int], budgets: dict[str, int]) -> str:
    """A parameter no op reads goes beside its module's other tensors, else where it fits first."""
    module = weight.names[0].rpartition(".")[0]
    for name, device in home.items():
        if name.rpartition(".")[0] == module and load[device] + weight.nbytes <= budgets[device]:
            return device
    for device, budget in budgets.items():
        if load[device] + weight.nbytes <= budget:
            return device
    raise BudgetError(
        f"parameter '{weight.names[0]}' ({format_size(weight.nbytes)}, read by no op of the graph) fits no "
        f"device's remaining budget; raise a budget by {format_size(weight.nbytes)} or delete the unused tensor"
    )


def cuts_for(
    costs: GraphCosts,
    graph_module: torch.fx.GraphModule,
    placement: dict[str, str],
    weight_home: dict[str, str],
) -> list[Cut]:
    """The copies a placement implies, in forward order (for checking a saved plan)."""
    return _cuts(costs, graph_module, placement, weight_home)


def _cuts(
    costs: GraphCosts,
    graph_module: torch.fx.GraphModule,
    placement: dict[str, str],
    weight_home: dict[str, str],
) -> list[Cut]:
    by_node = weights_by_node(costs)
    sent: set[tuple[str, str]] = set()
    cuts: list[Cut] = []
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        destination = placement[node.name]
        for read in reads_of(node, by_node):
            nbytes: int | None
            if read.weight is not None:
                source, nbytes = weight_home[read.key], read.weight.nbytes
            else:
                source, nbytes = placement[read.key], costs.value_nbytes.get(read.key)
            if source != destination and (read.key, destination) not in sent:
                sent.add((read.key, destination))
                cuts.append(Cut(read.key, source, destination, nbytes, read.kind))
    return cuts
