"""A one-line progress bar on stderr for long work (loading a checkpoint).

Shown only on a terminal, unless asked for (``enabled=True``) or silenced
(``enabled=False``): logs and pipes get nothing. Redrawn at most ten times a
second, with the items and bytes done and the rate.

>>> import io
>>> out = io.StringIO()
>>> bar = Progress("loading", items=2, nbytes=2048, enabled=True, stream=out, now=iter([0.0, 1.0, 2.0]).__next__)
>>> bar.advance(1024); bar.advance(1024); bar.close()
>>> out.getvalue().split("\\r")[-1]
'loading [########################] 2/2 tensors, 2.00 KiB of 2.00 KiB, 1.00 KiB/s\\n'
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from fxsplit.units import format_size

__all__ = ["Progress"]

_WIDTH = 24
_REDRAW_S = 0.1


class Progress:
    """Count items and bytes done out of a known total, drawing a bar when enabled.

    Args:
        label: what is being done (``"loading checkpoint"``).
        items: how many items in all.
        nbytes: how many bytes in all.
        enabled: True to draw, False to stay silent, None to draw only when
            ``stream`` is a terminal.
        stream: where to draw (default: ``sys.stderr``).
        now: the clock (for tests).
    """

    def __init__(
        self,
        label: str,
        *,
        items: int,
        nbytes: int,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _is_terminal(self.stream) if enabled is None else bool(enabled)
        self.label, self.items, self.nbytes = label, items, nbytes
        self.items_done = self.bytes_done = 0
        self._now = now
        self._start = now() if self.enabled else 0.0
        self._drawn = float("-inf")

    def advance(self, nbytes: int) -> None:
        """One more item of ``nbytes`` bytes is done."""
        self.items_done += 1
        self.bytes_done += nbytes
        if self.enabled:
            moment = self._now()
            if moment - self._drawn >= _REDRAW_S or self.items_done == self.items:
                self._draw(moment)

    def close(self) -> None:
        """End the line (when anything was drawn)."""
        if self.enabled and self._drawn != float("-inf"):
            self.stream.write("\n")
            self.stream.flush()
        self.enabled = False

    def _draw(self, moment: float) -> None:
        self._drawn = moment
        share = self.bytes_done / self.nbytes if self.nbytes else self.items_done / max(self.items, 1)
        filled = min(_WIDTH, int(share * _WIDTH))
        elapsed = moment - self._start
        rate = f"{format_size(int(self.bytes_done / elapsed))}/s" if elapsed > 0 else "-"
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {self.items_done}/{self.items} "
            f"tensors, {format_size(self.bytes_done)} of {format_size(self.nbytes)}, {rate}"
        )
        self.stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
