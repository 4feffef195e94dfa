"""Copies between CUDA devices on side streams, so that stages overlap their copies with compute.

A stage's compute runs on its device's current stream. A value it needs from
another GPU is copied on a *copy stream* of each of the two devices (the CUDA
copy kernel runs on the source device and synchronises with the current
streams of both): the source copy stream first waits for the compute that
made the value, and the destination's compute stream waits for the copy.
``record_stream`` tells the caching allocator about the cross-stream uses.
Autograd runs each backward op on the stream of its forward op and inserts
the waits itself.

Not used for ``cpu`` or ``cpu:N`` devices, where the generated ``.to()``
copies are enough. This path needs GPUs; the CPU test suite cannot run it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["CudaCopies"]


class CudaCopies:
    """One copy stream per CUDA device, made on first use."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def copy_in(self, values: Sequence[Any], device: str) -> list[Any]:
        """``values`` with every tensor on another GPU copied to ``device``; the rest as they are."""
        target = torch.device(device)
        if target.type != "cuda":
            return list(values)
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        return [self._copy(v, target) if _on_other_gpu(v, target) else v for v in values]

    def _copy(self, value: torch.Tensor, target: torch.device) -> torch.Tensor:
        source_stream, target_stream = self._stream(value.device), self._stream(target)
        source_stream.wait_stream(torch.cuda.current_stream(value.device))
        with torch.cuda.stream(source_stream), torch.cuda.stream(target_stream):
            moved = value.to(target, non_blocking=True)
        value.record_stream(source_stream)
        compute = torch.cuda.current_stream(target)
        compute.wait_stream(target_stream)
        moved.record_stream(compute)
        return moved


def _on_other_gpu(value: Any, target: torch.device) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cuda" and value.device != target
