"""The steps :func:`~fxsplit.partition.solve.partition` runs, as a list that can be replaced.

A *strategy* is a callable ``strategy(search, best)``:

* ``search`` (a :class:`Search`) holds the problem, the budgets in use and what
  strategies share (the contiguous programmes' candidate positions and matrices);
* ``best`` is the cheapest placement the strategies before it found (one device
  index per op, a tuple), or None when none has found one yet.

It returns a placement (a sequence of device indices, one per op) or None when
it has nothing to offer. :func:`~fxsplit.partition.solve.partition` runs the
strategies in order and keeps a returned placement when there is no best yet
or when it copies strictly fewer bytes per forward than the best (so ties keep
the earlier answer); a strategy never sees a placement that breaks the
budgets, pins or together-constraints (one that returns such a placement is an
error). A strategy may build a placement from nothing, improve ``best``, or act
only when ``best`` is None (a fallback).

:data:`DEFAULT_STRATEGIES`, in order:

1. :func:`contiguous_and_wrapped`: the exact contiguous programme and the wrapped
   one (device 0 also runs the last ops), over several orders of the devices,
   each result improved by single-op moves; the cheapest.
2. :func:`packing`: only when nothing was found: wrapped placements in the
   budgets' order, and the nearest contiguous placement brought within budgets
   (or a first-fit packing), each improved by single-op moves; the cheapest.
3. :func:`exact_fallback`: only when still nothing was found, on small graphs
   (:func:`~fxsplit.partition.exact.searched`): branch and bound from scratch.
4. :func:`min_cut_exchanges`: on graphs of up to :data:`~fxsplit.partition.contiguous.EXACT_LIMIT`
   ops, pairs of devices exchange groups of ops along minimum cuts, then single
   ops move again.
5. :func:`module_runs`: when ops carry module labels, whole runs of each module placed in any order by an
   exact search over the coarsened graph (:mod:`fxsplit.partition.coarse`), then improved as above (up to
   :data:`~fxsplit.partition.contiguous.EXACT_LIMIT` ops, also from placements the search took before its best).
6. :func:`exact_search`: on small graphs (up to :data:`~fxsplit.partition.exact.EXACT_OPS` ops, or 24 on
   two devices: :func:`~fxsplit.partition.exact.searched`), branch and bound for a strictly cheaper placement.
7. :func:`milp_search`: on graphs of up to :data:`~fxsplit.partition.milp.MILP_OPS` ops, when SciPy is installed
   (the ``solver`` extra), the cheapest placement as a mixed-integer programme (:mod:`fxsplit.partition.milp`),
   also when nothing else fitted.

:data:`CONTIGUOUS_STRATEGIES` (``contiguous=True``) is :func:`contiguous` alone; :func:`local_moves`
improves any best placement by single-op moves, for lists of one's own.

>>> from fxsplit.partition.problem import PartitionProblem, Value
>>> from fxsplit.partition.solve import partition
>>> tied = PartitionProblem(
...     op_names=("embed", "body", "head"),
...     values=(Value("wte", 1000, 0, (0, 2), weight=1000), Value("w_body", 0, 1, (1,), weight=900),
...             Value("embed", 10, 0, (1,)), Value("body", 10, 1, (2,))))
>>> partition(tied, [1500, 1500], strategies=[contiguous]).op_devices
(0, 1, 1)
>>> partition(tied, [1500, 1500], strategies=[contiguous, local_moves]).op_devices
(0, 1, 0)
"""

from __future__ import annotations

import itertools
from functools import cached_property
from typing import Callable, Sequence

import numpy as np

from fxsplit.partition.coarse import module_placements
from fxsplit.partition.context import Context
from fxsplit.partition.contiguous import (
    EXACT_LIMIT,
    Matrices,
    candidates,
    devices_of,
    exact_boundaries,
    min_max_fraction,
    min_scale,
    relay_boundaries,
)
from fxsplit.partition.exact import exact_placement, searched
from fxsplit.partition.milp import milp_placement, milp_places
from fxsplit.partition.mincut import exchange
from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.refine import frozen_ops, improve, pack, repair
from fxsplit.partition.result import transfer_bytes
from fxsplit.partition.ring import cheapest_wraps, has_long_reach, wrap_points

