"""State the model keeps on objects its modules hold: put back after tracing, and refused when a trace stored in it.

A module may hold plain Python objects beside its parameters and buffers: a Hugging Face ``StaticCache`` whose
layers hold the key/value tensors and the state-space model's convolution and recurrent states, a helper object
carrying a running value. What ``forward`` stores there is state carried from one call to the next. A graph holds
tensor ops only: it cannot carry such state, so each call of a split makes it anew as the traced call did, where
each call of the model reads what the last one left. A Falcon-H1 wrapped for export with a static cache created
its Mamba states lazily in the traced call: the split's tokens were wrong from the first decoding step, with no
word (torch.export's own graph is as wrong), and the cache kept the trace's fake tensors afterwards.

:func:`held_state_kept` walks, before the trace, the objects the model's modules hold (attributes that are neither
parameters, buffers nor submodules, and what these hold through attributes, lists and dicts, a few levels down),
and notes their contents. When the trace ends:

* every such object is put back as it was (``fxsplit.plan`` must not change the model): the attributes and entries
  the trace set, added or removed;
* a tensor held there that the trace wrote for real (an in-place op with no traced input on a tensor the code
  reached through such an object, not through the module, runs on the real tensor: the cache's
  ``cumulative_length.add_(n)``) gets its value back when it is small enough to have been copied (up to
  ``_COPIED`` bytes), else a warning says so. torch.fx does not record such a write, so the split never repeats it:
  under torch.fx, if the graph reads that tensor, a :class:`~fxsplit.errors.TraceError` says so, else a warning
  (torch.fx also runs for real what reads it with no traced value). torch.export records such a write in its
  graph, as a write of a constant it lifts;
* if the trace replaced a tensor (or a None) there with one of its own (a fake tensor of torch.export, a proxy
  of torch.fx, or a tensor torch.fx made for real and keeps as a constant), a :class:`~fxsplit.errors.TraceError`
  names where and says what to change: the split would not carry that state from call to call as the model
  does. A list entry is state the same way when the trace read the tensor it held before replacing it
  (``self.state.history[0] = self.state.history[0] * 0.5 + y``; the reads are noted as torch calls the ops,
  :mod:`fxsplit.tracing.tensorreads`). A tensor the trace put where there was none (a list entry that held None
  or was appended, a key or attribute added) is said, not refused: a cache made at the first call, or a record,
  since there was no tensor to read. What else the trace did to a list (outputs recorded: entries replaced but
  not read, cleared) is made anew at each call: put back without a word.

Attributes of the modules themselves are :mod:`fxsplit.tracing.pythonstate`'s; caches of the model's code and
values bound in a module's ``__dict__`` without ``__setattr__`` are :mod:`fxsplit.tracing.leftovers`'.
"""

from __future__ import annotations

import types
import warnings
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from fxsplit.attrpath import attr_at
from fxsplit.callsite import user_stacklevel
from fxsplit.errors import FxsplitWarning, TraceError
from fxsplit.tracing.inputfree import made_from_inputs
from fxsplit.tracing.tensorreads import reads_noted

__all__ = ["HeldState", "held_state_kept", "held_tensors"]

_DEPTH = 4  # objects this many steps from a module are walked (module.cache.layers[i].states[k])
_MOST = 20_000  # objects walked at most: a model's held state is small; this bounds a pathological one
_COPIED = 1 << 16  # held tensors of at most these bytes are copied before the trace, to be put back if written
_MODULE_OWN = frozenset(vars(torch.nn.Module()))  # torch's own entries of a module's __dict__
_LEAF = (
    torch.nn.Module,
    torch.Tensor,
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    str,
    bytes,
)
_MISSING = object()


