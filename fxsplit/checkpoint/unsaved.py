"""What a Hugging Face model's checkpoints may lack, and may hold that the model does not: transformers' own lists.

transformers leaves some tensors out of what ``save_pretrained`` writes (``_keys_to_ignore_on_save``: Marian's
sinusoidal position tables, which its initializer computes), lets a checkpoint lack others
(``_keys_to_ignore_on_load_missing``, patterns: ``final_logits_bias``, a batch norm's ``num_batches_tracked`` in
old checkpoints) and hold others the model does not have (``_keys_to_ignore_on_load_unexpected``, and old
checkpoints' ``rotary_emb.inv_freq`` and ``position_ids``, once persistent buffers, where the model has such
buffers). ``from_pretrained`` initializes the first two as the model does and skips the third, without a word;
:class:`Gaps` lets fxsplit's load do the same, under ``strict=True`` too. transformers gathers each sub-model's
lists into the top model's when it is built (``post_init``), so the top model's are read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from fxsplit.checkpoint.match import Slot

__all__ = ["Gaps", "gaps_of"]


@dataclass(frozen=True)
class Gaps:
    """The names a model's checkpoints may lack or hold besides its own.

    Attributes:
        unsaved: names ``save_pretrained`` never writes: only the model's initializer gives them a value.
        lacking: a pattern of the other names a checkpoint may lack (searched in the name), or None.
        extra: a pattern of the names a checkpoint may hold that are not the model's, or None.
    """

    unsaved: frozenset[str] = frozenset()
    lacking: re.Pattern[str] | None = None
    extra: re.Pattern[str] | None = None

    def may_lack(self, names: Iterable[str]) -> bool:
        """Whether a checkpoint may lack the tensor of these names (any of them)."""
        return any(name in self.unsaved or (self.lacking is not None and self.lacking.search(name)) for name in names)

    def never_saved(self, names: Iterable[str]) -> bool:
        return any(name in self.unsaved for name in names)

    def may_hold(self, name: str) -> bool:
        return self.extra is not None and self.extra.search(name) is not None

    def mark(self, slots: list[Slot]) -> list[Slot]:
        """``slots``, each marked optional where a checkpoint may lack it."""
        for slot in slots:
            slot.optional = slot.optional or bool(self.may_lack(slot.names))
        return slots


def gaps_of(model: Any) -> Gaps:
    """The :class:`Gaps` of a transformers model; none for any other module."""
    if "transformers" not in type(model).__module__.split(".")[:1] or not hasattr(model, "config"):
        return Gaps()
    buffers = [name for name, _ in model.named_buffers()]
    extra = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        extra.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        extra.add(r"(^|\.)position_ids$")
    return Gaps(
        frozenset(getattr(model, "_keys_to_ignore_on_save", None) or ()),
        _pattern(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
        _pattern(extra),
    )


def _pattern(patterns: Iterable[str]) -> re.Pattern[str] | None:
    patterns = sorted(patterns)
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