__all__ = [
    "CONTIGUOUS_STRATEGIES",
    "DEFAULT_STRATEGIES",
    "LARGE_GRAPH_NODES",
    "LARGE_GRAPH_RUNS",
    "LARGE_GRAPH_WORK",
    "MODULE_KEEP",
    "MODULE_NODES",
    "MODULE_SLACK",
    "RING_KEEP",
    "Search",
    "Strategy",
    "contiguous",
    "contiguous_and_wrapped",
    "exact_fallback",
    "exact_search",
    "local_moves",
    "milp_search",
    "min_cut_exchanges",
    "module_runs",
    "packing",
]

RING_KEEP = 3
"""How many of the cheapest wrapped placements (by wrap point) are kept and improved."""

MODULE_NODES = 12_000
"""Most branches the searches of one :func:`module_runs` call open together on graphs of up to
:data:`EXACT_LIMIT` ops (a few tenths of a second at most; module graphs of real models take hundreds)."""

MODULE_KEEP = 4
"""On graphs of up to :data:`EXACT_LIMIT` ops, :func:`module_runs` improves by single-op moves the placement each
search finds and up to this many less the one it took as its best before it
(:func:`~fxsplit.partition.exact.taken_placements`): a dearer placement of whole runs can end cheaper. Random
program 14096 (16 ops, three devices at 0.65 of its one-device total): the best placement of runs copies
30,720 B, as the placement before it did; one taken earlier at 49,152 B ends at 12,288 B."""

MODULE_SLACK = 2
"""...and those placements may copy up to this many times what the best placement so far does."""

LARGE_GRAPH_NODES = 300
"""Most branches one search of :func:`module_runs` opens on graphs of more than :data:`EXACT_LIMIT` ops."""

LARGE_GRAPH_RUNS = 10
"""Most runs one search of :func:`module_runs` places on graphs of more than :data:`EXACT_LIMIT` ops."""

LARGE_GRAPH_WORK = 500_000
"""On graphs of more than :data:`EXACT_LIMIT` ops :func:`module_runs` also searches over as many runs as the
exact search takes, with ``LARGE_GRAPH_WORK // ops`` branches a search, when that is at least
:data:`LARGE_GRAPH_NODES` (up to 1,666 ops): the budget shrinks as the graph grows, so that the search stays
a small share of the time the other strategies take on it."""


class Search:
    """What the strategies of one :func:`~fxsplit.partition.solve.partition` call share.

    Attributes:
        problem: the problem.
        context: arrays derived once from the problem and the budgets as given.
        budgets: the budgets in use: as given, or, for the ``"balanced"`` objective, each lowered to the
            smallest largest budget fraction a contiguous placement reaches (so that placements stay even).
        relay: on graphs of more than :data:`EXACT_LIMIT` ops, the relay programme's boundaries
            (:func:`~fxsplit.partition.contiguous.relay_boundaries`); else None (not run).
        contiguous_unfit: True when it is known that no contiguous placement fits the budgets' order
            (the relay programme found none); strategies that only place contiguously then return None.
    """

    def __init__(self, problem: PartitionProblem, budgets: Sequence[int], objective: str = "min_transfer") -> None:
        self.problem = problem
        self.context = Context(problem, list(budgets))
        big = problem.num_ops > EXACT_LIMIT
        self.relay = relay_boundaries(self.context, self.context.budgets) if big else None
        self.contiguous_unfit = big and self.relay is None
        self.budgets = self.context.budgets
        if objective == "balanced" and not self.contiguous_unfit:
            scale = min_max_fraction(self.context, self.candidates)
            if scale is not None:
                self.budgets = [min(b, int(b * scale) + 1) for b in self.context.budgets]

    @cached_property
    def candidates(self) -> np.ndarray:
        """Where the exact programmes may put a device boundary (:func:`~fxsplit.partition.contiguous.candidates`)."""
        return candidates(self.context, self.relay)

    @cached_property
    def matrices(self) -> Matrices:
        """The exact programmes' matrices over :attr:`candidates` for :attr:`budgets`."""
        return Matrices.of(self.context, self.candidates, self.budgets)


