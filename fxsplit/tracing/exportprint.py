"""torch.export's print of a failed trace's partial graph, kept off the user's stderr.

When ``torch.export.export`` fails on an error that carries a partial graph
(Python control flow on a tensor's value, for one), torch prints that graph's
code to ``sys.stderr``, once per layer of its own wrappers, before raising.
fxsplit reports the failure itself (the line that failed and what to do), and
with ``trace="auto"`` it may go on and trace with torch.fx: the dump then reads
as a crash of a call that worked. :func:`partial_graphs_unprinted` holds what
is written to ``sys.stderr`` during the block and passes it on afterwards, less
the failed trace's graph.
"""

from __future__ import annotations

import io
import sys
from contextlib import contextmanager, redirect_stderr
from typing import Iterator

__all__ = ["partial_graphs_unprinted"]


@contextmanager
def partial_graphs_unprinted() -> Iterator[None]:
    """Inside the block, ``sys.stderr`` is held and written out at its end, without the partial graph of the
    error the block raises (anything else written, a warning or the model's own prints, is kept, in order)."""
    held = io.StringIO()
    try:
        with redirect_stderr(held):
            yield
    except BaseException as error:
        graph = getattr(error, "partial_fx_graph", None)
        said = held.getvalue()
        _write(said.replace(f"{graph}\n", "") if graph is not None else said)
        raise
    _write(held.getvalue())


def _write(text: str) -> None:
    if text:
        sys.stderr.write(text)
