"""The one walker of dotted attribute paths (``"layers.3.attn.weight"``), as graph targets and qualified names are.

Every stage that turns a name back into the object it names (a ``get_attr``
target, a parameter's qualified name, a subgraph) goes through :func:`attr_at`,
so that they all agree on what a path reaches and on what a missing part
means.

>>> class Node:
...     pass
>>> root = Node(); root.block = Node(); root.block.weight = 3
>>> attr_at(root, "block.weight")
3
>>> attr_at(root, "block.bias", None) is None
True
>>> attr_at(root, "block.bias")
Traceback (most recent call last):
...
AttributeError: cannot reach 'block.bias': 'block' (Node) has no attribute 'bias'
"""

from __future__ import annotations

from typing import Any

__all__ = ["attr_at"]

_RAISE: Any = object()


def attr_at(root: Any, path: str, default: Any = _RAISE) -> Any:
    """The object at dotted ``path`` under ``root``.

    Each part is read with ``getattr``, so ``nn.Module`` children, parameters
    and buffers are found as ``module.part`` finds them (a numbered child is
    ``"layers.3"``). A part whose value is None ends the walk there: the
    next part is missing.

    Args:
        root: where the path starts (a module, or any object).
        path: attribute names joined by dots.
        default: what to return when a part is missing; without it, a missing
            part raises.

    Raises:
        AttributeError: (only without ``default``) a part is missing; names the
            path, the part and the object that lacks it.
    """
    obj = root
    parts = path.split(".")
    for index, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if default is not _RAISE:
                return default
            reached = ".".join(parts[:index])
            where = f"'{reached}'" if reached else "the root"
            what = "is None" if obj is None else f"({type(obj).__name__}) has no attribute '{part}'"
            raise AttributeError(f"cannot reach '{path}': {where} {what}") from None
    return obj