Strategy = Callable[[Search, tuple[int, ...] | None], Sequence[int] | None]
"""``strategy(search, best) -> placement or None``; see the module's docstring."""


def contiguous(search: Search, best: tuple[int, ...] | None) -> list[int] | None:
    """The cheapest contiguous placement in the budgets' order (true copy cost, then balance), or None.

    Exact on graphs of up to :data:`EXACT_LIMIT` ops, over candidate positions beyond
    (:mod:`fxsplit.partition.contiguous`). Ignores ``best``.
    """
    if search.contiguous_unfit:
        return None
    boundaries = exact_boundaries(search.context, search.candidates, search.budgets, search.matrices)
    return None if boundaries is None else devices_of(search.problem.num_ops, boundaries)


def contiguous_and_wrapped(search: Search, best: tuple[int, ...] | None) -> list[int] | None:
    """The cheapest of the contiguous and wrapped placements over the device orders :func:`_device_orders` gives,
    each improved by single-op moves (:func:`~fxsplit.partition.refine.improve`); None when none fits.

    Out of order nothing ties stage ``k`` to the ``k``-th budget, so with unequal budgets the programmes
    also run over permuted budgets (the result relabelled back). For each order the contiguous placement
    comes first, then the wrapped ones (:func:`_wrapped`: only when the contiguous one copies bytes or
    none fits); ties keep the earlier, so the budgets' own order and contiguous placements win them.
    None without trying when :attr:`Search.contiguous_unfit`. Ignores ``best``.
    """
    if search.contiguous_unfit:
        return None
    ctx, cands, budgets = search.context, search.candidates, search.budgets
    found: list[list[int]] = []
    for order in _device_orders(search):
        permuted = [budgets[d] for d in order]
        reuse = permuted == list(budgets) and not found
        m = search.matrices if reuse else Matrices.of(ctx, cands, permuted, search.matrices.cost)
        boundaries = exact_boundaries(ctx, cands, permuted, m)
        placed = [] if boundaries is None else [devices_of(ctx.n, boundaries)]
        if not placed or transfer_bytes(ctx.problem, placed[0]):
            placed += _wrapped(ctx, cands, permuted, m)
        found += [improve(ctx.problem, [order[d] for d in p], budgets) for p in placed]
    return _cheapest(search.problem, found)


def packing(search: Search, best: tuple[int, ...] | None) -> list[int] | None:
    """When ``best`` is None: the cheapest of the wrapped placements in the budgets' order and a packing, each
    improved by single-op moves; else None.

    The packing brings the contiguous placement that needs the least extra budget within the budgets
    (:func:`~fxsplit.partition.refine.repair`), or else packs first fit
    (:func:`~fxsplit.partition.refine.pack`): it places ops out of order when no order fits.
    """
    if best is not None:
        return None
    problem, budgets = search.problem, search.budgets
    found = [improve(problem, p, budgets) for p in _wrapped(search.context, search.candidates, budgets)]
    _, boundaries = min_scale(search.context, budgets)
    near = None if boundaries is None else devices_of(problem.num_ops, boundaries)
    packed = repair(problem, near, budgets) if near is not None else None
    packed = packed if packed is not None else pack(problem, budgets)
    if packed is not None:
        found.append(improve(problem, packed, budgets))
    return _cheapest(problem, found)


