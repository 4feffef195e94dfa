"""Load a checkpoint onto the devices a plan chose: check every header, read, then commit at once.

Three steps, so that a failure leaves everything as it was:

1. check: the checkpoint's headers against the tensors to fill
   (:func:`~fxsplit.checkpoint.match.match`); nothing is read yet.
2. read: one tensor at a time, from the memory-mapped file straight into a
   new tensor on its planned device, converted to the plan's ``dtype`` on
   the way (one copy, no intermediate in host memory). Held aside.
3. commit: every tensor that was real gets the loaded data in place
   (``param.data = loaded``: the same ``Parameter`` object, like
   ``Module.to``); every tensor on ``meta`` is *replaced*, in every module
   that holds it, by a new ``Parameter`` (or buffer) holding the loaded data,
   like ``load_state_dict(assign=True)`` (torch cannot turn a meta tensor into
   a real one in place).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Union

import torch

from fxsplit.attrpath import attr_at
from fxsplit.checkpoint.empty import replace_held, tensor_like
from fxsplit.checkpoint.formats import TableOfContents, read_table
from fxsplit.checkpoint.initmissing import check_initializable, initialize_missing, warn_loose
from fxsplit.checkpoint.match import (
    Match,
    Slot,
    match,
    non_persistent_names,
    refuse_tied_conflicts,
    slots_of,
    unmatched,
    with_tied,
)
from fxsplit.checkpoint.progress import Progress
from fxsplit.checkpoint.renamed import conversions_of, model_names
from fxsplit.checkpoint.unsaved import Gaps, gaps_of
from fxsplit.checkpoint.write import store_on_disk
from fxsplit.cost.build import Weight
from fxsplit.cost.keptdtype import kept_dtypes
from fxsplit.cost.walk import named_tensors
from fxsplit.errors import CheckpointError, SpecError
from fxsplit.planning.plan import Plan

__all__ = [
    "CONVERSIONS",
    "GAPS",
    "KEPT_DTYPES",
    "ModelLoad",
    "NON_PERSISTENT",
    "load_checkpoint",
    "prepare",
    "remember_non_persistent",
]

PathLike = Union[str, "os.PathLike[str]"]

NON_PERSISTENT = "fxsplit_non_persistent"
"""``split.meta`` key: names of the model's non-persistent buffers (not expected in a checkpoint)."""
CONVERSIONS = "fxsplit_checkpoint_names"
"""``split.meta`` key: how transformers names the model's tensors in its checkpoints
(:func:`~fxsplit.checkpoint.renamed.conversions_of`), or None."""
KEPT_DTYPES = "fxsplit_kept_dtypes"
"""``split.meta`` key: the tensors the model keeps at a dtype of its own at the plan's dtype
(:func:`~fxsplit.cost.keptdtype.kept_dtypes`), for :func:`load_checkpoint`."""
GAPS = "fxsplit_checkpoint_gaps"
"""``split.meta`` key: what the model's checkpoints may lack or hold besides its tensors
(:class:`~fxsplit.checkpoint.unsaved.Gaps`)."""


def remember_non_persistent(split: Any, model: torch.nn.Module) -> Any:
    """Record the model's non-persistent buffer names on ``split`` and keep those buffers out of its state
    dict (a graph module's copy of a buffer forgets it), so that the two state dicts load strictly into
    each other; also how its checkpoints name its tensors, for :func:`load_checkpoint`. Return ``split``."""
    from fxsplit.pipeline.gpipe import Pipeline

    names = non_persistent_names(model)
    split.meta[NON_PERSISTENT] = names
    split.meta[CONVERSIONS] = conversions_of(model)
    split.meta[GAPS] = gaps_of(model)
    plan = split.meta.get("fxsplit_plan")
    split.meta[KEPT_DTYPES] = kept_dtypes(model, plan.dtype if isinstance(plan, Plan) else None)
    stages = split.stages if isinstance(split, Pipeline) else ()  # not a model's own child named "stages"
    ours = {id(tensor) for _, tensor, _ in named_tensors(model)}
    for holder in [split, *stages]:  # a Pipeline's stages hold them under the model's names
        # and constants only the graph holds (torch.export lifts a tensor the forward makes into a buffer,
        # `lifted_tensor_0`): no state of the model's, so out of the state dict as well
        kept_out = names | {name for name, b in holder.named_buffers(remove_duplicate=False) if id(b) not in ours}
        _keep_out(kept_out, holder)
        if isinstance(holder, torch.fx.GraphModule):  # torch's copy of a graph module forgets its own set
            holder._register_deepcopy_hook(functools.partial(_keep_out, kept_out))
    return split


