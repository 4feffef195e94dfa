"""Short names for long runs of modules: ``layers.0`` ... ``layers.11`` -> ``layers.0-11``.

Used wherever a person reads a plan (the table, the plan file, the picture),
so that a device's share of a 48-layer model reads as one line.

>>> summarize_modules(["embed", "layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.2", "norm"])
['embed', 'layers.0-2', 'norm']
>>> summarize_modules(["model.embed_tokens", "model.layers.0.up", "model.layers.1.up", "model.norm", "lm_head"])
['model.embed_tokens', 'model.layers.0-1', 'model.norm', 'lm_head']
>>> summarize_modules(["0", "1", "2", "4"])
['0-2', '4']
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["module_block", "summarize_modules"]


def module_block(path: str) -> str:
    """The part of a module path that names one repeated block.

    Everything up to and including the first numeric component
    (``encoder.layers.3.mlp`` -> ``encoder.layers.3``), else the first two
    components (``model.embed_tokens.x`` -> ``model.embed_tokens``). The root
    module is ``<root>``.
    """
    if not path:
        return "<root>"
    parts = path.split(".")
    for index, part in enumerate(parts):
        if part.isascii() and part.isdigit():
            return ".".join(parts[: index + 1])
    return ".".join(parts[:2])


def summarize_modules(paths: Iterable[str]) -> list[str]:
    """Blocks of ``paths`` in order, consecutive numbered blocks merged into ranges."""
    blocks: list[str] = []
    for path in paths:
        block = module_block(path)
        if block not in blocks[-1:]:
            blocks.append(block)
    merged: list[str] = []
    run: tuple[str, int, int] | None = None  # (prefix, first, last)
    for block in blocks:
        prefix, _, last = block.rpartition(".")
        number = int(last) if (last.isascii() and last.isdigit()) else None
        if run is not None and number is not None and prefix == run[0] and number == run[2] + 1:
            run = (prefix, run[1], number)
            continue
        if run is not None:
            merged.append(_range_name(run))
            run = None
        if number is not None:
            run = (prefix, number, number)
        else:
            merged.append(block)
    if run is not None:
        merged.append(_range_name(run))
    return merged


def _range_name(run: tuple[str, int, int]) -> str:
    prefix, first, last = run
    head = f"{prefix}." if prefix else ""
    return f"{head}{first}" if first == last else f"{head}{first}-{last}"