def exact_fallback(search: Search, best: tuple[int, ...] | None) -> list[int] | None:
    """When ``best`` is None, on the small graphs :func:`~fxsplit.partition.exact.searched` names: the cheapest
    placement that fits, by branch and bound (:func:`~fxsplit.partition.exact.exact_placement`); else None."""
    if best is not None:
        return None
    return exact_placement(search.problem, search.budgets, None)


def min_cut_exchanges(search: Search, best: tuple[int, ...] | None) -> list[int] | None:
    """``best`` with groups of ops exchanged between device pairs along minimum cuts
    (:func:`~fxsplit.partition.mincut.exchange`), then single-op moves; None when nothing changed.

    Only for graphs of up to :data:`EXACT_LIMIT` ops (each cut is a max-flow in Python: tens of ms on a
    few hundred ops), two devices or more, and a ``best`` that copies bytes.
    """
    problem, budgets = search.problem, search.budgets
    if best is None or problem.num_ops > EXACT_LIMIT or len(budgets) < 2 or not transfer_bytes(problem, best):
        return None
    exchanged = exchange(problem, best, budgets, frozen_ops(problem))
    if exchanged == list(best):
        return None
    return improve(problem, exchanged, budgets)


def module_runs(search: Search, best: tuple[int, ...] | None) -> list[int] | None:
    """The cheapest placement of whole module runs in any order that copies fewer bytes than ``best``
    (:func:`~fxsplit.partition.coarse.module_placements`), improved by single-op moves and min-cut exchanges
    (as :func:`min_cut_exchanges`); None when the ops carry no module labels, no such placement is found, or
    the graph is one :func:`exact_search` searches op by op.

    On graphs of up to :data:`EXACT_LIMIT` ops the searches open at most :data:`MODULE_NODES` branches
    together, and single-op moves start from each one's placement and from those it took as its best before
    (:data:`MODULE_KEEP`, :data:`MODULE_SLACK`); on larger ones each opens at most :data:`LARGE_GRAPH_NODES`,
    over at most :data:`LARGE_GRAPH_RUNS` runs (and, up to 1,666 ops, more runs: :data:`LARGE_GRAPH_WORK`), and the
    placement found is returned as it is (so that the strategy stays a few milliseconds there: the moves
    after it rarely helped on such placements).
    """
    problem, budgets = search.problem, search.budgets
    cost = transfer_bytes(problem, best) if best is not None else None
    if cost == 0 or searched(problem.num_ops, len(budgets)):  # small graphs: exact_search searches every op
        return None
    if problem.num_ops > EXACT_LIMIT:
        found = module_placements(search.context, budgets, cost, LARGE_GRAPH_NODES, LARGE_GRAPH_RUNS)
        nodes = LARGE_GRAPH_WORK // problem.num_ops
        if nodes >= LARGE_GRAPH_NODES:  # room for a search over as many runs as the exact search takes
            found += module_placements(search.context, budgets, cost, nodes)
        return _cheapest(problem, found)
    below = None if cost is None else MODULE_SLACK * cost  # starts dearer than ``best`` may end cheaper
    starts = module_placements(search.context, budgets, below, total_nodes=MODULE_NODES, keep=MODULE_KEEP)
    found = [improve(problem, list(p), budgets) for p in dict.fromkeys(map(tuple, starts))]
    placed = _cheapest(problem, found)
    if placed is None or (cost is not None and transfer_bytes(problem, placed) >= cost):
        return None
    return min_cut_exchanges(search, tuple(placed)) or placed


def exact_search(search: Search, best: tuple[int, ...] | None) -> list[int] | None:
    """A placement strictly cheaper than ``best``, by branch and bound, or ``best`` when there is none.

    Only for the small graphs :func:`~fxsplit.partition.exact.searched` names
    (:func:`~fxsplit.partition.exact.exact_placement`) and a ``best`` that copies bytes; else None.
    """
    if best is None or not searched(search.problem.num_ops, len(search.budgets)):
        return None
    cost = transfer_bytes(search.problem, best)
    return exact_placement(search.problem, search.budgets, best, cost) if cost else None


