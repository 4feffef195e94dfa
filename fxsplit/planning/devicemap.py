"""Accelerate-style device maps: where each weight lives, and where the ops that read them run.

A device map (``{"model.embed": 0, "model.layers.3": "cuda:1", "lm_head": "cpu"}``)
places parameters and buffers by module (or tensor) name; ``""`` names the
whole model. It says nothing about ops: a module may run no op of the traced
graph (a tied embedding read through another name), or one op may read
weights on two devices. Here the weights stay exactly where the map puts them
and each op that reads weights runs where most of its weight bytes live; the
other ops go where they need the fewest copies (:func:`place_ops`).

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
>>> read_device_map(model, {"0": "cpu:0", "1.weight": "cpu:1", "1.bias": 1}, {1: "cpu:0"})
{'0.weight': 'cpu:0', '0.bias': 'cpu:0', '1.weight': 'cpu:1', '1.bias': 'cpu:0'}
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from fxsplit.cost.build import GraphCosts, named_tensors
from fxsplit.devices import normalize_device
from fxsplit.errors import SpecError
from fxsplit.partition.mincut import exchange
from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.refine import device_loads, frozen_ops, improve
from fxsplit.partition.result import Partition, transfer_bytes
from fxsplit.planning.build import cuts_for, reads_of, weights_by_node
from fxsplit.planning.plan import Plan

__all__ = [
    "OFFLOAD",
    "free_readers",
    "map_devices",
    "pin_readers",
    "place_ops",
    "read_device_map",
    "value_homes",
    "with_weight_homes",
    "writer_pins",
]

OFFLOAD = ("disk", "meta")
"""Map values that offload weights instead of placing them on a device (not supported yet)."""

_UNLIMITED = 1 << 62


def map_devices(device_map: Mapping[Any, Any], devices: Mapping[Any, Any] | None = None) -> dict[str, str]:
    """Key -> canonical device of every entry of ``device_map``, values read through ``devices`` first.

    Raises:
        SpecError: the map is not a mapping, or values offload (``"disk"``)
            or name no device; every such entry listed.
    """
    if not isinstance(device_map, Mapping):
        raise SpecError(f"device_map must be a mapping of module names to devices (got {type(device_map).__name__})")
    translate = dict(devices or {})
    found: dict[str, str] = {}
    problems: list[str] = []
    for key, value in device_map.items():
        value = translate.get(value, value)
        if (
            isinstance(value, str)
            and value.strip() in OFFLOAD
            or isinstance(value, torch.device)
            and value.type == "meta"
        ):
            problems.append(
                f"{str(key)!r}: {value!r} offloads, which fxsplit does not support yet; "
                "map it to a device such as 'cpu' (weights there are kept in host memory)"
            )
            continue
        try:
            found[str(key)] = normalize_device(value)
        except SpecError as error:
            problems.append(f"{str(key)!r}: {error}")
    _raise("device_map has values that place nothing on a device", problems)
    return found


def read_device_map(
    model: torch.nn.Module,
    device_map: Mapping[Any, Any],
    devices: Mapping[Any, Any] | None = None,
    where: Callable[[str], str] | None = None,
) -> dict[str, str]:
    """Qualified name of every parameter and buffer of ``model`` (tied names too) -> its device.

    Each tensor goes where the longest key naming it or a module holding it
    says (``""``: the whole model); a tied tensor no key covers under one
    name goes where its other name does. A buffer no key covers is left out (the
    plan puts it beside its readers): Accelerate's maps leave out the buffers
    of the modules they split, such as BERT's ``embeddings.position_ids``. Values are ints (``cuda:N``), strings or
    ``torch.device``; ``devices`` translates values first (``{0: "cpu:0"}``);
    ``where(key)`` says where a key was written, for messages.

    Raises:
        SpecError: listing every parameter no key covers, every key that names
            nothing in the model (with the closest names), every offloading
            or unknown value, and every tied tensor whose names the map puts
            on different devices.
    """
    keyed = map_devices(device_map, devices)
    tensors = named_tensors(model)
    known = {name for name, _ in model.named_modules(remove_duplicate=False)} | {name for name, _, _ in tensors}
    problems = [(f"{where(key)}: " if where else "") + _unknown_key(key, known) for key in keyed if key not in known]
    homes: dict[str, str] = {}
    first_name: dict[int, str] = {}
    left: list[tuple[str, torch.Tensor, bool]] = []
    for name, tensor, is_buffer in tensors:
        key = _longest_key(name, keyed)
        if key is None:
            left.append((name, tensor, is_buffer))
            continue
        homes[name] = keyed[key]
        other = first_name.setdefault(id(tensor), name)
        if other in homes and homes[other] != homes[name]:
            problems.append(
                f"{other!r} and {name!r} are one tensor (tied) but the map puts them on {homes[other]!r} and "
                f"{homes[name]!r}; map both names to one device"
            )
    uncovered: list[str] = []
    for name, tensor, is_buffer in left:  # a tied tensor goes where its other name does
        if id(tensor) in first_name:
            homes[name] = homes[first_name[id(tensor)]]
        elif not is_buffer:  # Accelerate leaves out the buffers of the modules it splits: fxsplit places them
            uncovered.append(name)
    if uncovered:
        listed = ", ".join(map(repr, uncovered[:8])) + (f" and {len(uncovered) - 8} more" if len(uncovered) > 8 else "")
        problems.append(
            f"no key covers {len(uncovered)} tensor(s): {listed}; add a key for each, for a module holding them, "
            "or '' for the whole model"
        )
    _raise("device_map does not place the model's tensors", problems)
    return homes


def _longest_key(name: str, keyed: Mapping[str, str]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), -1, -1):
        prefix = ".".join(parts[:end])
        if prefix in keyed:
            return prefix
    return None


def _unknown_key(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=3)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else "; keys are module or tensor names"
    return f"key {key!r} names no module, parameter or buffer of the model{hint}"


def _raise(what: str, problems: list[str]) -> None:
    if problems:
        raise SpecError(f"{what}:\n  " + "\n  ".join(problems))


def pin_readers(costs: GraphCosts, homes: Mapping[str, str], devices: Sequence[str]) -> dict[int, int]:
    """Op index -> device index for every op that reads weights: where most of its weight bytes live.

    Ties go to the earlier device. Ops that write buffers in place go where
    :func:`writer_pins` says. Weights the map does not name (constants only
    the traced graph has) do not pin.
    """
    index = {d: i for i, d in enumerate(devices)}
    by_node = weights_by_node(costs)
    pins: dict[int, int] = {}
    for op_index, op in enumerate(costs.ops):
        held = [0] * len(devices)
        read = False
        for found in reads_of(op, by_node):
            if found.weight is not None and found.weight.names[0] in homes:
                held[index[homes[found.weight.names[0]]]] += found.weight.nbytes
                read = True
        if read:
            pins[op_index] = max(range(len(devices)), key=lambda d: (held[d], -d))
    pins.update(writer_pins(costs, homes, devices))
    return pins


def writer_pins(costs: GraphCosts, homes: Mapping[str, str], devices: Sequence[str]) -> dict[int, int]:
    """Op index -> device index for every op that reads a buffer the forward writes in place (BatchNorm's
    running statistics): where that buffer lives, so that the write reaches it.

    Raises:
        SpecError: one op reads such buffers that the map puts on two devices.
    """
    index = {d: i for i, d in enumerate(devices)}
    by_node = weights_by_node(costs)
    movable = {
        w.names[0]: v < 0 or costs.problem.values[v].movable
        for w, v in zip(costs.weights, costs.weight_values, strict=True)
    }
    pins: dict[int, int] = {}
    for op_index, op in enumerate(costs.ops):
        forced: dict[str, str] = {}
        for found in reads_of(op, by_node):
            weight = found.weight
            if weight is None or not weight.is_buffer or weight.names[0] not in homes:
                continue
            if weight.names[0] in costs.written or not movable.get(weight.names[0], True):
                forced.setdefault(homes[weight.names[0]], weight.names[0])
        if len(forced) > 1:
            raise SpecError(
                f"op '{op.name}' writes {' and '.join(map(repr, forced.values()))} in place, but the device map puts "
                f"them on {' and '.join(map(repr, forced))}; map them to one device"
            )
        if forced:
            pins[op_index] = index[next(iter(forced))]
    return pins


def place_ops(problem: PartitionProblem, pins: Mapping[int, int], num_devices: int) -> Partition:
    """Place every op: pinned ones where ``pins`` says, the others to copy the fewest bytes (no budgets).

    Free ops start on the device of the nearest pinned op before them (after
    them at the start of the graph); pairwise min-cuts, then single moves,
    take every move that copies less. Ops that must share a device with a
    pinned one (state written in place) follow it.

    >>> from fxsplit.partition.problem import Value
    >>> chain = PartitionProblem(("a", "b", "c"), (Value("a", 10, 0, (1,)), Value("b", 1, 1, (2,))))
    >>> place_ops(chain, {0: 0, 2: 1}, 2).op_devices
    (0, 0, 1)
    """
    pinned = dataclasses.replace(problem, pinned=dict(pins))
    start = [0] * problem.num_ops
    nearest = pins[min(pins)] if pins else 0
    for op in range(problem.num_ops):
        nearest = pins.get(op, nearest)
        start[op] = nearest
    for lo, hi in problem.no_cut_spans():
        held = [pins[op] for op in range(lo, hi + 1) if op in pins]
        for op in range(lo, hi + 1):
            start[op] = pins.get(op, held[0] if held else start[lo])
    for group in problem.colocated:  # the ops that write one tensor run where it lives: never moved after this
        held = sorted({pins[op] for op in group if op in pins})
        if len(held) > 1:
            raise SpecError(
                f"ops {', '.join(repr(problem.op_names[op]) for op in group[:4])} write one tensor in place, but "
                f"the device map puts what they read on {len(held)} devices; map it so they share one device"
            )
        for op in group:
            start[op] = held[0] if held else start[group[0]]
    unlimited = [_UNLIMITED] * num_devices
    placed = start
    if num_devices > 1 and problem.num_ops:
        placed = exchange(pinned, start, unlimited, frozen_ops(pinned))
        placed = improve(pinned, placed, unlimited)
    loads = device_loads(problem, placed, num_devices)
    return Partition(tuple(placed), transfer_bytes(problem, placed), tuple(loads))


def value_homes(costs: GraphCosts, homes: Mapping[str, str], devices: Sequence[str]) -> dict[int, int]:
    """Value index -> device index of every weight value of ``costs.problem`` that ``homes`` places."""
    index = {d: i for i, d in enumerate(devices)}
    return {
        value: index[homes[weight.names[0]]]
        for weight, value in zip(costs.weights, costs.weight_values, strict=True)
        if value >= 0 and weight.names[0] in homes
    }


def free_readers(
    problem: PartitionProblem,
    homes: Mapping[int, int],
    start: Sequence[int],
    num_devices: int,
    keep: Mapping[int, int] | None = None,
) -> Partition:
    """Place every op around weights with fixed homes, their readers free: a copy of a small weight may
    replace a copy of a large activation.

    ``homes``: value index -> device index, for the weights whose home is
    fixed. Each device gets an anchor op pinned to it, and a weight's home is
    its device's anchor, so reading the weight on another device costs its
    bytes once per forward, as an activation's copy does. From ``start``
    (e.g. :func:`place_ops` with every reader pinned), pairwise min-cuts, then
    single and group moves, take every move that copies less, so the result
    never copies more than ``start`` by this count. Weights written in place
    (not movable) keep their readers where ``start`` put them, and ``keep``
    (op index -> device index, e.g. :func:`writer_pins`) pins more ops.

    >>> from fxsplit.partition.problem import Value
    >>> # ops 0 and 2 read big weights on device 0, op 1 a 4-byte one on device 1: copy it, not the activations
    >>> weights = [Value(n, b, op, (op,), weight=b) for n, b, op in (("x", 1000, 0), ("w", 4, 1), ("y", 1000, 2))]
    >>> chain = PartitionProblem(("a", "b", "c"), (Value("a", 100, 0, (1,)), Value("b", 100, 1, (2,)), *weights))
    >>> free_readers(chain, {2: 0, 3: 1, 4: 0}, (0, 1, 0), 2).op_devices
    (0, 0, 0)
    """
    shift = num_devices
    pinned = {d: d for d in range(num_devices)}
    pinned.update({op + shift: d for op, d in {**problem.pinned, **(keep or {})}.items()})
    values = []
    for index, value in enumerate(problem.values):
        consumers = tuple(op + shift for op in value.consumers)
        if index in homes and value.movable:
            values.append(value._replace(start=homes[index], consumers=consumers))
            continue
        if index in homes:
            pinned.update({op + shift: start[op] for op in (value.start, *value.consumers)})
        values.append(value._replace(start=value.start + shift, consumers=consumers))
    pad = (0,) * num_devices
    anchored = PartitionProblem(
        op_names=tuple(f"<weights on device {d}>" for d in range(num_devices)) + problem.op_names,
        values=tuple(values),
        pinned=pinned,
        together=tuple(tuple(op + shift for op in group) for group in problem.together),
        op_labels=(("",) * num_devices + problem.op_labels) if problem.op_labels else (),
        op_extra=(pad + problem.op_extra) if problem.op_extra else (),
        op_transient=(pad + problem.op_transient) if problem.op_transient else (),
        colocated=tuple(tuple(op + shift for op in group) for group in problem.colocated),
    )
    placed = list(range(num_devices)) + list(start)
    if num_devices > 1 and problem.num_ops:
        unlimited = [_UNLIMITED] * num_devices
        placed = exchange(anchored, placed, unlimited, frozen_ops(anchored))
        placed = improve(anchored, placed, unlimited)
    ops = placed[shift:]
    return Partition(tuple(ops), transfer_bytes(problem, ops), tuple(device_loads(problem, ops, num_devices)))


def with_weight_homes(
    plan: Plan, costs: GraphCosts, graph_module: torch.fx.GraphModule, homes: Mapping[str, str]
) -> Plan:
    """``plan`` with every tensor ``homes`` names on that device, and the reads and copies that implies.

    Tensors ``homes`` does not name keep their place in ``plan``.
    """
    weights = [*costs.weights, *costs.unused]
    weight_home = {w.names[0]: homes.get(w.names[0], plan.param_devices[w.names[0]]) for w in weights}
    by_node = weights_by_node(costs)
    placement = dict(plan.placement)
    for node in graph_module.graph.nodes:
        if node.op == "get_attr" and node.name in by_node:
            placement[node.name] = weight_home[by_node[node.name][0].names[0]]
    device_bytes = dict.fromkeys(plan.devices, 0)
    for weight in weights:
        device_bytes[weight_home[weight.names[0]]] += weight.nbytes
    param_devices = {name: weight_home[w.names[0]] for w in weights for name in w.names}
    return dataclasses.replace(
        plan,
        placement=placement,
        param_devices=dict(sorted(param_devices.items())),
        device_bytes=device_bytes,
        cuts=tuple(cuts_for(costs, graph_module, placement, weight_home)),
    )
