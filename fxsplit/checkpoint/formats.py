"""Checkpoint files: find them, read their tables of contents, read one tensor at a time.

Two formats:

* safetensors (``.safetensors``): an 8-byte little-endian header length, a
  JSON header (name -> dtype, shape, byte range), then the data. The header
  alone gives every name, shape and dtype, so a checkpoint is checked before
  one byte of data is read. Data is read through a private memory map: a
  tensor handed out is a view of the file's pages (page cache, not anonymous
  memory) until it is copied to its device.
* PyTorch (``.bin``, ``.pt``, ``.pth``): a ``torch.save`` state dict, opened with
  ``torch.load(mmap=True, weights_only=True)``; its tensors are views of the
  mapped file as well.

A directory is read the way ``save_pretrained`` writes one: the
``model.safetensors.index.json`` (or ``pytorch_model.bin.index.json``) of a
sharded checkpoint, else ``model.safetensors`` / ``pytorch_model.bin``, else every
``.safetensors`` file in it.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fxsplit.errors import CheckpointError

__all__ = ["Entry", "TableOfContents", "read_table"]

SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
    "C128": "complex128",
}
"""safetensors dtype code -> torch dtype name."""

_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
_TORCH_SUFFIXES = (".bin", ".pt", ".pth")
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint, known from its file's header.

    Attributes:
        name: the key in the checkpoint.
        shape: its shape.
        dtype: its torch dtype, or None when the file's dtype has no torch equivalent.
        dtype_name: the dtype as the file spells it (``"BF16"``, ``"torch.float32"``).
        file: the file it is in.
        nbytes: bytes of its data in the file.
        key: its key in the file when ``name`` is the model's name for it (a renamed tensor:
            :mod:`~fxsplit.checkpoint.renamed`), else empty.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    dtype_name: str
    file: Path
    nbytes: int
    key: str = ""


class _SafetensorsFile:
    """One safetensors file: its header now, its data (memory-mapped) when first read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, Entry] = {}
        self._ranges: dict[str, tuple[int, int]] = {}
        self._map: mmap.mmap | None = None
        self.kept = False  # views handed out to outlive the table: close() must not unmap
        self._read_header()

    def _read_header(self) -> None:
        size = self.path.stat().st_size
        with open(self.path, "rb") as handle:
            head = handle.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise CheckpointError(
                    f"'{self.path}' is not a safetensors file: its header length "
                    f"{length} does not fit its {size} bytes; is the file truncated?"
                )
            try:
                header = json.loads(handle.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise CheckpointError(f"'{self.path}': the safetensors header is not JSON ({error})") from None
        start = 8 + length
        header.pop("__metadata__", None)
        for name, info in header.items():
            self._add(name, info, start, size)

    def _add(self, name: str, info: Any, start: int, size: int) -> None:
        try:
            code, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"'{self.path}': the header entry of '{name}' is malformed ({info!r})") from None
        dtype = getattr(torch, SAFETENSORS_DTYPES.get(code, "?"), None)
        numel = 1
        for dim in shape:
            numel *= dim
        if dtype is not None and (end - begin != numel * dtype.itemsize or begin > end or start + end > size):
            raise CheckpointError(
                f"'{self.path}': '{name}' ({code}{list(shape)}) claims bytes {begin}..{end} "
                f"of a data section of {size - start} bytes; the file is corrupt or truncated"
            )
        self.entries[name] = Entry(name, shape, dtype, code, self.path, end - begin)
        self._ranges[name] = (start + begin, end - begin)

    def tensor(self, name: str) -> torch.Tensor:
        """``name``'s data as a view of the mapped file (no copy)."""
        entry = self.entries[name]
        assert entry.dtype is not None
        offset, nbytes = self._ranges[name]
        if nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        if self._map is None:
            with open(self.path, "rb") as handle:  # private map: writable view, pages stay the file's
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._map, dtype=entry.dtype, count=nbytes // entry.dtype.itemsize, offset=offset)
        return flat.view(entry.shape)

    def close(self) -> None:
        """Unmap the file, unless views of it were handed out to be kept (:meth:`TableOfContents.keep`).

        torch.frombuffer references the map but holds no buffer export, so
        closing it under a live view would leave the view pointing at
        unmapped memory; a kept map is only dropped here, and the OS unmaps it
        when the last view that references it is freed.
        """
        if self._map is not None and not self.kept:
            self._map.close()
        self._map = None