def milp_search(search: Search, best: tuple[int, ...] | None) -> list[int] | None:
    """On the graphs :func:`~fxsplit.partition.milp.milp_places` names (up to
    :data:`~fxsplit.partition.milp.MILP_OPS` ops, more than the branch and bound searches, SciPy installed): the
    cheapest placement as a mixed-integer programme (:func:`~fxsplit.partition.milp.milp_placement`), when it
    copies strictly fewer bytes than ``best`` (or ``best`` is None); else None."""
    problem, budgets = search.problem, search.budgets
    if not milp_places(problem.num_ops, len(budgets)):
        return None
    cost = transfer_bytes(problem, best) if best is not None else None
    if cost == 0:
        return None
    return milp_placement(problem, budgets, cost)


def local_moves(search: Search, best: tuple[int, ...] | None) -> list[int] | None:
    """``best`` improved by single-op moves (:func:`~fxsplit.partition.refine.improve`); None when ``best`` is."""
    return None if best is None else improve(search.problem, best, search.budgets)


DEFAULT_STRATEGIES: tuple[Strategy, ...] = (
    contiguous_and_wrapped,
    packing,
    exact_fallback,
    min_cut_exchanges,
    module_runs,
    exact_search,
    milp_search,
)
"""What :func:`~fxsplit.partition.solve.partition` runs by default; see the module's docstring."""

CONTIGUOUS_STRATEGIES: tuple[Strategy, ...] = (contiguous,)
"""What :func:`~fxsplit.partition.solve.partition` runs with ``contiguous=True``."""


def _cheapest(problem: PartitionProblem, found: list[list[int]]) -> list[int] | None:
    """The placement that copies fewest bytes (the first of those that tie), or None when ``found`` is empty."""
    if not found:
        return None
    costs = [transfer_bytes(problem, p) for p in found]
    return found[costs.index(min(costs))]


def _device_orders(search: Search) -> list[tuple[int, ...]]:
    """Orders of the devices to try: the given one first; then, with unequal budgets and no pins, every
    distinct order for up to 4 devices on graphs of up to ``EXACT_LIMIT`` ops, else budgets descending and
    ascending. Orders that permute equal budgets only are the same problem and are skipped."""
    budgets = search.budgets
    identity = tuple(range(len(budgets)))
    if search.problem.pinned or len(set(budgets)) < 2:
        return [identity]
    if len(budgets) <= 4 and search.problem.num_ops + 1 <= EXACT_LIMIT:
        orders = list(itertools.permutations(identity))
    else:
        descending = tuple(sorted(identity, key=lambda d: (-budgets[d], d)))
        orders = [identity, descending, descending[::-1]]
    seen: set[tuple[int, ...]] = set()
    distinct = []
    for order in orders:
        key = tuple(budgets[d] for d in order)
        if key not in seen:
            seen.add(key)
            distinct.append(order)
    return distinct


def _wrapped(
    ctx: Context, cands: np.ndarray, budgets: Sequence[int], matrices: Matrices | None = None
) -> list[list[int]]:
    """The :data:`RING_KEEP` cheapest placements where device 0 also runs the last ops
    (:mod:`fxsplit.partition.ring`), cheapest first; ``matrices`` are for ``cands`` and ``budgets`` (None: made here).

    On graphs of more than ``EXACT_LIMIT`` ops only tried when a copied value is made early and read
    late (skip connections, tied embeddings); each wrap point costs one pass of the exact programme.
    """
    if len(budgets) < 2 or (ctx.n + 1 > EXACT_LIMIT and not has_long_reach(ctx)):
        return []
    points = wrap_points(ctx, cands, budgets[0])
    if not points:
        return []
    m = matrices or Matrices.of(ctx, cands, budgets)
    return cheapest_wraps(ctx, cands, m.cost, m.seg_weight, m.steps, budgets, points, RING_KEEP)
