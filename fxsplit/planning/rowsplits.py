"""When to split a linear op's rows over pipeline stages, and into which ranges (:mod:`fxsplit.tracing.rowsplit`).

The throughput objective balances contiguous stages, but a stage cannot be
faster than its slowest single op. A linear op that takes a large share of a
stage's time (GPT-2's tied LM head: 50,257 outputs, about five of its twelve
blocks) sets a floor under the slowest stage. For stages run one per process
(:func:`fxsplit.pipeline_stages`), such an op can be computed in row ranges on
consecutive stages, each holding only its rows of the weight:

1. every splittable op (:func:`~fxsplit.tracing.rowsplit.splittable_ops`) that
   takes more than :data:`PIECE_SHARE` of a mean stage is cut into pieces of at
   most that share (at most :data:`MAX_PIECES`, in multiples of
   :data:`ROW_MULTIPLE` rows), and the graph is planned again;
2. if that plan's slowest stage is faster by :data:`MIN_GAIN` or more, the pieces
   each device took are merged into one range per device, the graph is split that
   way and planned once more; else the plan without splits stands.

The result is recorded in :attr:`Plan.row_splits <fxsplit.planning.plan.Plan.row_splits>`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping

from fxsplit.attrpath import attr_at
from fxsplit.cost.build import model_tensors
from fxsplit.errors import FxsplitError
from fxsplit.planning.plan import RowSplit
from fxsplit.planning.stagecopies import held_by_stages
from fxsplit.planning.timetable import stage_totals
from fxsplit.tracing.rowsplit import ROWS_MODULE, row_shards, row_splits_of, split_rows, splittable_ops

if TYPE_CHECKING:
    import torch
    import torch.fx

    from fxsplit.api import Planned

__all__ = [
    "MAX_PIECES",
    "MERGED_SLACK",
    "MIN_GAIN",
    "PIECE_SHARE",
    "ROW_MULTIPLE",
    "piece_bounds",
    "recorded_splits",
    "shard_sources",
    "try_row_splits",
    "wants_row_splits",
]

PIECE_SHARE = 0.25  # an op longer than this share of a mean stage is cut into pieces no longer than it
MAX_PIECES = 16
ROW_MULTIPLE = 64  # piece bounds are multiples of this many rows (whole tiles for a GPU's matrix units)
MIN_GAIN = 0.02  # the slowest stage must get this much faster for the split to be kept
MERGED_SLACK = 0.01  # the merged pieces are kept unless their slowest stage is slower than the pieces' by more


def wants_row_splits(options: Any, homes: Mapping[str, str] | None) -> bool:
    """Whether a plan made with ``options`` may split ops' rows: stages in processes of their own
    (``PipelineConfig(processes=True)``), planned by time, with no device map fixing every weight's device."""
    from fxsplit.partition.throughput import TIME_OBJECTIVES

    return held_by_stages(options.pipeline) and options.chosen_objective in TIME_OBJECTIVES and homes is None


def try_row_splits(planned: Planned, graph_module: torch.fx.GraphModule, replan: Callable[[], Planned]) -> Planned:
    """``planned``, or a plan of ``graph_module`` with the rows of its longest linear ops split over stages when
    that makes the slowest stage faster (module docstring). ``replan`` plans the graph as it is when called;
    the graph is left as the returned plan describes it."""
    fine = _fine_splits(planned, graph_module)
    found = _planned_with(graph_module, fine, replan) if fine else None
    if found is None:
        return planned
    pieces, undo = found
    if _slowest(pieces) > (1 - MIN_GAIN) * _slowest(planned):
        undo()
        return planned
    coarse = _merged(pieces, fine)
    if coarse == fine:  # a piece per device already
        return pieces
    undo()
    merged = _planned_with(graph_module, coarse, replan)
    if merged is not None and _slowest(merged[0]) <= (1 + MERGED_SLACK) * _slowest(pieces):
        return merged[0]
    if merged is not None:  # measured (profile=True), one large piece can run slower than the small ones did
        merged[1]()
    again = _planned_with(graph_module, fine, replan)
    return again[0] if again is not None else planned