class _Walked:
    """The objects found, each with its path from the model and a shallow copy of its contents."""

    def __init__(self) -> None:
        self.contents: list[tuple[Any, str, Any]] = []  # (object, path, copy of its entries)
        self.tensors: list[tuple[torch.Tensor, str, int, torch.Tensor | None]] = []  # (tensor, path, version, copy)
        self.registered: set[int] = set()  # ids of the model's parameters and buffers
        self.listed: list[torch.Tensor] = []  # the tensors lists hold: state if read, then replaced


def _walkable(value: Any) -> bool:
    kind = type(value)
    if kind in (list, dict, tuple):
        return True
    if isinstance(value, _LEAF) or not hasattr(value, "__dict__") or isinstance(vars(value), types.MappingProxyType):
        return False
    home = getattr(kind, "__module__", "") or ""
    return not home.startswith(("torch", "fxsplit", "builtins", "typing", "enum", "functools", "weakref"))


def _entries(holder: Any) -> Iterator[tuple[Any, Any]]:
    if type(holder) in (list, tuple):
        return iter(enumerate(holder))
    if type(holder) is dict:
        return iter(list(holder.items()))
    return iter(list(vars(holder).items()))


def _step(path: str, holder: Any, key: Any) -> str:
    if type(holder) in (list, tuple, dict):
        return f"{path}[{key!r}]"
    return f"{path}.{key}"


def held_tensors(model: torch.nn.Module) -> list[tuple[torch.Tensor, str]]:
    """``(tensor, where)`` for the tensors held by the objects ``model``'s modules hold (not the modules' own
    attributes)."""
    return [(tensor, path) for tensor, path, _, _ in _walk(model, copied=False).tensors]


def _walk(model: torch.nn.Module, *, copied: bool = True) -> _Walked:
    walked = _Walked()
    seen: set[int] = set()
    queue: deque[tuple[Any, str, int]] = deque()
    for name, module in model.named_modules():
        for key, value in list(vars(module).items()):
            if key not in _MODULE_OWN and _walkable(value):
                queue.append((value, f"{name}.{key}" if name else key, 1))
    tensors: set[int] = set()
    if copied:
        walked.registered = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    while queue and len(seen) < _MOST:
        holder, path, depth = queue.popleft()
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        if type(holder) is not tuple:  # a tuple's entries cannot be rebound
            walked.contents.append((holder, path, _copy(holder)))
        for key, value in _entries(holder):
            where = _step(path, holder, key)
            if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and id(value) not in tensors:
                tensors.add(id(value))
                small = copied and value.device.type != "meta" and value.nbytes <= _COPIED
                walked.tensors.append((value, where, value._version, value.detach().clone() if small else None))
                if type(holder) is list:
                    walked.listed.append(value)
            elif depth < _DEPTH and _walkable(value):
                queue.append((value, where, depth + 1))
    return walked


def _copy(holder: Any) -> Any:
    if type(holder) is list:
        return list(holder)
    if type(holder) is dict:
        return dict(holder)
    return dict(vars(holder))


def _traced_tensor(value: Any, depth: int = 3) -> bool:
    """Whether ``value`` is, or holds a few levels down, a tensor (a fake tensor of torch.export, or one torch.fx
    made for real and keeps as a constant) or an fx proxy."""
    if isinstance(value, (torch.Tensor, torch.fx.Proxy)):
        return True
    if depth == 0 or not _walkable(value):
        return False
    return any(_traced_tensor(item, depth - 1) for _, item in _entries(value))


