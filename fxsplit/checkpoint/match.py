"""Match a checkpoint's table of contents to the tensors it must fill; list every problem at once.

A *slot* is one tensor of a model or split (tied names together) that a
checkpoint may fill. :func:`match` pairs each slot with the checkpoint entry
that fills it, from the headers alone, and raises one
:class:`~fxsplit.errors.CheckpointError` naming everything that does not fit:
tensors missing from the checkpoint, tensors the model does not have, shapes
and dtypes that differ, buffers on ``meta`` that no checkpoint can fill. Like
``load_state_dict(strict=True)``, with the file each tensor came from. With ``strict=False``, tensors the model
lacks and tensors the checkpoint lacks are no problem (:func:`unmatched` names them: the caller skips the first
and initializes the second, :mod:`~fxsplit.checkpoint.initmissing`); every other check holds.

Dtypes: a floating tensor may be stored in any floating dtype (it is
converted when read); any other dtype must be the model's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch

from fxsplit.checkpoint.formats import Entry, TableOfContents
from fxsplit.cost.build import model_tensors
from fxsplit.errors import CheckpointError
from fxsplit.planning.fingerprint import tensor_signature

__all__ = [
    "Match",
    "Slot",
    "match",
    "non_persistent_names",
    "refuse_tied_conflicts",
    "slots_of",
    "unmatched",
    "with_tied",
]

_SHOWN = 20


@dataclass
class Slot:
    """One tensor to fill: every name it has where it is held, the live tensor, and whether a checkpoint has it.

    Attributes:
        names: qualified names (several when tied), canonical first.
        tensor: the parameter or buffer now held (``meta`` or real).
        persistent: a parameter or persistent buffer (in a state dict), so a
            checkpoint must hold it; non-persistent buffers are not saved.
        optional: a checkpoint may lack it even so, and it then keeps its value, or is initialized as the model
            initializes it when on meta: a batch norm's ``num_batches_tracked``, as ``load_state_dict`` takes it,
            and what transformers' lists name (:mod:`~fxsplit.checkpoint.unsaved`).
    """

    names: tuple[str, ...]
    tensor: torch.Tensor
    persistent: bool
    optional: bool = False


@dataclass(frozen=True)
class Match:
    """A slot and the checkpoint entry that fills it."""

    slot: Slot
    entry: Entry


def non_persistent_names(module: torch.nn.Module) -> frozenset[str]:
    """Qualified names of the buffers ``module`` keeps out of its state dict."""
    return frozenset(
        f"{path}.{name}" if path else name
        for path, sub in module.named_modules(remove_duplicate=False)
        for name in sub._non_persistent_buffers_set
    )


def slots_of(holders: Iterable[torch.nn.Module], non_persistent: frozenset[str] | None = None) -> list[Slot]:
    """One slot per distinct tensor the holders hold, with all its names (across holders, each once)."""
    by_id: dict[int, Slot] = {}
    for holder in holders:
        local = non_persistent_names(holder) if non_persistent is None else non_persistent
        for names, tensor, is_buffer in model_tensors(holder).values():
            persistent = not is_buffer or any(n not in local for n in names)
            slot = by_id.setdefault(id(tensor), Slot((), tensor, False))
            slot.names += tuple(n for n in names if n not in slot.names)
            slot.persistent = slot.persistent or persistent
            slot.optional = slot.optional or (tensor.dim() == 0 and any(map(_counter, names)))
    return list(by_id.values())


def _counter(name: str) -> bool:
    """A batch norm's ``num_batches_tracked``: ``load_state_dict`` takes a state dict without it (old checkpoints),
    keeping the module's own."""
    return name == _BATCHES or name.endswith("." + _BATCHES)


_BATCHES = "num_batches_tracked"


def with_tied(slots: list[Slot], tied: tuple[tuple[str, ...], ...]) -> list[Slot]:
    """Slots with every name the plan ties to theirs (an export split holds a tied tensor under one name)."""
    for slot in slots:
        for group in tied:
            if any(name in group for name in slot.names):
                slot.names += tuple(name for name in group if name not in slot.names)
    return slots


def match(
    slots: list[Slot], table: TableOfContents, *, also_known: Iterable[str] = (), strict: bool = True
) -> list[Match]:
    """Pair every slot the checkpoint holds with its entry; raise if anything does not fit.

    ``also_known``: names the checkpoint may hold although no slot takes them
    (tensors of the model that the split does not hold); they are not loaded.
    ``strict=False``: a slot the checkpoint does not hold, or an entry no slot takes, is not a problem.

    Raises:
        CheckpointError: every problem found, with its file; nothing is read.
    """
    problems = list(table.problems)
    found: list[Match] = []
    used: set[str] = set()
    missing: list[str] = []
    for slot in slots:
        present = [n for n in slot.names if n in table.entries]
        used.update(present)
        if not present:
            if slot.optional:
                continue
            if slot.persistent:
                if strict:
                    missing.append(slot.names[0])
                    problems.append(
                        f"missing: '{slot.names[0]}' ({tensor_signature(slot.tensor)}){_tied(slot)} is not "
                        "in the checkpoint"
                    )
            elif slot.tensor.device.type == "meta":
                problems.append(
                    f"meta buffer: '{slot.names[0]}' ({tensor_signature(slot.tensor)}) is on the meta "
                    "device and no checkpoint holds it (a non-persistent buffer, computed when the module "
                    "is built)"
                )
            continue
        for name in present:
            problems += _fit(slot, table.entries[name])
        found.append(Match(slot, table.entries[present[0]]))
    known = used | set(also_known)
    unexpected = [e for name, e in table.entries.items() if name not in known] if strict else []
    problems += [
        f"unexpected: '{e.name}' ({_signature(e)}) in '{e.file.name}' is not a tensor of the model" for e in unexpected
    ]
    if problems:
        raise CheckpointError(_message(table, problems, missing, [e.name for e in unexpected]), tuple(problems))
    return found