def _planned_with(
    graph_module: torch.fx.GraphModule, splits: Mapping[str, tuple[int, ...]], replan: Callable[[], Planned]
) -> tuple[Planned, Callable[[], None]] | None:
    """The plan of ``graph_module`` with ``splits`` made, and the undo; None (the graph as it was) when the graph
    cannot be split so (a node already has a piece's name) or no plan fits the pieces."""
    try:
        undo = split_rows(graph_module, splits)
    except ValueError:
        return None
    try:
        return replan(), undo
    except FxsplitError:  # e.g. no stage can hold a piece's rows beside its ops
        undo()
        return None


def shard_sources(graph_module: torch.fx.GraphModule, model: torch.nn.Module) -> dict[str, str]:
    """Graph path of each row parameter of ``graph_module`` -> the canonical name of the model's weight it holds
    rows of (empty: no op split)."""
    shards = row_shards(graph_module)
    if not shards:
        return {}
    names = {key: found[0][0] for key, found in model_tensors(model).items()}
    return {path: names.get(id(attr_at(graph_module, s.source)), s.source) for path, s in shards.items()}


def recorded_splits(graph_module: torch.fx.GraphModule, model: torch.nn.Module) -> dict[str, RowSplit]:
    """What :attr:`Plan.row_splits <fxsplit.planning.plan.Plan.row_splits>` records of the ops split in
    ``graph_module``: each op's weight, by its canonical name, and row bounds."""
    splits = row_splits_of(graph_module)
    sources = shard_sources(graph_module, model)
    return {op: RowSplit(sources[f"{ROWS_MODULE}.{op}_rows0_weight"], bounds) for op, bounds in splits.items()}


def _slowest(planned: Planned) -> float:
    """Seconds of the plan's slowest stage (its pipeline's time per micro-batch)."""
    totals = stage_totals(planned.plan.timing)
    return max(totals.values(), default=0.0)


def _fine_splits(planned: Planned, graph_module: torch.fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """Op name -> row bounds of equal pieces, for every splittable op longer than :data:`PIECE_SHARE` of a mean
    stage."""
    timing, devices = planned.timing, planned.plan.devices
    if timing is None or len(devices) < 2:
        return {}
    seconds = timing.op_seconds.mean(axis=0)  # per op, over the devices
    share = PIECE_SHARE * float(seconds.sum()) / len(devices)
    if share <= 0:
        return {}
    position = {op.name: k for k, op in enumerate(planned.costs.ops)}
    found = {}
    for name, op in splittable_ops(graph_module).items():
        took = float(seconds[position[name]]) if name in position else 0.0
        if took > share:
            bounds = piece_bounds(op.rows, min(MAX_PIECES, math.ceil(took / share)))
            if len(bounds) > 2:
                found[name] = bounds
    return found


def piece_bounds(rows: int, pieces: int) -> tuple[int, ...]:
    """Bounds of ``pieces`` near-equal row ranges of ``rows``, inner bounds rounded to :data:`ROW_MULTIPLE` (fewer
    pieces when the rows are too few for that).

    >>> piece_bounds(50257, 4)
    (0, 12544, 25152, 37696, 50257)
    >>> piece_bounds(100, 4)
    (0, 64, 100)
    """
    inner = {ROW_MULTIPLE * round(rows * k / pieces / ROW_MULTIPLE) for k in range(1, pieces)}
    return (0, *sorted(b for b in inner if 0 < b < rows), rows)


def _merged(planned: Planned, fine: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The fine pieces each device took, merged into one range per run of pieces on a device; ops whose pieces
    all went to one device are left out."""
    placement = planned.plan.placement
    merged = {}
    for name, bounds in fine.items():
        devices = [placement[f"{name}_rows{k}"] for k in range(len(bounds) - 1)]
        kept = [bounds[0], *(b for k, b in enumerate(bounds[1:-1], 1) if devices[k] != devices[k - 1]), bounds[-1]]
        if len(kept) > 2:
            merged[name] = tuple(kept)
    return merged