def _put_back(holder: Any, path: str, before: Any, read: set[int], filled: list[str]) -> list[str]:
    """Put ``holder``'s contents back as ``before``; the paths of the attributes and dict entries whose value (a
    tensor, or None) the trace replaced with a tensor, and of the list entries whose tensor it read (``read``:
    ids) and replaced with one: state. Where the trace put a tensor in a place that held none (a list entry that
    held None, one appended, a key or attribute added), the path is added to ``filled``: a cache made at the
    first call, or a record (there was no tensor to read, so which is not known); not when the tensor was computed
    from the model's own tensors alone (:func:`made_from_inputs`), which the split computes alike at every call.
    What else the trace did to a list (outputs recorded: replaced without being read, cleared) is made anew at each
    call: put back without a word."""
    if type(holder) is list:
        stored = []
        for index, new in enumerate(holder):
            old = before[index] if index < len(before) else _MISSING
            if new is old or not _traced_tensor(new):
                continue
            if id(old) in read and isinstance(old, torch.Tensor):
                stored.append(_step(path, holder, index))
            elif (old is None or old is _MISSING) and made_from_inputs(new):
                filled.append(_step(path, holder, index))
        if len(holder) != len(before) or any(a is not b for a, b in zip(holder, before, strict=True)):
            holder[:] = before
        return stored
    now = holder if type(holder) is dict else vars(holder)
    stored = []
    for key in set(now) | set(before):
        new, old = now.get(key, _MISSING), before.get(key, _MISSING)
        if new is old:
            continue
        if new is not _MISSING and _state(old) and _traced_tensor(new):
            stored.append(_step(path, holder, key))
        elif new is not _MISSING and old is _MISSING and _traced_tensor(new) and made_from_inputs(new):
            filled.append(_step(path, holder, key))
        if old is _MISSING:
            del now[key]
        else:
            now[key] = old
    return sorted(stored)


def _state(old: Any) -> bool:
    """Whether an entry holding ``old`` before the trace is a place for state: a tensor, or None (one to come)."""
    return old is None or isinstance(old, torch.Tensor)


class HeldState:
    """Handed to the block: the caller sets ``traced`` to ``(graph module, method)`` once it has the graph, so the
    writes the trace ran for real can be checked against what the graph reads."""

    def __init__(self) -> None:
        self.traced: tuple[torch.fx.GraphModule, str] | None = None


@contextmanager
def held_state_kept(model: torch.nn.Module) -> Iterator[HeldState]:
    """Within the block (a trace of ``model``), keep the objects ``model``'s modules hold as they were; when it
    ends, put them back, and refuse (:class:`TraceError`) if the trace stored its own tensors there or wrote for
    real a tensor there that its graph reads."""
    walked = _walk(model)
    held = HeldState()
    failed = True
    read: set[int] = set()
    try:
        with reads_noted(walked.listed) as read:
            yield held
        failed = False
    finally:
        filled: list[str] = []
        stored = [w for holder, path, before in walked.contents for w in _put_back(holder, path, before, read, filled)]
        written, unrestored = _tensors_put_back(walked)
    if unrestored:
        warnings.warn(FxsplitWarning(_unrestored_message(unrestored)), stacklevel=user_stacklevel())
    if failed:
        return
    if stored:
        raise TraceError(_stored_message(stored))
    if filled:
        warnings.warn(FxsplitWarning(_filled_message(filled)), stacklevel=user_stacklevel())
    if written and held.traced is not None and held.traced[1] == "fx":  # (torch.export records such writes)
        _untraced_writes(written, held.traced[0])


def _tensors_put_back(walked: _Walked) -> tuple[list[tuple[torch.Tensor, str]], list[str]]:
    """Give each held tensor the trace changed its value back: ``(tensor, where)`` of those changed that are no
    parameter or buffer of the model, and the paths of those too large to have been copied.

    Changed: its value differs from the copy (torch.export bumps the version counter of the buffers it traces
    without changing them); one not copied, its version moved. A parameter or buffer of the model is traced as
    one by the graph: it is put back, and not said unless it could not be."""
    written, unrestored = [], []
    for tensor, path, version, copy in walked.tensors:
        if tensor._version == version or (copy is not None and torch.equal(tensor, copy)):
            continue
        if copy is not None:
            with torch.no_grad():
                tensor.copy_(copy)
        elif id(tensor) in walked.registered:
            continue  # most likely only its version moved (above)
        else:
            unrestored.append(path)
        if id(tensor) not in walked.registered:
            written.append((tensor, path))
    return written, unrestored


