"""Exact placement of small graphs, in any order, by branch and bound (pure; no torch).

The dynamic programmes place ops contiguously (or wrapped), and the local
searches that follow stop on plateaus. For graphs of up to :data:`EXACT_OPS`
ops (or up to :data:`EXACT_SPACE` placements: up to 24 ops on two devices)
the search space is small enough to search outright: ops are given
devices in index order, each value's copies are charged as soon as a reader
lands away from its home (the home is the device of the value's ``start``,
which comes first), and a branch is cut when its bytes so far reach the best
placement found, or when the weights still to place cannot fit the room left.
Constraints hold while it searches: pins, spans no cut may fall inside, and
colocated groups (a later member goes where the group's first went).

Devices that are alike (same budget, no pins) and still empty are one
choice, so equivalent placements are not searched twice; devices are tried
cheapest first. Given the heuristic's placement, the search only replaces it
with a strictly cheaper one, so ties keep the heuristic's answer; without one
it finds the cheapest placement that fits, if any. At most :data:`NODE_LIMIT`
branches are opened (deterministic: the answer does not depend on the
machine's speed); past that the best found so far is returned.

>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> chain = PartitionProblem(("a", "b", "c"), (Value("w", 0, 0, (0,), weight=60), Value("x", 0, 2, (2,), weight=60),
...                          Value("a", 8, 0, (1,)), Value("b", 4, 1, (2,)), Value("v", 0, 1, (1,), weight=60)))
>>> exact_placement(chain, [130, 130], None)
[0, 0, 1]
"""

from __future__ import annotations

from typing import Sequence

from fxsplit.partition.problem import PartitionProblem

__all__ = ["EXACT_OPS", "EXACT_SPACE", "NODE_LIMIT", "exact_placement", "searched", "taken_placements"]

EXACT_OPS = 14
"""Graphs of up to this many ops are searched, whatever the number of devices."""

EXACT_SPACE = 2**24
"""Larger graphs are searched too while ``devices ** ops`` is at most this: up to 24 ops on two devices, 15 on
three. Above 14 ops, two devices are where a search pays (measured on random DAGs of 15-24 ops: 29% fewer bytes
on two devices, in 41 ms median, 0.5 s at most; on three or four, 3-11% fewer at 0.6 s median, the node limit
reached in most)."""

NODE_LIMIT = 40_000
"""Most branches one search opens."""


class _Search:
    def __init__(
        self, problem: PartitionProblem, budgets: Sequence[int], best_cost: float, node_limit: int = NODE_LIMIT
    ) -> None:
        n = problem.num_ops
        self.node_limit = node_limit
        self.problem, self.budgets, self.k = problem, list(budgets), len(budgets)
        self.resident = problem.op_weights()
        self.transient = problem.transients()
        self.forbidden = problem.forbidden_cuts()
        self.pinned = dict(problem.pinned)
        self.leader = _leaders(problem)
        # reads[j]: (value index, bytes) of the copied values op j reads, each once
        self.reads: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.starts = [v.start for v in problem.values]
        for index, value in enumerate(problem.values):
            if value.nbytes:
                for op in dict.fromkeys(value.consumers):
                    self.reads[op].append((index, value.nbytes))
        self.remaining = [sum(self.resident[j:]) for j in range(n + 1)]
        alike: dict[int, int] = {}
        pinned_devices = set(self.pinned.values())
        self.twin_of = [d if d in pinned_devices else alike.setdefault(b, d) for d, b in enumerate(self.budgets)]
        self.devices = [0] * n
        self.load = [0] * self.k
        self.peak = [0] * self.k
        self.used = [0] * self.k
        self.sent: list[set[int]] = [set() for _ in problem.values]
        self.best_cost = best_cost
        self.best: list[int] | None = None
        self.taken: list[list[int]] = []  # every placement taken as the best so far, in turn (the best last)
        self.nodes = 0

    def run(self) -> None:
        self._place(0, 0)

    def _choices(self, op: int) -> list[int]:
        forced = set()
        if op > 0 and self.forbidden[op]:  # constraints keep it beside the op before it
            forced.add(self.devices[op - 1])
        if self.leader[op] < op:  # a colocated group's later member goes where its first member went
            forced.add(self.devices[self.leader[op]])
        if op in self.pinned:
            forced.add(self.pinned[op])
        if forced:
            return list(forced) if len(forced) == 1 else []
        seen_empty: set[int] = set()
        found = []
        for d in range(self.k):
            if not self.used[d]:
                if self.twin_of[d] in seen_empty:
                    continue
                seen_empty.add(self.twin_of[d])
            found.append(d)
        return found

    def _extra(self, op: int, d: int) -> int:
        """Bytes newly copied if ``op`` runs on ``d``."""
        extra = 0
        for index, nbytes in self.reads[op]:
            start = self.starts[index]
            home = d if start == op else self.devices[start]
            if home != d and d not in self.sent[index]:
                extra += nbytes
        return extra

    def _place(self, op: int, cost: int) -> None:
        if op == len(self.devices):
            self.best_cost, self.best = cost, list(self.devices)
            self.taken.append(self.best)
            return
        free = sum(max(0, b - load - peak) for b, load, peak in zip(self.budgets, self.load, self.peak, strict=True))
        if self.remaining[op] > free:
            return
        options = []
        for d in self._choices(op):
            peak = max(self.peak[d], self.transient[op])
            if self.load[d] + self.resident[op] + peak > self.budgets[d]:
                continue
            extra = self._extra(op, d)
            if cost + extra < self.best_cost:
                options.append((extra, d))
        for extra, d in sorted(options):
            if self.nodes >= self.node_limit or cost + extra >= self.best_cost:
                return
            self.nodes += 1
            self._descend(op, d, cost + extra)

    def _descend(self, op: int, d: int, cost: int) -> None:
        added = []
        for index, _ in self.reads[op]:
            start = self.starts[index]
            home = d if start == op else self.devices[start]
            if home != d and d not in self.sent[index]:
                self.sent[index].add(d)
                added.append(index)
        peak = self.peak[d]
        self.devices[op] = d
        self.load[d] += self.resident[op]
        self.peak[d] = max(peak, self.transient[op])
        self.used[d] += 1
        self._place(op + 1, cost)
        self.used[d] -= 1
        self.peak[d] = peak
        self.load[d] -= self.resident[op]
        for index in added:
            self.sent[index].discard(d)


