"""Weights that several stages hold, whole or in row pieces, and how their gradients are summed across ranks.

A stage run in its own process holds every weight its ops read, so a weight
read on several stages (an input embedding tied to the LM head) is held by
each of them; a linear op whose rows are split over stages
(:mod:`fxsplit.tracing.rowsplit`) has each stage hold a parameter over its
rows of the weight. After backward, every holder must see the gradient of the
one weight: :func:`reduce_held` adds each rank's gradient (its rows put at
their place in a tensor of the weight's shape) into one all-reduce over the
holders, then gives each holder its rows of the sum. Row pieces that no other
stage holds (an untied head split over stages) need nothing summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx

from fxsplit.attrpath import attr_at
from fxsplit.cost.build import model_tensors
from fxsplit.tracing.rowsplit import row_shards

__all__ = ["Held", "RowPiece", "broadcast_held", "held_weights", "reduce_held", "unalias_rows"]


@dataclass(frozen=True)
class RowPiece:
    """Rows ``start:stop`` of a weight of shape ``shape`` that a stage module holds as the parameter at ``path``."""

    path: str
    start: int
    stop: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Held:
    """Which stages hold which weights.

    Attributes:
        tied: model name of each trainable weight that several stages hold, whole or in row pieces, with at least
            one holding it whole -> those stages (what :func:`reduce_held` sums over).
        paths: per stage, model name -> where its module holds the whole weight.
        rows: per stage, model name -> the row pieces of the weight its module holds.
    """

    tied: dict[str, tuple[int, ...]]
    paths: tuple[dict[str, str], ...]
    rows: tuple[dict[str, tuple[RowPiece, ...]], ...]


def held_weights(
    model: torch.nn.Module, modules: Sequence[torch.fx.GraphModule], graph_module: torch.fx.GraphModule | None
) -> Held:
    """What each stage module holds of the model's trainable weights, by the model's name; ``graph_module``: the
    traced graph the stages were cut from (its row parameters say which rows of which weight each holds).

    Buffers read by several stages are held by each too, but nothing reduces them:
    a buffer that the forward updates would then differ between the stages.
    """
    names = {key: found[0][0] for key, found in model_tensors(model).items()}
    pieces: dict[str, tuple[str, int, int, tuple[int, ...]]] = {}  # by path: a stage holds a piece where it was
    for path, shard in (row_shards(graph_module) if graph_module is not None else {}).items():
        source = attr_at(graph_module, shard.source)
        name = names.get(id(source), shard.source)
        pieces[path] = (name, shard.start, shard.stop, tuple(source.shape))
    holders: dict[str, list[int]] = {}
    paths: list[dict[str, str]] = []
    rows: list[dict[str, tuple[RowPiece, ...]]] = []
    for index, module in enumerate(modules):
        whole: dict[str, str] = {}
        parts: dict[str, dict[str, RowPiece]] = {}
        for path, tensor in module.named_parameters(remove_duplicate=False):
            if not tensor.requires_grad:
                continue
            if path in pieces:
                name, start, stop, shape = pieces[path]
                parts.setdefault(name, {}).setdefault(str(start), RowPiece(path, start, stop, shape))
            else:
                whole.setdefault(names.setdefault(id(tensor), path), path)
        for name in [*whole, *(n for n in parts if n not in whole)]:
            holders.setdefault(name, []).append(index)
        paths.append(whole)
        rows.append({name: tuple(found.values()) for name, found in parts.items()})
    tied = {
        name: tuple(stages)
        for name, stages in sorted(holders.items())
        if len(stages) > 1 and any(name in paths[s] for s in stages)
    }
    return Held(tied, tuple(paths), tuple(rows))


def unalias_rows(modules: Sequence[torch.nn.Module], graph_module: torch.fx.GraphModule) -> None:
    """Give each stage module that holds a weight whole *and* rows of it (a row parameter over that weight's
    storage) its own copy of those rows: else its optimizer would step those rows twice, once through each."""
    shards = row_shards(graph_module)
    for module in modules:
        own = {id(p) for p in module.parameters()}
        for path, shard in shards.items():
            where, _, name = path.rpartition(".")
            holder = attr_at(module, where, None)
            piece = getattr(holder, name, None)
            if isinstance(piece, torch.nn.Parameter) and id(attr_at(graph_module, shard.source)) in own:
                setattr(holder, name, torch.nn.Parameter(piece.detach().clone(), requires_grad=piece.requires_grad))


def reduce_held(module: torch.nn.Module, whole: str | None, pieces: Sequence[RowPiece], handle: Any) -> None:
    """Sum one weight's gradient over the ranks of ``handle`` (a process group): this rank's module holds it whole
    at ``whole`` and/or in row ``pieces``; every rank of the group must call it for the weight."""
    import torch.distributed as dist

    buffer = _gathered(module, whole, pieces, grads=True)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=handle)
    _scatter(module, pieces, buffer, grads=True)


def broadcast_held(
    module: torch.nn.Module, whole: str | None, pieces: Sequence[RowPiece], src: int, handle: Any
) -> None:
    """Copy one weight from global rank ``src`` (which holds it whole) to every rank of ``handle``, whole or rows."""
    import torch.distributed as dist

    with torch.no_grad():
        buffer = _gathered(module, whole, pieces, grads=False)
        dist.broadcast(buffer, src=src, group=handle)
        _scatter(module, pieces, buffer, grads=False)


def _gathered(module: torch.nn.Module, whole: str | None, pieces: Sequence[RowPiece], *, grads: bool) -> torch.Tensor:
    """The weight (or its gradient) at full shape: the whole one this rank holds (itself: reduced in place), or
    zeros, with this rank's row pieces added at their rows (a gradient) or written there (a weight)."""
    if whole is not None:
        tensor = attr_at(module, whole)
        if grads and tensor.grad is None:
            tensor.grad = torch.zeros_like(tensor)
        buffer = tensor.grad if grads else tensor
    else:
        first = attr_at(module, pieces[0].path)
        buffer = first.new_zeros(pieces[0].shape)
    for piece in pieces:
        part = attr_at(module, piece.path)
        value = part.grad if grads else part
        if value is None:
            continue
        if grads:
            buffer[piece.start : piece.stop] += value
        elif whole is None:
            buffer[piece.start : piece.stop] = value
    return buffer


def _scatter(module: torch.nn.Module, pieces: Sequence[RowPiece], buffer: torch.Tensor, *, grads: bool) -> None:
    """Each row piece gets its rows of ``buffer``: as its gradient, or as its value."""
    for piece in pieces:
        part = attr_at(module, piece.path)
        rows = buffer[piece.start : piece.stop]
        if not grads:
            part.copy_(rows)
        elif part.grad is None:
            part.grad = rows.clone()
        else:
            part.grad.copy_(rows)