def _keep_out(names: frozenset[str], holder: torch.nn.Module) -> None:
    """Mark the buffers of ``holder`` named ``names`` non-persistent (a module-level function: a copied split's
    deep-copy hook)."""
    for name in names:
        path, _, leaf = name.rpartition(".")
        owner = attr_at(holder, path, None) if path else holder
        if isinstance(owner, torch.nn.Module) and owner._buffers.get(leaf) is not None:
            owner._non_persistent_buffers_set.add(leaf)


class ModelLoad:
    """A checkpoint checked against a model, loaded once the plan says where each tensor goes.

    Made before planning, so that a checkpoint that does not fit fails in
    seconds, before a long trace.
    """

    def __init__(
        self, model: torch.nn.Module, checkpoint: PathLike, progress: bool | None, strict: bool = True
    ) -> None:
        self.model, self.progress, self.strict = model, progress, strict
        gaps = gaps_of(model)
        self.slots = gaps.mark(slots_of([model], non_persistent_names(model)))
        names = {name for slot in self.slots for name in slot.names}
        self.table = model_names(read_table(checkpoint), conversions_of(model), names)
        self.extra = [name for name in self.table.entries if gaps.may_hold(name)]  # skipped unsaid
        match(self.slots, self.table, also_known=self.extra, strict=strict)  # fail early (and again on load)

    @contextlib.contextmanager
    def onto(self, plan: Plan, traced: torch.nn.Module) -> Iterator[Loaded]:
        """Fill the model's tensors (shared with ``traced``) on ``plan``'s devices; undo it if the block fails.

        Yields what was loaded, so that the caller does not move those tensors again.
        """
        ours = {id(s.tensor) for s in self.slots}
        graph_only = [s for s in slots_of([traced], frozenset()) if id(s.tensor) not in ours]
        for slot in graph_only:  # constants the trace made: no checkpoint has them
            slot.persistent = False
        holders = [self.model, traced]
        kept = kept_dtypes(self.model, plan.dtype)
        try:
            found = match([*self.slots, *graph_only], self.table, also_known=self.extra, strict=self.strict)
            missing, skipped = unmatched(self.slots, self.table, also_known=self.extra)  # strict: only optional ones
            fresh = [slot for slot in missing if slot.tensor.device.type == "meta"]  # real ones keep their values
            homes = [_home(slot, plan) for slot in fresh]
            check_initializable(self.model, fresh, homes)
            undo = _load(found, self.table, plan, holders, self.progress, kept)
        finally:
            self.table.close()
        try:
            dtypes = [_dtype(s, plan, kept) for s in fresh]
            made, undo_made = initialize_missing(self.model, fresh, homes, dtypes, holders)
        except BaseException:
            undo()
            raise
        warn_loose(str(self.table.path), skipped, missing, made)
        try:
            names = [item.slot.names for item in found] + [slot.names for slot in fresh]
            yield Loaded(frozenset(name for group in names for name in group))
        except BaseException:
            undo_made()
            undo()  # a failed call leaves the model as it was
            raise


@dataclass(frozen=True)
class Loaded:
    """The names of the tensors a checkpoint filled (already on their planned devices)."""

    names: frozenset[str] = frozenset()

    def not_loaded(self, weights: list[Weight]) -> list[Weight]:
        """The weights still to move: a copy of a loaded one (``cpu`` to ``cpu:1`` copies) would double memory."""
        return [w for w in weights if not self.names.intersection(w.names)]


