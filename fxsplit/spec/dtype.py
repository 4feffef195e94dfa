"""The dtype a plan is made for: :func:`planning_dtype` reads ``"bf16"``, ``"torch.bfloat16"``, ... as ``"bfloat16"``.

>>> planning_dtype("bf16"), planning_dtype(None)
('bfloat16', None)
"""

from __future__ import annotations

from typing import Any

from fxsplit.errors import SpecError
from fxsplit.yamlfile import short_repr as _short

__all__ = ["DTYPES", "planning_dtype"]

DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}  # fmt: skip


def planning_dtype(value: Any) -> str | None:
    """Canonical name of a planning dtype: ``"bf16"`` or ``torch.bfloat16`` -> ``"bfloat16"``.

    Raises:
        SpecError: not a floating dtype fxsplit plans for.
    """
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise SpecError(f"dtype must be one of {', '.join(DTYPES)} (got {_short(value)})")
    return DTYPES[name]