class _TorchFile:
    """One ``torch.save`` state dict, opened memory-mapped (tensors are views of the file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        state = _torch_load(path)
        self._tensors: dict[str, torch.Tensor] = state
        self.entries = {
            name: Entry(name, tuple(t.shape), t.dtype, str(t.dtype), path, t.numel() * t.element_size())
            for name, t in state.items()
        }

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def close(self) -> None:
        self._tensors = {}


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch.load raises many kinds
        first = (str(error).strip().splitlines() or [""])[0]
        hint = ""
        if "zipfile" in first or "mmap" in first:
            hint = (
                "; only files written by torch.save's default (zip) format can be memory-mapped: load it once "
                "and save it again with torch.save, or convert it to safetensors"
            )
        raise CheckpointError(
            f"'{path}' could not be opened as a PyTorch state dict ({type(error).__name__}: {first}){hint}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        values = state.values() if isinstance(state, dict) else [state]
        kinds = sorted({type(v).__name__ for v in values})
        raise CheckpointError(
            f"'{path}' holds {', '.join(kinds)}, not a state dict (name -> tensor); save "
            "model.state_dict() with torch.save"
        )
    return state


@dataclass
class TableOfContents:
    """Every tensor of a checkpoint (name -> :class:`Entry`) and how to read each.

    ``problems`` lists what is wrong with the files themselves (a name in two
    shards, an index that names a tensor its shard lacks); the caller reports
    them with its own.
    """

    path: Path
    entries: dict[str, Entry]
    files: list[_SafetensorsFile | _TorchFile]
    problems: list[str] = field(default_factory=list)

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``, as a view of its mapped file: copy it before the file is closed."""
        entry = self.entries[name]
        for source in self.files:
            if source.path == entry.file:
                return source.tensor(entry.key or name)
        raise KeyError(name)  # pragma: no cover - entries come from files

    def mappable(self, name: str) -> bool:
        """Whether :meth:`keep` can hand out ``name`` as a view of its file (a safetensors file's tensor)."""
        return self.entries[name].file.suffix == ".safetensors"

    def keep(self, name: str) -> torch.Tensor:
        """The safetensors tensor ``name`` as a view of its mapped file that stays valid after :meth:`close`."""
        entry = self.entries[name]
        for source in self.files:
            if source.path == entry.file and isinstance(source, _SafetensorsFile):
                source.kept = True
                return source.tensor(entry.key or name)
        raise KeyError(name)

    def close(self) -> None:
        for source in self.files:
            source.close()


def read_table(path: str | os.PathLike[str]) -> TableOfContents:
    """Find the checkpoint at ``path`` (file, index file or directory) and read every header.

    Reads no tensor data (a PyTorch file's tensors are mapped, not read).

    Raises:
        CheckpointError: no checkpoint there, or a file is not one.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(
            f"checkpoint={str(path)!r} does not exist; pass a safetensors or torch.save file, "
            "an index .json, or a directory written by save_pretrained"
        )
    files, index = _files_of(root)
    sources = [_open(f) for f in files]
    table = TableOfContents(root, {}, sources)
    for source in sources:
        for name, entry in source.entries.items():
            if name in table.entries:
                table.problems.append(
                    f"duplicate: '{name}' is in both '{table.entries[name].file.name}' and '{entry.file.name}'"
                )
                continue
            table.entries[name] = entry
    for name, file in (index or {}).items():
        listed = table.entries.get(name)
        if listed is None or listed.file.name != Path(file).name:
            table.problems.append(f"index: '{name}' is listed in '{file}', which does not hold it")
    return table


def _open(path: Path) -> _SafetensorsFile | _TorchFile:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file '{path}' does not exist (named by the checkpoint's index)")
    if path.suffix == ".safetensors":
        return _SafetensorsFile(path)
    return _TorchFile(path)


def _files_of(root: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The files of the checkpoint at ``root``, and the index's name -> file map when there is one."""
    if root.is_file():
        return ([*_index_files(root)], _index_map(root)) if root.suffix == ".json" else ([root], None)
    for name in _INDEX_FILES:
        if (root / name).is_file():
            return _index_files(root / name), _index_map(root / name)
    for name in _SINGLE_FILES:
        if (root / name).is_file():
            return [root / name], None
    found = sorted(root.glob("*.safetensors")) or sorted(p for s in _TORCH_SUFFIXES for p in root.glob(f"*{s}"))
    if not found:
        raise CheckpointError(
            f"no checkpoint in '{root}': looked for {', '.join(_INDEX_FILES + _SINGLE_FILES)} "
            f"and *.safetensors, *{', *'.join(_TORCH_SUFFIXES)} files"
        )
    return found, None


def _index_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"'{index}' is not a checkpoint index (a JSON object with a 'weight_map' of "
            f"tensor name -> file): {type(error).__name__}: {error}"
        ) from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"'{index}': 'weight_map' must map tensor names to files (got {type(weight_map)})")
    return {str(k): str(v) for k, v in weight_map.items()}


def _index_files(index: Path) -> list[Path]:
    names = dict.fromkeys(_index_map(index).values())  # first-seen order, once each
    return [index.parent / name for name in names]