def _leaders(problem: PartitionProblem) -> list[int]:
    """``leader[op]``: the first op of the colocated groups ``op`` belongs to (overlapping groups merged), or ``op``."""
    leader = list(range(problem.num_ops))

    def root(op: int) -> int:
        while leader[op] != op:
            op = leader[op]
        return op

    for group in problem.colocated:
        for op in group[1:]:
            a, b = root(group[0]), root(op)
            leader[max(a, b)] = min(a, b)
    return [root(op) for op in range(problem.num_ops)]


def searched(num_ops: int, num_devices: int) -> bool:
    """Whether :func:`exact_placement` searches a graph of ``num_ops`` ops over ``num_devices`` devices:
    up to :data:`EXACT_OPS` ops, or while ``num_devices ** num_ops`` is at most :data:`EXACT_SPACE`."""
    return 0 < num_ops and (num_ops <= EXACT_OPS or num_devices**num_ops <= EXACT_SPACE)


def exact_placement(
    problem: PartitionProblem,
    budgets: Sequence[int],
    incumbent: Sequence[int] | None,
    incumbent_cost: int | None = None,
    *,
    node_limit: int = NODE_LIMIT,
    below: float | None = None,
) -> list[int] | None:
    """The cheapest placement that fits, or ``incumbent`` when none is strictly cheaper (None: none fits).

    Only for the graphs :func:`searched` names (else ``incumbent``
    unchanged); exact unless ``node_limit`` branches are opened. ``below``: without an incumbent, only
    placements that copy fewer bytes than this are sought (None when there is none).
    """
    late_home = any(v.consumers and v.start > v.consumers[0] for v in problem.values)
    if not searched(problem.num_ops, len(budgets)) or late_home:
        return list(incumbent) if incumbent is not None else None
    bound = float("inf") if below is None else below
    if incumbent is not None and incumbent_cost is not None:
        bound = incumbent_cost
    search = _Search(problem, budgets, bound, node_limit)
    search.run()
    if search.best is not None:
        return search.best
    return list(incumbent) if incumbent is not None else None


def taken_placements(
    problem: PartitionProblem, budgets: Sequence[int], *, below: float | None, node_limit: int = NODE_LIMIT, keep: int
) -> list[list[int]]:
    """The last ``keep`` placements that copy fewer bytes than ``below`` (None: any) which the search of
    :func:`exact_placement` took as its best in turn, the best last; empty when none fits or the graph is not
    one :func:`searched` names.

    The ones before the best are placements of their own, often far from it: starting points for local moves
    that can end cheaper than the best does (:func:`~fxsplit.partition.strategies.module_runs`).
    """
    late_home = any(v.consumers and v.start > v.consumers[0] for v in problem.values)
    if keep < 1 or not searched(problem.num_ops, len(budgets)) or late_home:
        return []
    search = _Search(problem, budgets, float("inf") if below is None else below, node_limit)
    search.run()
    return search.taken[-keep:]
