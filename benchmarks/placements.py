"""Score any placement of a traced model with fxsplit's cost model.

A placement says on which device every op of the traced graph runs and where
every weight lives. Three sources are turned into one:

* an fxsplit :class:`~fxsplit.Plan` (``placement``, ``param_devices`` and ``replicas``);
* a module -> device map, as Accelerate's ``infer_auto_device_map`` returns
  (:func:`from_device_map`, which follows Accelerate's execution rules);
* a per-op device list from the block-level reference.

:func:`score` then counts, per forward, the bytes copied between devices
(each value once per device other than its home that reads it, the rule
:func:`fxsplit.partition.solve.transfer_bytes` uses) and the weight bytes per device.
Weights Accelerate offloads to ``"cpu"`` or ``"disk"`` live on an extra
pseudo-device ``OFF`` (index ``len(budgets)``): they are streamed to the
execution device on every forward, and those bytes are reported apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch.fx

from fxsplit.cost.build import GraphCosts
from fxsplit.planning.plan import Plan
from fxsplit.tracing.graphinfo import module_path

__all__ = ["OFFLOAD_KEYS", "Placement", "Score", "from_device_map", "from_plan", "lookup", "output_copies", "score"]

OFFLOAD_KEYS = ("cpu", "disk")


@dataclass(frozen=True)
class Placement:
    """Where ops run and weights live; device ``n_devices`` means offloaded (cpu/disk).

    Attributes:
        op_devices: device index per op of ``costs.problem``.
        weight_devices: device index per entry of ``costs.weights + costs.unused``.
        replicas: per entry of ``costs.weights + costs.unused``, the other
            devices that hold a copy of it (an fxsplit plan's ``replicas``):
            read there it is not copied, and each of them is charged its bytes.
            Empty: none anywhere.
    """

    op_devices: tuple[int, ...]
    weight_devices: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Score:
    """What a placement costs.

    Attributes:
        bytes_between: bytes copied per forward between the given devices
            (activations, inputs, and weights used away from their home).
        offload_bytes: bytes of offloaded weights streamed in per forward.
        device_bytes: resident weight bytes per given device.
        spilled_bytes: weight bytes offloaded to "cpu"/"disk" (beyond the devices).
        empty_devices: given devices holding no weights and running no op.
        max_fraction: largest ``device_bytes / budget``.
    """

    bytes_between: int
    offload_bytes: int
    device_bytes: tuple[int, ...]
    spilled_bytes: int
    empty_devices: int
    max_fraction: float

    @property
    def total_bytes(self) -> int:
        """Every byte moved per forward, offload streaming included."""
        return self.bytes_between + self.offload_bytes


def score(costs: GraphCosts, placement: Placement, budgets: Sequence[int]) -> Score:
    """Count copies per forward and resident bytes per device of ``placement``."""
    n = len(budgets)
    problem, ops = costs.problem, placement.op_devices
    home_of_value: dict[int, int] = {}
    held_by_value: dict[int, tuple[int, ...]] = {}
    for weight_index, value_index in enumerate(costs.weight_values):
        if value_index >= 0:
            home_of_value[value_index] = placement.weight_devices[weight_index]
            held_by_value[value_index] = placement.replicas[weight_index] if placement.replicas else ()
    between = offload = 0
    for index, value in enumerate(problem.values):
        if not value.consumers or not value.nbytes:
            continue
        home = home_of_value.get(index, ops[value.start])
        copies = len({ops[c] for c in value.consumers} - {home, *held_by_value.get(index, ())})
        if home == n:
            offload += value.nbytes * copies
        else:
            between += value.nbytes * copies
    device_bytes = [0] * (n + 1)
    replicas = placement.replicas or ((),) * len(placement.weight_devices)
    for weight, device, extra in zip([*costs.weights, *costs.unused], placement.weight_devices, replicas, strict=True):
        for holder in (device, *extra):
            device_bytes[holder] += weight.nbytes
    busy = set(ops) | {d for d, b in enumerate(device_bytes) if b}
    fractions = [device_bytes[k] / budgets[k] if budgets[k] else float("inf") * bool(device_bytes[k]) for k in range(n)]
    return Score(
        bytes_between=between,
        offload_bytes=offload,
        device_bytes=tuple(device_bytes[:n]),
        spilled_bytes=device_bytes[n],
        empty_devices=sum(1 for k in range(n) if k not in busy),
        max_fraction=max(fractions, default=0.0),
    )


def output_copies(
    costs: GraphCosts, returned: Sequence[tuple[str, int, int]], placement: Placement, device: int, *, reuse: bool
) -> int:
    """Bytes copied per forward to return the outputs on ``device``.

    Args:
        costs: the cost model ``placement`` places.
        returned: ``(name, bytes, start)`` of each returned tensor an op makes or reads
            (:func:`fxsplit.planning.build.output_values`).
        placement: where the ops run.
        device: where the outputs are returned.
        reuse: whether a value already copied to ``device`` for an op there is returned from that copy (fxsplit's
            generated code does; Accelerate's root hook copies the module's output again).
    """
    readers = {value.name: value.consumers for value in costs.problem.values} if reuse else {}
    ops = placement.op_devices
    total = 0
    for name, nbytes, start in returned:
        if ops[start] == device or any(ops[op] == device for op in readers.get(name, ())):
            continue
        total += nbytes
    return total


def from_plan(costs: GraphCosts, plan: Plan) -> Placement:
    """The placement an fxsplit plan made (its graph must be the graph ``costs`` describes)."""
    index = {d: k for k, d in enumerate(plan.devices)}
    missing = [op.name for op in costs.ops if op.name not in plan.placement]
    if missing:
        raise ValueError(f"the plan does not place ops {missing[:5]} of this graph; trace the same model the same way")
    ops = tuple(index[plan.placement[op.name]] for op in costs.ops)
    weights = tuple(index[plan.param_devices[w.names[0]]] for w in [*costs.weights, *costs.unused])
    replicas = tuple(
        tuple(index[d] for d in plan.replicas[w.names[0]].devices) if w.names[0] in plan.replicas else ()
        for w in [*costs.weights, *costs.unused]
    )
    return Placement(ops, weights, replicas if plan.replicas else ())


def lookup(device_map: Mapping[str, Any], name: str) -> Any:
    """The value of the longest key of ``device_map`` that is ``name`` or a module prefix of it."""
    best: str | None = None
    for key in device_map:
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best):
                best = key
    if best is None:
        raise KeyError(f"{name!r} is not covered by the device map")
    return device_map[best]


def from_device_map(costs: GraphCosts, device_map: Mapping[str, Any], n_devices: int) -> Placement:
    """Where ops run under Accelerate's ``dispatch_model`` with ``device_map`` (int keys = devices).

    Accelerate's rules (``accelerate.big_modeling.dispatch_model``, ``hooks.py``):
    a module mapped to device ``k`` runs on ``k`` (its hook moves its inputs
    there); a module mapped to ``"cpu"``/``"disk"`` runs on the main device (the
    first one) with its weights streamed in; code outside every mapped module
    runs where its input tensors are (the model's inputs are moved to the main
    device by the root hook).
    """

    def device_index(value: Any) -> int:
        if value in OFFLOAD_KEYS:
            return n_devices
        return int(str(value).rpartition(":")[2]) if isinstance(value, str) else int(value)

    position = {op: i for i, op in enumerate(costs.ops)}
    ops: list[int] = []
    for op in costs.ops:
        path = module_path(op)
        mapped = _mapped(device_map, path)
        if mapped is not None:
            index = device_index(mapped)
            ops.append(0 if index == n_devices else index)
        else:
            ops.append(_where_inputs_are(op, position, ops))
    weights: list[int] = []
    for k, weight in enumerate([*costs.weights, *costs.unused]):
        mapped = _mapped(device_map, weight.names[0])
        if mapped is not None:
            weights.append(device_index(mapped))
        else:  # a constant that exists only in the traced graph: it lives where it is first read
            value = costs.weight_values[k] if k < len(costs.weight_values) else -1
            weights.append(ops[costs.problem.values[value].start] if value >= 0 else 0)
    return Placement(tuple(ops), tuple(weights))


def _mapped(device_map: Mapping[str, Any], name: str) -> Any:
    try:
        return lookup(device_map, name)
    except KeyError:
        return None


def _where_inputs_are(op: torch.fx.Node, position: Mapping[torch.fx.Node, int], placed: list[int]) -> int:
    for arg in op.all_input_nodes:
        if arg in position and position[arg] < len(placed):
            return placed[position[arg]]
    return 0