class _NoCheckpoint:
    """No checkpoint to load: :meth:`onto` loads nothing. ``model``: with ``checkpoint=False``, the model whose
    tensors on meta that its checkpoints never hold (:mod:`~fxsplit.checkpoint.unsaved`) are made and initialized
    now: no checkpoint loaded later can fill them."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.model = model

    @contextlib.contextmanager
    def onto(self, plan: Plan, traced: torch.nn.Module) -> Iterator[Loaded]:
        gaps = gaps_of(self.model) if self.model is not None else None
        if self.model is None or gaps is None or not gaps.unsaved:
            yield Loaded()
            return
        slots = [s for s in slots_of([self.model]) if s.tensor.device.type == "meta" and gaps.never_saved(s.names)]
        kept = kept_dtypes(self.model, plan.dtype)
        homes, dtypes = [_home(s, plan) for s in slots], [_dtype(s, plan, kept) for s in slots]
        _, undo = initialize_missing(self.model, slots, homes, dtypes, [self.model, traced])
        try:
            yield Loaded(frozenset(name for slot in slots for name in slot.names))
        except BaseException:
            undo()
            raise


def prepare(
    model: Any, checkpoint: PathLike | bool | None, progress: bool | None, strict: bool = True
) -> ModelLoad | _NoCheckpoint:
    """What ``fxsplit``/``apply`` load once planned: the checked checkpoint, or nothing (None, False).
    ``strict=False``: see :func:`fxsplit.fxsplit`.

    Raises:
        CheckpointError: the checkpoint is not there or does not fit the model.
    """
    if checkpoint is None or not isinstance(model, torch.nn.Module):
        return _NoCheckpoint()  # not a module: the caller's own check says so
    if checkpoint is False:
        return _NoCheckpoint(model)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint must be a path to a file or directory (got {type(checkpoint).__name__})")
    if not isinstance(strict, bool):
        raise SpecError(f"strict must be True or False (got {strict!r})")
    return ModelLoad(model, checkpoint, progress, strict)


def load_checkpoint(
    split: torch.nn.Module, checkpoint: PathLike, *, progress: bool | None = None, strict: bool = True
) -> None:
    """Load ``checkpoint`` into a split, each tensor straight onto the device its plan chose.

    ``split`` is what :func:`fxsplit.fxsplit` or :func:`fxsplit.apply` returned
    (a split ``GraphModule`` or a :class:`~fxsplit.Pipeline`), with real or
    ``meta`` weights (``checkpoint=False`` makes one from a meta model).
    Tensors the split holds for real keep their objects and get the loaded
    data; tensors on ``meta`` are replaced by loaded ones wherever the split
    holds them. The model the split was made from shares the replaced
    tensors only where the split shares its modules (modules an fx split
    calls); pass ``checkpoint=`` to ``fxsplit``/``apply`` to load model and
    split together.

    Args:
        split: the split to fill.
        checkpoint: a safetensors or ``torch.save`` file, an index ``.json``,
            or a directory written by ``save_pretrained`` (sharded or not).
        progress: draw a progress bar on stderr: None (default) when stderr is
            a terminal, True always, False never.
        strict: False: skip the checkpoint's tensors the split does not hold, and keep the values of its real
            tensors the checkpoint lacks (both listed in a warning); its meta ones need the model to be
            initialized: load with ``fxsplit.fxsplit(..., checkpoint=..., strict=False)`` instead.

    Raises:
        CheckpointError: the checkpoint does not fit the split (every problem
            listed, each with its file); nothing was loaded.
    """
    meta = getattr(split, "meta", None)
    meta = meta if isinstance(meta, dict) else {}
    plan = meta.get("fxsplit_plan")
    if not isinstance(plan, Plan):
        raise CheckpointError(
            f"load_checkpoint needs a split made by fxsplit.fxsplit or fxsplit.apply (got a "
            f"{type(split).__name__} without meta['fxsplit_plan'])"
        )
    stages = getattr(split, "stages", None)  # a Pipeline holds its weights in its stages
    holders = list(stages) if isinstance(stages, torch.nn.ModuleList) else [split]
    # the model's non-persistent buffers, and the split's own (constants the trace made: remember_non_persistent)
    kept_out = frozenset(meta.get(NON_PERSISTENT) or ()).union(*(non_persistent_names(h) for h in holders))
    gaps = meta.get(GAPS) or Gaps()
    slots = gaps.mark(with_tied(slots_of(holders, kept_out), plan.tied))
    names = {name for slot in slots for name in slot.names} | set(plan.tensors)
    table = model_names(read_table(checkpoint), meta.get(CONVERSIONS), names)
    try:
        known = [*plan.tensors, *(name for name in table.entries if gaps.may_hold(name))]
        found = match(slots, table, also_known=known, strict=strict)
        missing, skipped = unmatched(slots, table, also_known=known)
        check_initializable(None, [slot for slot in missing if slot.tensor.device.type == "meta"], [])
        kept = meta.get(KEPT_DTYPES) or {}  # (the model's: remember_non_persistent)
        _load(found, table, plan, holders, progress, kept)  # nothing fails after the commit: no undo needed
    finally:
        table.close()
    warn_loose(str(table.path), skipped, missing, {})


def _load(
    found: list[Match],
    table: TableOfContents,
    plan: Plan,
    holders: list[torch.nn.Module],
    progress: bool | None,
    kept: Mapping[str, torch.dtype],
) -> Callable[[], None]:
    """Read every matched tensor onto its device (or into its offload storage), then commit; return the undo.
    ``kept``: the tensors the model keeps at a dtype of its own (:func:`~fxsplit.cost.keptdtype.kept_dtypes`)."""
    refuse_tied_conflicts(found, table)
    homes = [_home(m.slot, plan) for m in found]
    bar = Progress("loading checkpoint", items=len(found), nbytes=sum(m.entry.nbytes for m in found), enabled=progress)
    try:
        loaded: dict[int, torch.Tensor] = {}
        for index, (item, home) in enumerate(zip(found, homes, strict=True)):
            if home != "disk":
                device = torch.device("cpu" if home == "host" else home)
                tensor = _read(item, table, device, _dtype(item.slot, plan, kept), bar)
                loaded[index] = tensor.pin_memory() if home == "host" and torch.cuda.is_available() else tensor
        to_disk = [i for i, home in enumerate(homes) if home == "disk"]
        if to_disk:
            loaded.update(_onto_disk([found[i] for i in to_disk], to_disk, table, plan, bar, kept))
    finally:
        bar.close()
    return _commit(found, [loaded[i] for i in range(len(found))], holders)


def _home(slot: Slot, plan: Plan) -> str:
    """Where ``slot`` goes: its planned device, or ``"host"``/``"disk"`` for a weight stored off the devices."""
    for name in slot.names:
        if name in plan.streamed:
            return plan.streamed[name]
    for name in slot.names:
        if name in plan.param_devices:
            return plan.param_devices[name]
    if slot.tensor.device.type != "meta":
        return str(slot.tensor.device)
    raise CheckpointError(
        f"the plan does not place '{slot.names[0]}'; was it made for this model? (fxsplit.check_plan says what differs)"
    )


def _onto_disk(
    found: list[Match],
    indices: list[int],
    table: TableOfContents,
    plan: Plan,
    bar: Progress,
    kept: Mapping[str, torch.dtype],
) -> dict[int, torch.Tensor]:
    """Tensors the plan stores on disk, as views of a file: the checkpoint's own where it is safetensors.

    A safetensors tensor already in the planned dtype is used where it lies
    (a view of the checkpoint's mapped file: no copy, no new file; the
    checkpoint must then stay in place while the split is used). The others
    are converted one at a time into a new file in the plan's offload dir.
    """
    views: dict[int, torch.Tensor] = {}
    rewrite: dict[str, tuple[int, Match]] = {}
    for index, item in zip(indices, found, strict=True):
        dtype = _dtype(item.slot, plan, kept)
        if table.mappable(item.entry.name) and item.entry.dtype == dtype:
            views[index] = table.keep(item.entry.name)
            bar.advance(item.entry.nbytes)
        else:
            rewrite[item.entry.name] = (index, item)
    if rewrite:
        layout = {name: (item.entry.shape, _dtype(item.slot, plan, kept)) for name, (_, item) in rewrite.items()}

        def read(name: str) -> torch.Tensor:
            bar.advance(rewrite[name][1].entry.nbytes)
            return table.read(name)

        written = store_on_disk(plan.offload.get("dir") or ".", plan.fingerprint or "model", layout, read)
        views.update({index: written[name] for name, (index, _) in rewrite.items()})
    return views


def _dtype(slot: Slot, plan: Plan, kept: Mapping[str, torch.dtype]) -> torch.dtype:
    """The dtype ``slot`` loads at: the plan's for a floating tensor, but the one the model keeps it at."""
    if plan.dtype and slot.tensor.dtype.is_floating_point:
        for name in slot.names:
            if name in kept:
                return kept[name]
        planned: torch.dtype = getattr(torch, plan.dtype)
        return planned
    return slot.tensor.dtype


