"""Write tensors to a safetensors file one at a time, and map them back: fxsplit's disk storage.

Weights offloaded to disk live in one safetensors file per split, written
tensor by tensor (never more than one tensor's bytes in host memory at once)
and then memory-mapped: the split's parameters become views of the file's
pages, which the page cache holds and drops as it likes, so they are not the
process's own (anonymous) memory. The file is an ordinary safetensors file.
On POSIX systems it is unlinked as soon as it is mapped: nothing is left
behind in the directory, and its disk space is freed when the last tensor
that maps it is (at the latest when the process ends).
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from fxsplit.checkpoint.formats import SAFETENSORS_DTYPES, TableOfContents, read_table

__all__ = ["new_offload_file", "store_on_disk", "write_safetensors"]

_CODES = {name: code for code, name in SAFETENSORS_DTYPES.items()}
_ALIGN = 8


Layout = Mapping[str, tuple[Sequence[int], torch.dtype]]
"""Tensor name -> (shape, dtype), in the order they are written."""


def write_safetensors(
    path: str | os.PathLike[str], layout: Layout, read: Callable[[str], torch.Tensor]
) -> TableOfContents:
    """Write the tensors ``layout`` describes to ``path``, getting each from ``read`` only when it is written.

    At most one tensor (as ``read`` returns it, on any device) is held at a
    time. Returns the file's table of contents, whose
    :meth:`~fxsplit.checkpoint.formats.TableOfContents.read` gives each tensor
    as a view of the mapped file (no copy).
    """
    header: dict[str, object] = {}
    offset = 0
    for name, (shape, dtype) in layout.items():
        code = _CODES.get(str(dtype).removeprefix("torch."))
        if code is None:
            raise TypeError(f"'{name}' has dtype {dtype}, which safetensors cannot store")
        numel = 1
        for size in shape:
            numel *= int(size)
        nbytes = numel * dtype.itemsize
        header[name] = {"dtype": code, "shape": [int(s) for s in shape], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % _ALIGN)  # data starts aligned, as safetensors writes it
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)))
        handle.write(text)
        for name, (shape, dtype) in layout.items():
            flat = read(name).detach().to("cpu", dtype).contiguous().reshape(-1)
            if flat.numel() != int(torch.Size(shape).numel()):
                raise ValueError(f"'{name}' has {flat.numel()} elements, not the {list(shape)} its layout says")
            if flat.numel():
                handle.write(flat.view(torch.uint8).numpy().data)  # no copy
            del flat
    return read_table(target)


def store_on_disk(
    directory: str | os.PathLike[str], tag: str, layout: Layout, read: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Write the tensors to a new file in ``directory``; return them as views of the mapped file.

    The file is unlinked once mapped (POSIX): see the module's docstring.
    """
    path = new_offload_file(directory, tag)
    try:
        table = write_safetensors(path, layout, read)
        views = {name: table.read(name) for name in layout}
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    if os.name == "posix":
        path.unlink(missing_ok=True)
    return views


def new_offload_file(directory: str | os.PathLike[str], tag: str) -> Path:
    """A fresh file name in ``directory`` for one split's offloaded weights (never one a live split maps)."""
    safe = "".join(c if c.isalnum() else "-" for c in tag)[:24] or "model"
    return Path(directory) / f"fxsplit-offload-{safe}-{uuid.uuid4().hex[:8]}.safetensors"
