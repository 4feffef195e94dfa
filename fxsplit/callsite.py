"""Where a warning points: the user's line that called fxsplit, not a line inside fxsplit or torch.

``warnings.warn(..., stacklevel=user_stacklevel())`` walks up from the line
that warns past every frame of fxsplit, of torch (``nn.Module.__call__``
between a split's ``forward`` and its caller) and of ``contextlib`` (the
wrappers of decorated functions), so that ``python -W error`` and the printed
location name the call the user wrote, however deep the warning was raised.
"""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["user_stacklevel"]

_FXSPLIT = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the caller that names the first frame outside
    fxsplit, torch and contextlib (1 names the caller itself)."""
    import torch

    inside = (_FXSPLIT, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    wrappers = os.path.abspath(contextlib.__file__)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not (name.startswith(inside) or name == wrappers):
            break
        frame, level = frame.f_back, level + 1
    return level