def _read(
    found: Match, table: TableOfContents, device: torch.device, dtype: torch.dtype, bar: Progress
) -> torch.Tensor:
    """One tensor from its mapped file into new memory on ``device`` as ``dtype``: one copy."""
    source = table.read(found.entry.name)
    loaded = torch.empty(found.entry.shape, dtype=dtype, device=device)
    with torch.no_grad():
        loaded.copy_(source)
    del source
    bar.advance(found.entry.nbytes)
    return loaded


def _commit(found: list[Match], loaded: list[torch.Tensor], holders: list[torch.nn.Module]) -> Callable[[], None]:
    """Give every slot its loaded tensor: in place for real tensors, by replacement for meta ones.

    Returns a function that puts everything back (the old data, the meta tensors).
    """
    replacements: dict[int, torch.Tensor] = {}
    originals: dict[int, torch.Tensor] = {}
    previous: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    for item, tensor in zip(found, loaded, strict=True):
        old = item.slot.tensor
        if old.device.type == "meta":
            new = tensor_like(old, tensor)
            replacements[id(old)], originals[id(new)] = new, old
            continue
        previous.append((old, old.data, old.grad))
        with torch.no_grad():
            old.data = tensor
            if old.grad is not None and old.grad.device != tensor.device:
                old.grad = old.grad.to(tensor.device)
    replace_held(holders, replacements)

    def undo() -> None:
        replace_held(holders, originals)
        with torch.no_grad():
            for tensor, data, grad in previous:
                tensor.data = data
                tensor.grad = grad

    return undo
