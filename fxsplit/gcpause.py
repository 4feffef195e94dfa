"""Planning steps run with Python's cyclic garbage collector paused.

Planning a large model makes a few objects per op and almost no reference
cycles, while the process holds the model and its traced graph: hundreds of
thousands of objects that every full collection walks again. On a 40k-op
graph two such passes took half of the planning time, and when they happen
depends on the allocation counters, so the time jumped with the size of the
graph. The steps decorated with :func:`gc_paused` are pure bookkeeping
(reference counting still frees what they drop); the collector is switched
back on when they end, whatever happens, unless it was already off.

Switched back on, the collector's next pass walks every object made while it
was off that is still alive: after the cost model, that is the whole cost
model. So ``fxsplit.plan()`` keeps it paused from the end of tracing until it
has dropped all but the plan it returns (:func:`fxsplit.api.trace_and_plan`),
and the steps' own pauses only matter when they are called alone.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

__all__ = ["gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block (or, as a decorator, the call); restore it after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
