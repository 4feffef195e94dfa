"""Checkpoints that name a model's tensors otherwise: transformers' own conversions, applied by name.

Transformers 5 keeps the names and layout older versions gave some models' weights in their checkpoints, and
converts them when it loads: it renames some (GPT-NeoX's ``embed_out.weight`` is the model's
``lm_head.weight``) and merges others (Mixtral's experts, one tensor per expert and projection in the file,
are one stacked ``gate_up_proj`` and ``down_proj`` in the model). ``save_pretrained`` writes that layout back,
and the Hub's checkpoints are in it. It also takes a checkpoint with or without the base model's prefix
(``bert.`` for a ``BertModel``).

:func:`model_names` gives a checkpoint's table of contents by the model's names, from the headers alone: a
renamed tensor is read from its file under its own key; a merged one is made from its pieces when it is read,
by transformers' own operations, and its shape and dtype are found beforehand by running them on ``meta``.
Nothing changes for a model that is not a transformers model, or whose checkpoint already uses its names.

A checkpoint saved from a ``torch.compile``'d model (its ``state_dict()``) names every tensor with the compiled
module's ``_orig_mod.`` in front, one saved from a ``DataParallel`` or ``DistributedDataParallel`` with
``module.``; where the name without them is the model's, it is read under that name.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from fxsplit.checkpoint.formats import Entry, TableOfContents

__all__ = ["Conversions", "conversions_of", "model_names"]


@dataclass(frozen=True)
class Conversions:
    """What transformers does to a checkpoint's names when it loads one into a model.

    Attributes:
        renamings: its renaming transforms, in order.
        converters: its merging transforms.
        prefix: the model's ``base_model_prefix`` (added to or dropped from a name when that fits the model).
        config: the model's config (some operations read it).
        model: the model (some operations read its parameters' shapes: transformers' ``Split`` cuts a fused
            tensor into pieces the size of the parameters it fills).
    """

    renamings: tuple[Any, ...]
    converters: tuple[Any, ...]
    prefix: str
    config: Any
    model: Any = None


def conversions_of(model: torch.nn.Module) -> Conversions | None:
    """Transformers' conversions for ``model``; None when it is not a transformers model (or this transformers
    has none)."""
    if "transformers" not in type(model).__module__.split(".")[:1] or not hasattr(model, "config"):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without them converts nothing
        return None
    try:
        transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]  # a transformers model, as checked
    except Exception:  # noqa: BLE001 - transformers' own lookup failed on this model: read names as they are, and a
        return None  # checkpoint in another layout is then reported name by name (every split asks, loading or not)
    return Conversions(
        renamings=tuple(t for t in transforms if isinstance(t, WeightRenaming)),
        converters=tuple(t for t in transforms if isinstance(t, WeightConverter)),
        prefix=str(getattr(model, "base_model_prefix", "") or ""),
        config=model.config,
        model=model,
    )


@dataclass
class _Merge:
    """One converter's output: the model name transformers files it under, and the checkpoint keys (with the
    pattern each matched) it is made from."""

    target: str
    converter: Any
    sources: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class MergedTable(TableOfContents):
    """A table of contents by the model's names, some made from several of the checkpoint's tensors."""

    pieces: dict[str, Entry] = field(default_factory=dict)  # checkpoint key -> entry, for the merged tensors' parts
    merges: dict[str, _Merge] = field(default_factory=dict)  # model name -> the merge that makes it
    config: Any = None
    model: Any = None

    def read(self, name: str) -> torch.Tensor:
        merge = self.merges.get(name)
        if merge is None:
            return super().read(name)
        return _convert(merge, self._piece, self.config, self.model)[name]

    def mappable(self, name: str) -> bool:
        return name not in self.merges and super().mappable(name)

    def _piece(self, key: str) -> torch.Tensor:
        entry = self.pieces[key]
        for source in self.files:
            if source.path == entry.file:
                return source.tensor(key)
        raise KeyError(key)  # pragma: no cover - pieces come from files


def model_names(table: TableOfContents, conversions: Conversions | None, names: set[str]) -> TableOfContents:
    """``table`` with its tensors under the model's ``names`` (its state dict's keys), as transformers reads them.

    A checkpoint key whose converted name is not the model's (and every key, without ``conversions``) is kept as
    it is, so that a checkpoint that fits nothing is reported as it is.
    """
    table = _unwrapped_names(table, names)
    if conversions is None or not (conversions.renamings or conversions.converters or conversions.prefix):
        return table
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    known = dict.fromkeys(names, True)  # what transformers asks of the model's state dict: is there such a name
    by_pattern = {p: c for c in conversions.converters for p in c.source_patterns}
    entries: dict[str, Entry] = {}
    merges: dict[str, _Merge] = {}
    pieces: dict[str, Entry] = {}
    problems = list(table.problems)
    for key in sorted(table.entries, key=dot_natural_key):  # pieces in order: expert 0, 1, 2, ...
        entry = table.entries[key]
        name, pattern = rename_source_key(
            key, list(conversions.renamings), list(conversions.converters), conversions.prefix, known
        )
        if name not in known or (name == key and pattern is None):  # fits nothing once renamed, or as it is
            entries[key] = entry
        elif name in entries and pattern is None:
            problems.append(f"duplicate: '{key}' and '{entries[name].key or name}' both are the model's '{name}'")
        elif pattern is None:
            entries[name] = dataclasses.replace(entry, name=name, key=key)
        else:
            merge = merges.setdefault(name, _Merge(name, copy.deepcopy(by_pattern[pattern])))
            merge.sources.append((key, pattern))
            pieces[key] = entry
    if not merges and not any(e.key for e in entries.values()):  # every name is the model's already
        return table
    merged = MergedTable(table.path, entries, table.files, problems, pieces, {}, conversions.config, conversions.model)
    for merge in merges.values():
        shapes = _convert(merge, lambda key: _on_meta(pieces[key]), conversions.config, conversions.model)
        first = pieces[merge.sources[0][0]]
        size = sum(pieces[key].nbytes for key, _ in merge.sources)
        for made, tensor in shapes.items():  # one merge may make several of the model's tensors
            dtype = tensor.dtype
            merged.entries[made] = Entry(made, tuple(tensor.shape), dtype, str(dtype), first.file, size)
            merged.merges[made] = merge
    return merged


_COMPILED = "_orig_mod."  # what torch.compile's OptimizedModule puts before the names of the module it compiles
_PARALLEL = "module."  # what DataParallel and DistributedDataParallel put before them


def _unwrapped(key: str, names: set[str]) -> str:
    """``key`` without the ``_orig_mod.`` components and leading ``module.`` that wrappers put in it."""
    name = key.replace(_COMPILED, "")
    while name not in names and name.startswith(_PARALLEL):
        name = name[len(_PARALLEL) :].replace(_COMPILED, "")
    return name


def _unwrapped_names(table: TableOfContents, names: set[str]) -> TableOfContents:
    """``table`` with a key that is a model's name as a wrapper saved it (:func:`_unwrapped`) under that name,
    unless the checkpoint has the name too."""
    if not any(_COMPILED in key or key.startswith(_PARALLEL) for key in table.entries):
        return table
    entries: dict[str, Entry] = {}
    for key, entry in table.entries.items():
        name = _unwrapped(key, names)
        if key not in names and name in names and name not in table.entries:
            entries[name] = dataclasses.replace(entry, name=name, key=entry.key or key)
        else:
            entries[key] = entry
    return dataclasses.replace(table, entries=entries)


def _on_meta(entry: Entry) -> torch.Tensor:
    return torch.empty(entry.shape, dtype=entry.dtype or torch.uint8, device="meta")


def _convert(merge: _Merge, read: Any, config: Any, model: Any) -> dict[str, torch.Tensor]:
    """The tensors ``merge`` makes, by their model names, from its pieces as ``read`` gives them."""
    converter = copy.deepcopy(merge.converter)
    for key, pattern in merge.sources:
        converter.add_tensor(merge.target, key, pattern, lambda key=key: read(key))
    made = converter.convert(merge.target, model=model, config=config)
    return {target: value[0] if isinstance(value, list) else value for target, value in made.items()}
