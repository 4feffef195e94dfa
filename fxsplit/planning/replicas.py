"""Replicas: a read-only weight held on several devices instead of copied there every forward.

In inference (``mode="inference"`` or ``"weights"``) nothing writes a
parameter, so a weight read by ops on two devices (GPT-2's tied
``wte``/``lm_head``, T5's ``shared`` embedding) may be held on both: the ops
on each read their own copy, and neither the weight nor the activations
around it are copied per forward; each device that holds it is charged its
bytes. Whether that pays depends on the budgets, so it is a second candidate,
never forced:

1. :func:`replicable`: the weights that may be replicated (read by two ops or
   more, read-only, not in training);
2. :func:`replicated_problem`: the partition problem with each such weight
   split into one virtual copy per reading op, each charged in full where its
   op runs and never moved (two copies that land on one device are one
   tensor there, so the charge is an upper bound: safe);
3. :func:`with_replicas`: the plan made from that partition, with the
   devices holding each weight recorded in :attr:`Plan.replicas` (its home,
   the device of its first reader, stays in ``param_devices``), the bytes
   charged to each, and the cuts the replicas leave;
4. :func:`cheaper`: the candidate is kept only when it copies fewer bytes
   per forward than the plan without replicas (ties: no replicas).

Left out: training (the optimizer changes the weight every step, so every
replica would be copied again every step; a split run with autograd anyway
sends each replica's gradient to the weight: :func:`fxsplit.runtime.replica`),
streamed weights (offload plans), pipelines, and objectives other than
``"min_transfer"`` (which do not minimise bytes copied).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterable, Sequence

import torch.fx

from fxsplit.cost.build import GraphCosts
from fxsplit.errors import BudgetError
from fxsplit.memory.fit import fit_budgets
from fxsplit.memory.model import MemoryModel
from fxsplit.options import Budgets
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.planning.build import cuts_for, reads_of, weights_by_node
from fxsplit.planning.plan import Plan, Replica

__all__ = [
    "MAX_CANDIDATES",
    "cheaper",
    "groupings",
    "replicable",
    "replicated_problem",
    "try_replicas",
    "with_replicas",
]


def replicable(costs: GraphCosts, *, training: bool) -> tuple[int, ...]:
    """Indices into ``costs.problem.values`` of the weights that may be held on several devices.

    A weight read by two ops or more, that no op writes (nor a module call
    that may write its buffers: not ``movable``), whose bytes are counted
    (not an alias of another tensor's storage). None in training.
    """
    if training:
        return ()
    values = costs.problem.values
    found = []
    for weight, index in zip(costs.weights, costs.weight_values, strict=True):
        if index < 0 or len(values[index].consumers) < 2:  # unread, or read by one op (most weights)
            continue
        if values[index].movable and weight.nbytes and weight.names[0] not in costs.written:
            found.append(index)
    return tuple(found)


MAX_CANDIDATES = 3
"""At most this many problems with replicas are partitioned per plan (each costs about one more partition)."""


def groupings(problem: PartitionProblem, indices: tuple[int, ...]) -> list[dict[int, tuple[tuple[int, ...], ...]]]:
    """Ways to split the readers of each weight of ``indices`` into groups, one copy per group, at most
    :data:`MAX_CANDIDATES`: one copy per reading op; then, for ``j = 1, 2, ...``, the first ``j`` readers
    share a copy and the rest another (T5's embedding: the encoder's copy, and the decoder's beside its head,
    each charged once, where one copy per reader would charge the decoder's device twice)."""
    consumers = {i: problem.values[i].consumers for i in indices}
    Groups = dict[int, tuple[tuple[int, ...], ...]]
    each: Groups = {i: tuple((op,) for op in ops) for i, ops in consumers.items()}
    found = [each]
    for j in range(1, max(len(ops) for ops in consumers.values())):
        split: Groups = {
            i: (ops[:j], ops[j:]) if 2 < len(ops) and j < len(ops) else each[i] for i, ops in consumers.items()
        }
        if split not in found:
            found.append(split)
    return found[:MAX_CANDIDATES]


def replicated_problem(problem: PartitionProblem, groups: dict[int, tuple[tuple[int, ...], ...]]) -> PartitionProblem:
    """``problem`` with each value of ``groups`` split into one copy per group of its readers, each charged in
    full where the first of its readers runs (and copied to the others of its group where they run elsewhere)."""
    values: list[Value] = []
    for index, value in enumerate(problem.values):
        if index in groups:
            values.extend(value._replace(start=ops[0], consumers=ops) for ops in groups[index])
        else:
            values.append(value)
    return dataclasses.replace(problem, values=tuple(values))


def with_replicas(plan: Plan, costs: GraphCosts, graph_module: torch.fx.GraphModule, indices: tuple[int, ...]) -> Plan:
    """``plan`` with each weight of ``indices`` held on every device that runs an op reading it.

    Its home stays the device of its first reader; the other devices get a
    :class:`Replica`, their ``device_bytes`` its bytes, and the cuts that
    copied it there are dropped.
    """
    chosen = {costs.problem.values[i].name for i in indices}
    sizes = {w.names[0]: w.nbytes for w in costs.weights if w.names[0] in chosen}
    readers: dict[str, set[str]] = {}
    by_node = weights_by_node(costs)
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        for read in reads_of(node, by_node):
            if read.weight is not None and read.key in sizes:
                readers.setdefault(read.key, set()).add(plan.placement[node.name])
    replicas = {}
    device_bytes = dict(plan.device_bytes)
    for name in sorted(readers):
        extra = tuple(d for d in plan.devices if d in readers[name] and d != plan.param_devices[name])
        if extra:
            replicas[name] = Replica(extra, sizes[name])
            for device in extra:
                device_bytes[device] += sizes[name]
    if not replicas:
        return plan
    cuts = cuts_for(costs, graph_module, plan.placement, plan.param_devices, None, replicas_of(replicas))
    return dataclasses.replace(plan, replicas=replicas, device_bytes=device_bytes, cuts=tuple(cuts))


def replicas_of(replicas: dict[str, Replica]) -> dict[str, tuple[str, ...]]:
    """Canonical name -> the devices besides its home that hold it, as :func:`cuts_for` takes them."""
    return {name: replica.devices for name, replica in replicas.items()}


def try_replicas(
    plain: Plan,
    memory: MemoryModel,
    budgets: Budgets,
    graph_module: torch.fx.GraphModule,
    problem: PartitionProblem,
    solver: Callable[[PartitionProblem], Callable[[Sequence[int]], Plan]],
) -> Plan:
    """``plain``, or a plan with replicas that fits ``budgets`` and copies fewer bytes per forward.

    Args:
        plain: the plan without replicas.
        memory: what a device is charged (``memory.costs`` the cost model; no replicas in training).
        budgets: the devices' budgets.
        graph_module: the traced graph.
        problem: the partition problem ``plain`` was made from (``memory.problem()``).
        solver: a problem -> a function that partitions it under per-device caps and makes the plan.
    """
    costs = memory.costs
    shared = replicable(costs, training=memory.spec.training)
    if not shared or not plain.copied_bytes or plain.streamed:
        return plain

    def candidate(groups: dict[int, tuple[tuple[int, ...], ...]]) -> Plan:
        solve = solver(replicated_problem(problem, groups))
        return fit_budgets(memory, budgets, lambda caps: with_replicas(solve(caps), costs, graph_module, shared))

    return cheaper(plain, (functools.partial(candidate, groups) for groups in groupings(problem, shared)))


def cheaper(plain: Plan, candidates: Iterable[Callable[[], Plan]]) -> Plan:
    """The plan with replicas that copies the fewest bytes per forward (outputs' copies included), if fewer than
    ``plain``; else ``plain``.

    A candidate that fails to fit the budgets (a replica is charged on every
    device that holds it) is skipped; ties go to the earlier plan (``plain`` first).
    """
    best = plain
    for candidate in candidates:
        try:
            made = candidate()
        except BudgetError:
            continue
        if made.replicas and made.copied_bytes < best.copied_bytes:
            best = made
    return best