def _untraced_writes(written: list[tuple[torch.Tensor, str]], graph_module: torch.fx.GraphModule) -> None:
    """Refuse the held tensors a torch.fx trace wrote for real (so its graph does not write them) that the graph
    reads; say the others (torch.fx also runs for real what reads them with no traced value)."""
    reads = {
        _memory(value)
        for node in graph_module.graph.find_nodes(op="get_attr")
        if isinstance(value := attr_at(graph_module, str(node.target)), torch.Tensor)
    }
    read = [path for tensor, path in written if _memory(tensor) in reads]
    if read:
        raise TraceError(
            _written_message(read, "and the graph reads them: the split would read the values they had when traced")
        )
    paths = [path for _, path in written]
    then = "if forward reads them (torch.fx runs for real what reads them with no traced value), the split "
    message = _written_message(paths, then + "computes with the values they had when traced")
    warnings.warn(FxsplitWarning(message), stacklevel=user_stacklevel())


def _memory(tensor: torch.Tensor) -> tuple[str, int]:
    if tensor.device.type == "meta" or isinstance(tensor, FakeTensor):
        return str(tensor.device), id(tensor)
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def _written_message(paths: list[str], then: str) -> str:
    return (
        f"forward writes {_listed(paths)} in place, tensors the model holds outside its modules, with ops torch "
        "does not trace (an in-place op on a tensor reached through a plain object, with no traced input, runs for "
        f"real while tracing; it was put back): the split does not repeat these writes, {then}, where each call of "
        "the model reads what its last call left. Register them as buffers (self.register_buffer(...)), whose "
        "writes torch traces"
    )


def _listed(paths: list[str]) -> str:
    more = f" and {len(paths) - 4} more" if len(paths) > 4 else ""
    return ", ".join(paths[:4]) + more


def _filled_message(filled: list[str]) -> str:
    return (
        f"forward() puts tensors it computes where the objects the model holds outside its modules held none: "
        f"{_listed(sorted(set(filled)))} (put back as they were: None, or not there). "
        "If forward reads them at a later call (a cache filled at the first call), the split does not: a graph "
        "holds tensor ops only, so each call of the split computes them anew as the traced call did, and its "
        "outputs differ from the model's from the second call on. Make such a cache before tracing, as buffers "
        "that forward updates in place (self.register_buffer('cache', torch.zeros(...)); self.cache.copy_(new)); "
        "a record that forward never reads is safe to ignore, and is not filled by the split"
    )


def _stored_message(stored: list[str]) -> str:
    return (
        f"forward() stores tensors it computes on objects the model holds outside its modules: {_listed(stored)}. "
        "That is state carried from one call to the next (a cache made at the first call, a running value), and a "
        "graph holds tensor ops only: each call of a split would start it anew as the traced call did, where each "
        "call of the model reads what the last one left, so the split's outputs would differ from the model's. "
        "These objects are put back as they were. Make the state before tracing and register it as buffers that "
        "forward updates in place (self.register_buffer('state', torch.zeros(...)); self.state.copy_(new)). A cache "
        "that the first call makes (a Hugging Face static cache's Mamba and other layers that "
        "TorchExportableModuleWithStaticCache does not make beforehand): call the model once on the example "
        "inputs, under torch.no_grad(), before planning; the cache is then made for real, and the split keeps it "
        "as state it writes in place"
    )


def _unrestored_message(paths: list[str]) -> str:
    return (
        f"tracing wrote, for real, to tensors the model holds outside its modules: {_listed(paths)} (an in-place "
        "op on a tensor the code reaches through a plain object, not through the module, runs on the tensor itself "
        f"while torch traces); they are larger than the {_COPIED} bytes fxsplit copies beforehand, so their values "
        "could not be put back: reset them before using the model (register them as buffers to avoid this)"
    )
