"""The checkpoint loading bar (fxsplit.checkpoint.progress): drawn on a terminal, throttled, silent elsewhere."""

from __future__ import annotations

import io

from fxsplit.checkpoint.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def clock(*moments: float):  # type: ignore[no-untyped-def]
    return iter(moments).__next__


def test_drawn_at_most_ten_times_a_second_and_always_at_the_end() -> None:
    out = io.StringIO()
    bar = Progress("loading", items=4, nbytes=4000, enabled=True, stream=out, now=clock(0.0, 0.01, 0.05, 0.2, 0.21))
    for _ in range(4):
        bar.advance(1000)
    bar.close()
    frames = out.getvalue().split("\r")[1:]
    assert len(frames) == 3  # at 0.01 (the first), not 0.05 (too soon), 0.2, and 0.21 (the last item)
    assert frames[0] == "loading [######..................] 1/4 tensors, 1000 B of 3.91 KiB, 97.66 KiB/s"
    assert frames[-1] == "loading [########################] 4/4 tensors, 3.91 KiB of 3.91 KiB, 18.60 KiB/s\n"


def test_silent_off_a_terminal_unless_asked_and_when_told() -> None:
    for stream, enabled, drawn in (
        (io.StringIO(), None, False),  # a pipe or a log
        (Terminal(), None, True),
        (Terminal(), False, False),
        (io.StringIO(), True, True),
    ):
        bar = Progress("x", items=1, nbytes=1, enabled=enabled, stream=stream, now=clock(0.0, 1.0))
        bar.advance(1)
        bar.close()
        assert (stream.getvalue() != "") is drawn, (stream, enabled)


def test_a_stream_without_isatty_counts_as_no_terminal() -> None:
    class Bare:
        def write(self, text: str) -> None:
            raise AssertionError("nothing should be drawn")

    bar = Progress("x", items=1, nbytes=1, stream=Bare())  # type: ignore[arg-type]
    bar.advance(1)
    bar.close()
    assert not bar.enabled and bar.items_done == 1 and bar.bytes_done == 1


def test_without_bytes_the_bar_follows_the_items_and_closes_once() -> None:
    out = io.StringIO()
    bar = Progress("x", items=2, nbytes=0, enabled=True, stream=out, now=clock(0.0, 0.0, 0.5))
    bar.advance(0)
    assert "[############............] 1/2 tensors, 0 B of 0 B, -" in out.getvalue()  # no time elapsed: no rate
    bar.advance(0)
    bar.close()
    bar.close()
    assert out.getvalue().endswith("2/2 tensors, 0 B of 0 B, 0 B/s\n") and out.getvalue().count("\n") == 1


def test_a_bar_that_drew_nothing_closes_without_a_newline() -> None:
    stream = io.StringIO()
    bar = Progress("loading", items=3, nbytes=30, enabled=True, stream=stream, now=lambda: 0.0)
    bar.close()
    assert stream.getvalue() == ""
