"""The block-level optimum: the best placement of whole top-level blocks, in order, with true copy cost.

The reference fxsplit is measured against. Every op belongs to one block (the
top-level block whose module holds it; glue code outside every block belongs
to the block of the op before it). Blocks are ordered by their first op, and a
placement gives each device a contiguous run of blocks (a device may take
none), like a user placing ``model.layers[i]`` by hand. The cost is the true
one: each value once per device other than its home that reads it, as
:func:`fxsplit.partition.solve.transfer_bytes` counts. Weights are charged to the
device of their first reader, as fxsplit does.

:func:`block_optimum` solves it exactly by dynamic programming over
``(device, first block not yet placed)``, using ``cost[i, j]``, the bytes
copied *into* a device holding blocks ``[i, j)``: since each device holds one
run, the sum over devices is the true cost. :func:`brute_force` enumerates
every placement and is used to test the programme.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fxsplit.partition.problem import PartitionProblem
from fxsplit.partition.solve import transfer_bytes
from fxsplit.tracing.graphinfo import module_path

__all__ = ["BlockOptimum", "BlockProblem", "block_optimum", "block_problem", "brute_force", "op_blocks"]


@dataclass(frozen=True)
class BlockOptimum:
    """The cheapest block placement, ties broken towards balance.

    Attributes:
        transfer_bytes: bytes copied between devices per forward.
        block_devices: device of each block, in block order.
        op_devices: device of each op.
        device_weights: resident bytes per device.
    """

    transfer_bytes: int
    block_devices: tuple[int, ...]
    op_devices: tuple[int, ...]
    device_weights: tuple[int, ...]


@dataclass(frozen=True)
class BlockProblem:
    """A partition problem seen at block granularity.

    Attributes:
        problem: the op-level problem.
        op_block: block position (in first-op order) of every op.
        weights: resident bytes of each block.
        locked: ``locked[p]``: blocks ``p - 1`` and ``p`` must share a device.
    """

    problem: PartitionProblem
    op_block: tuple[int, ...]
    weights: tuple[int, ...]
    locked: tuple[bool, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.weights)


def op_blocks(ops: Sequence[object], blocks: Sequence[str]) -> list[int]:
    """Index into ``blocks`` of every FX op (glue code joins the block of the op before it)."""
    found: list[int] = []
    for op in ops:
        path = module_path(op)  # type: ignore[arg-type]
        match = [i for i, b in enumerate(blocks) if path == b or path.startswith(b + ".")]
        if match:
            found.append(max(match, key=lambda i: len(blocks[i])))
        else:
            found.append(found[-1] if found else -1)
    first = next((b for b in found if b >= 0), 0)
    return [first if b < 0 else b for b in found]


def block_problem(problem: PartitionProblem, op_block_ids: Sequence[int]) -> BlockProblem:
    """Renumber blocks by their first op and gather their weights and must-share constraints."""
    order: dict[int, int] = {}
    for block in op_block_ids:
        order.setdefault(block, len(order))
    op_block = tuple(order[b] for b in op_block_ids)
    weights = [0] * len(order)
    for op, weight in enumerate(problem.op_weights()):
        weights[op_block[op]] += weight
    locked = [False] * (len(order) + 1)
    for lo, hi in problem.no_cut_spans():
        span = [op_block[op] for op in range(lo, hi + 1)]
        for p in range(min(span) + 1, max(span) + 1):
            locked[p] = True
    return BlockProblem(problem, op_block, tuple(weights), tuple(locked))


def _cost_matrix(bp: BlockProblem) -> np.ndarray:
    """``cost[i, j]``: bytes copied into a device that holds blocks ``[i, j)``."""
    m = bp.num_blocks
    diff = np.zeros((m, m + 2))
    rows = np.arange(m)
    for value in bp.problem.values:
        if not value.nbytes or not value.consumers:
            continue
        home = bp.op_block[value.start]
        readers = np.unique([bp.op_block[c] for c in value.consumers])
        at = np.searchsorted(readers, rows)
        ok = at < len(readers)
        first = np.where(ok, readers[np.minimum(at, len(readers) - 1)], m)
        start = first + 1
        end = np.where(rows <= home, home, m)  # last j (inclusive) whose run [i, j) misses the home
        live = ok & (start <= end)
        np.add.at(diff, (rows[live], start[live]), value.nbytes)
        np.add.at(diff, (rows[live], end[live] + 1), -value.nbytes)
    return np.cumsum(diff, axis=1)[:, : m + 1]


def block_optimum(bp: BlockProblem, budgets: Sequence[int]) -> BlockOptimum | None:
    """The exact block-level optimum, or None when no block placement fits the budgets."""
    m, n = bp.num_blocks, len(budgets)
    cost = _cost_matrix(bp)
    prefix = np.concatenate([[0], np.cumsum(bp.weights)])
    inf = (float("inf"), float("inf"))
    # best[k][j]: (bytes, balance) placing blocks [0, j) on devices 0..k-1.
    best = [[inf] * (m + 1) for _ in range(n + 1)]
    choice = [[-1] * (m + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, n + 1):
        budget = budgets[k - 1]
        for j in range(m + 1):
            best[k][j], choice[k][j] = best[k - 1][j], j
            for i in range(j):
                if best[k - 1][i] == inf or (i > 0 and bp.locked[i]):
                    continue
                weight = int(prefix[j] - prefix[i])
                if weight > budget:
                    continue
                fraction = weight / budget if budget else 0.0
                candidate = (best[k - 1][i][0] + float(cost[i, j]), best[k - 1][i][1] + fraction * fraction)
                if candidate < best[k][j]:
                    best[k][j], choice[k][j] = candidate, i
    if best[n][m] == inf:
        return None
    devices = [0] * m
    j = m
    for k in range(n, 0, -1):
        i = choice[k][j]
        for block in range(i, j):
            devices[block] = k - 1
        j = i
    return _solution(bp, devices, n)


def brute_force(bp: BlockProblem, budgets: Sequence[int]) -> BlockOptimum | None:
    """Try every ordered block placement (exponential; for tests)."""
    m, n = bp.num_blocks, len(budgets)
    found: tuple[int, float, tuple[int, ...]] | None = None
    for devices in itertools.combinations_with_replacement(range(n), m):
        if any(bp.locked[p] and devices[p - 1] != devices[p] for p in range(1, m)):
            continue
        loads = [0] * n
        for block, device in enumerate(devices):
            loads[device] += bp.weights[block]
        if any(load > budget for load, budget in zip(loads, budgets, strict=True)):
            continue
        ops = [devices[b] for b in bp.op_block]
        balance = sum((w / b if b else 0.0) ** 2 for w, b in zip(loads, budgets, strict=True))
        key = (transfer_bytes(bp.problem, ops), balance)
        if found is None or key < (found[0], found[1]):
            found = (key[0], key[1], devices)
    return None if found is None else _solution(bp, list(found[2]), n)


def _solution(bp: BlockProblem, devices: list[int], n: int) -> BlockOptimum:
    ops = tuple(devices[b] for b in bp.op_block)
    loads = [0] * n
    for block, device in enumerate(devices):
        loads[device] += bp.weights[block]
    return BlockOptimum(transfer_bytes(bp.problem, ops), tuple(devices), ops, tuple(loads))