def unmatched(
    slots: list[Slot], table: TableOfContents, *, also_known: Iterable[str] = ()
) -> tuple[list[Slot], list[str]]:
    """The slots a checkpoint should fill and does not hold (parameters and persistent buffers), and the names
    it holds that no slot takes (nor ``also_known``): what ``strict=False`` lets through."""
    missing = [
        slot for slot in slots if (slot.persistent or slot.optional) and not any(n in table.entries for n in slot.names)
    ]
    known = {name for slot in slots for name in slot.names}.union(also_known)
    return missing, [name for name in table.entries if name not in known]


def _tied(slot: Slot) -> str:
    return f" (tied to {', '.join(repr(n) for n in slot.names[1:])})" if len(slot.names) > 1 else ""


def _signature(entry: Entry) -> str:
    dtype = str(entry.dtype).removeprefix("torch.") if entry.dtype is not None else entry.dtype_name
    return f"{dtype}[{', '.join(str(d) for d in entry.shape)}]"


def _fit(slot: Slot, entry: Entry) -> list[str]:
    """What keeps ``entry`` from filling ``slot``: shape, then dtype."""
    where = f"in '{entry.file.name}'"
    if entry.dtype is None:
        return [
            f"dtype: '{entry.name}' {where} is {entry.dtype_name}, which this torch ({torch.__version__}) has "
            "no dtype for"
        ]
    if tuple(slot.tensor.shape) != entry.shape:
        return [f"shape: '{entry.name}' is {_signature(entry)} {where}, {tensor_signature(slot.tensor)} in the model"]
    ours = slot.tensor.dtype
    if entry.dtype != ours and not (entry.dtype.is_floating_point and ours.is_floating_point):
        return [
            f"dtype: '{entry.name}' is {_signature(entry)} {where}, {tensor_signature(slot.tensor)} in the model; "
            "only floating dtypes are converted"
        ]
    return []


def _message(table: TableOfContents, problems: list[str], missing: list[str], unexpected: list[str]) -> str:
    kinds = Counter(p.split(":", 1)[0] for p in problems)
    summary = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    lines: list[str] = []
    for kind in kinds:
        of_kind = [p for p in problems if p.split(":", 1)[0] == kind]
        lines += of_kind[:_SHOWN] + ([f"... and {len(of_kind) - _SHOWN} more {kind}"] if len(of_kind) > _SHOWN else [])
    fixes = _fixes(kinds, missing, unexpected)
    return (
        f"checkpoint '{table.path}' does not fit the model ({summary}); nothing was loaded:\n  "
        + "\n  ".join(lines)
        + ("\n" + "\n".join(fixes) if fixes else "")
    )


def _fixes(kinds: Counter[str], missing: list[str], unexpected: list[str]) -> list[str]:
    fixes = []
    prefix = _prefix_hint(missing, unexpected)
    if prefix:
        fixes.append(prefix)
    if kinds.get("meta buffer"):
        fixes.append(
            "fix for meta buffers: build the model inside fxsplit.empty_weights() (parameters on meta, "
            "buffers computed for real) instead of torch.device('meta'); a buffer made on meta after the model "
            "was built (a static KV cache allocated on the device of a meta model) must be made on a real device"
        )
    if kinds.get("shape") or kinds.get("missing") or kinds.get("unexpected"):
        fixes.append("check that the model was built from the checkpoint's own config")
    if kinds.get("missing") or kinds.get("unexpected"):
        fixes.append(
            "to load what fits anyway (a base model's checkpoint into a model with a new head, a whole model's into "
            "its encoder), pass strict=False: tensors the model lacks are skipped, tensors the checkpoint lacks "
            "are initialized as the model initializes them; both are listed in a warning"
        )
    return fixes


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """A hint when the checkpoint's names are the model's with a first component added or removed."""
    if not missing or not unexpected:
        return ""
    extra, lacking = set(unexpected), set(missing)
    stripped = Counter(n.split(".", 1)[0] for n in unexpected if "." in n and n.split(".", 1)[1] in lacking)
    if stripped:
        head, _ = stripped.most_common(1)[0]
        return f"the checkpoint's names start with '{head}.' where the model's do not: was it saved from a wrapper?"
    added = Counter(n.split(".", 1)[0] for n in missing if "." in n and n.split(".", 1)[1] in extra)
    if added:
        head, _ = added.most_common(1)[0]
        return (
            f"the model's names start with '{head}.' where the checkpoint's do not: load it into "
            f"model.{head}, or save the whole model"
        )
    return ""


def refuse_tied_conflicts(found: list[Match], table: TableOfContents) -> None:
    """Raise when the checkpoint holds a tied tensor under several of its names with different values: the
    model holds one tensor, so loading would keep one of them silently (the others read only here)."""
    problems = []
    for item in found:
        present = [name for name in item.slot.names if name in table.entries]
        if len(present) < 2:
            continue
        first = table.read(present[0])
        for name in present[1:]:
            other = table.read(name)
            if other.shape != first.shape or not torch.equal(other.to(first.dtype), first):
                problems.append(
                    f"tied: '{present[0]}' and '{name}' are one tensor in the model but hold different values in "
                    f"'{table.entries[name].file.name}'"
                )
    if problems:
        raise CheckpointError(
            "the checkpoint does not fit the model's tied weights; nothing was loaded:\n  "
            + "\n  ".join(problems)
            + "\nthe model can hold only one of each: untie them in the model to keep both (for Hugging Face "
            "models, tie_word_embeddings=False in the config), or load a checkpoint saved from the tied model",
            tuple(problems),
        )
