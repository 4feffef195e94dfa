"""Model tensors that share memory, one of them written in place: refused, since a split holds each as its own.

Two buffers may be views of one storage (``self.register_buffer("head", mask[:2])``), as may two constants torch.fx
keeps (``mask`` and ``mask[:2]``). The split holds every tensor it reads on its device as a tensor of its own, so
when ``forward`` writes one in place, the other no longer sees the write as it does in the model: the split's
outputs differed from the model's from the first call, with no word. Tensors that are the same view (export's
lifted constants over the buffers they came from) are one tensor to the cost model already
(:func:`~fxsplit.cost.build.storage_key`); this is about views that differ and meet (views of one cache tensor,
a layer each, do not meet: each stays right).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from fxsplit.errors import TraceError

__all__ = ["refuse_written_views"]

_MARKED = 1 << 26  # elements of a storage marked to tell exactly whether two views of it meet


def refuse_written_views(read: Mapping[int, tuple[Any, ...]], written: set[int]) -> None:
    """Raise a :class:`TraceError` if a tensor of ``written`` (ids) shares memory with another tensor of ``read``
    (``id -> (names, tensor, ...)``, what the graph reads) that is not the same view of it."""
    if not written:
        return
    by_memory: dict[tuple[object, int], list[tuple[list[str], torch.Tensor]]] = {}
    for names, tensor, *_ in read.values():
        if tensor.device.type != "meta" and (pointer := tensor.untyped_storage().data_ptr()):
            by_memory.setdefault((tensor.device, pointer), []).append((names, tensor))
    for key in written:
        if key not in read:
            continue
        names, tensor = read[key][0], read[key][1]
        if tensor.device.type == "meta" or not (pointer := tensor.untyped_storage().data_ptr()):
            continue
        others = [
            o for o, t in by_memory[(tensor.device, pointer)] if not _same_view(t, tensor) and _overlap(t, tensor)
        ]
        if others:
            shared = " and ".join(repr(o[0]) for o in others[:3])
            raise TraceError(
                f"forward writes {names[0]!r} in place, and {shared} {'shares' if len(others) == 1 else 'share'} "
                "its memory (a view of it, or it of them): a split holds each tensor it reads as its own, on its "
                "device, so the write would not reach the other as it does in the model. Make the view in "
                f"forward from {names[0]!r} (self.{names[0].rsplit('.', 1)[-1]}[...]) instead of holding it, or "
                "give each its own memory (.clone())"
            )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether views ``a`` and ``b`` of one storage share an element (views of one cache, a layer each, do not):
    exactly, by marking ``a``'s elements, for storages of up to ``_MARKED`` elements of one dtype; else whether
    their spans meet."""
    if a.dtype == b.dtype and (count := a.untyped_storage().nbytes() // a.element_size()) <= _MARKED:
        marks = torch.zeros(count, dtype=torch.bool)
        marks.as_strided(a.shape, a.stride(), a.storage_offset()).fill_(True)
        return bool(marks.as_strided(b.shape, b.stride(), b.storage_offset()).any())
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a view reaches: ``[start, end)``."""
    size = tensor.element_size()
    start = int(tensor.storage_offset()) * size
    reach = sum((int(n) - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (reach + 1) * size if tensor.numel() else start


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.storage_offset(), tuple(a.shape), a.stride(), a.dtype) == (
        b.storage_offset(),
        tuple(b.shape),
        b.stride(),
        b.dtype,
    )
