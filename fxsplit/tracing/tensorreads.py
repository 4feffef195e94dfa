"""Which of some given tensors the code run inside a block reads: a torch function mode that notes them.

A tensor a list holds outside the model's modules (``self.state.history[0]``) that ``forward`` reads, and then
replaces with one it computes, is state carried from call to call, which a graph cannot carry; a list whose old
entries ``forward`` does not read but replaces (outputs recorded) is not. Under torch.fx, what reads such a tensor
with no traced input runs for real (``history[0] * 0.5``), so the graph holds the product, not the tensor: the
read is seen here, as torch calls the op, whichever tracer runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["reads_noted"]


class _NoteReads(TorchFunctionMode):
    def __init__(self, watched: set[int]) -> None:
        super().__init__()
        self.watched = watched
        self.read: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        for value in (*args, *(kwargs or {}).values()):
            if isinstance(value, (list, tuple)):
                self.read.update(id(item) for item in value if id(item) in self.watched)
            elif id(value) in self.watched:
                self.read.add(id(value))
        return func(*args, **(kwargs or {}))


@contextmanager
def reads_noted(tensors: list[torch.Tensor]) -> Iterator[set[int]]:
    """Inside the block, note in the set it yields the ids of the ``tensors`` a torch op (or tensor method) is
    called on. No tensors: nothing is installed (the usual case)."""
    if not tensors:
        yield set()
        return
    mode = _NoteReads({id(t) for t in tensors})
    with mode:
        yield mode.read
