"""Where in the model's code an FX node was made: the line a message names to the user."""

from __future__ import annotations

import torch.fx

__all__ = ["source_line"]


def source_line(node: torch.fx.Node) -> str:
    """``file:line: code`` of the innermost frame of the node's recorded stack outside torch, or ""."""
    lines = [line.strip() for line in str(node.meta.get("stack_trace") or "").strip().splitlines()]
    frames = [
        (at, "" if code.startswith("File ") else code)
        for at, code in zip(lines, [*lines[1:], ""], strict=False)
        if at.startswith("File ")
    ]
    outside = [(at, code) for at, code in frames if "/torch/" not in at.replace("\\", "/")]
    if not outside:
        return ""
    at, code = outside[-1]
    return f"{at.removeprefix('File ')}{': ' + code if code else ''}"
