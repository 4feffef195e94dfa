"""Elapsed time of long stages (tracing, planning) on one stderr line, on a terminal only.

A trace gives no fraction done, so a stage shows a spinner and the seconds
spent while it runs, then one line with the time it took. Shown only when
``enabled`` (None: when the stream is a terminal), so logs and pipes get
nothing; the command line and ``fxsplit.fxsplit(..., progress=...)`` use it.

>>> import io
>>> out = io.StringIO()
>>> with StageTimer(out, enabled=True, now=iter([0.0, 2.5]).__next__).stage("tracing"):
...     pass
>>> out.getvalue().split("\\r")[-1]
'tracing: 2.5s\\x1b[K\\n'
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

__all__ = ["StageTimer"]


class StageTimer:
    """Draws the elapsed time of each :meth:`stage` on ``stream`` (default: stderr).

    Args:
        stream: where to draw.
        enabled: True to draw, False to stay silent, None to draw only on a terminal.
        interval: seconds between redraws of the spinner.
        now: the clock (for tests).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        enabled: bool | None = None,
        interval: float = 0.1,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream or sys.stderr
        self.interval = interval
        self.now = now
        terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = terminal if enabled is None else bool(enabled)

    @contextmanager
    def stage(self, label: str) -> Iterator[None]:
        """Show ``label`` with a spinner and the seconds spent while the block runs, then the time it took."""
        if not self.enabled:
            yield
            return
        start = self.now()
        done = threading.Event()

        def tick() -> None:
            frames = "|/-\\"
            count = 0
            while not done.wait(self.interval):
                count += 1
                self.stream.write(f"\r{frames[count % 4]} {label} ... {time.monotonic() - start:.1f}s")
                self.stream.flush()

        thread = threading.Thread(target=tick, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            self.stream.write(f"\r{label}: {self.now() - start:.1f}s\033[K\n")
            self.stream.flush()
