"""One walk of a module tree: its modules by path, and its parameters and buffers by name.

torch's ``named_modules`` / ``named_parameters`` are nested generators that
cost about ten times as much as a plain loop on models of 100k modules, and
one ``fxsplit.plan()`` call needs the model's tensors in three places (the
cost model, the memory model, the fingerprint). :func:`named_tensors` walks
once per call inside :func:`one_walk` and hands the same list to each.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Mapping

import torch

from fxsplit.attrpath import attr_at

__all__ = ["ModulePaths", "forget_walk", "module_table", "named_tensors", "one_walk"]

_WALKS: ContextVar[dict[int, tuple[torch.nn.Module, list[tuple[str, torch.Tensor, bool]]]] | None] = ContextVar(
    "fxsplit_walks", default=None
)


@contextmanager
def one_walk() -> Iterator[None]:
    """Inside the block, :func:`named_tensors` walks each module once and returns the same list after.

    For a block that does not add, remove or replace the parameters and buffers of the modules it walks
    (planning reads the model; it changes nothing).
    """
    token = _WALKS.set({})
    try:
        yield
    finally:
        _WALKS.reset(token)


def forget_walk(model: torch.nn.Module) -> None:
    """Drop the walk of ``model`` that :func:`one_walk` keeps: the block replaced some of its tensors."""
    walks = _WALKS.get()
    if walks is not None:
        walks.pop(id(model), None)


def _modules(root: torch.nn.Module, remove_duplicate: bool) -> list[tuple[str, torch.nn.Module]]:
    """``list(root.named_modules(remove_duplicate=...))``: pre-order, children in registration order."""
    found = _walk(root)
    if remove_duplicate and len({id(module) for _, module in found}) < len(found):
        return _walk(root, set())  # a module under two paths: its first only
    return found


def _walk(root: torch.nn.Module, seen: set[int] | None = None) -> list[tuple[str, torch.nn.Module]]:
    """Pre-order with a stack of children iterators (no recursion limit); ``seen``: skip modules met before."""
    found: list[tuple[str, torch.nn.Module]] = [("", root)]
    if seen is not None:
        seen.add(id(root))
    stack = [("", iter(root._modules.items()))]
    while stack:
        prefix, children = stack[-1]
        for name, child in children:
            if child is None:
                continue
            if seen is not None:
                if id(child) in seen:
                    continue
                seen.add(id(child))
            path = f"{prefix}.{name}" if prefix else name
            found.append((path, child))
            if child._modules:  # go down; this level's iterator resumes after
                stack.append((path, iter(child._modules.items())))
                break
        else:
            stack.pop()
    return found


def module_table(root: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``dict(root.named_modules())`` (each module once, under its first path), from one plain walk."""
    return dict(_modules(root, remove_duplicate=True))


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """``(qualified name, tensor, is_buffer)``: what ``named_parameters`` then ``named_buffers`` yield.

    Both with ``remove_duplicate=False`` (a tied tensor under each of its
    names), in the same order, from one walk of the module tree. Inside
    :func:`one_walk`, the list made by the first call for ``model`` (do not
    change it).
    """
    walks = _WALKS.get()
    if walks is not None:
        hit = walks.get(id(model))
        if hit is not None and hit[0] is model:
            return hit[1]
    found: list[tuple[str, torch.Tensor, bool]] = []
    buffers: list[tuple[str, torch.Tensor, bool]] = []
    for prefix, module in _modules(model, remove_duplicate=False):
        for name, tensor in module._parameters.items():
            if tensor is not None:
                found.append((f"{prefix}.{name}" if prefix else name, tensor, False))
        for name, buffer in module._buffers.items():
            if buffer is not None:
                buffers.append((f"{prefix}.{name}" if prefix else name, buffer, True))
    found += buffers  # every parameter first, then every buffer, each in module order
    if walks is not None:
        walks[id(model)] = (model, found)
    return found


class ModulePaths(Mapping[str, torch.nn.Module]):
    """The submodules of ``root`` by dotted path, each found when first asked (through ``_modules``, part by part)
    and remembered: for a caller that asks for some paths (a graph's ``call_module`` targets) rather than
    walking every module of the tree. Iterating walks the tree (:func:`module_table`)."""

    def __init__(self, root: torch.nn.Module) -> None:
        self._root = root
        self._found: dict[str, torch.nn.Module] = {"": root}

    def __getitem__(self, path: str) -> torch.nn.Module:
        found = self._found.get(path)
        if found is None:
            found = self._root
            for part in path.split("."):
                found = found._modules.get(part)
                if found is None:
                    raise KeyError(path)
            self._found[path] = found
        return found

    def get(self, path: str, default: object = None) -> torch.nn.Module | None:  # type: ignore[override]
        found = self._found.get(path)
        if found is not None:
            return found
        try:
            return self[path]
        except KeyError:
            return default  # type: ignore[return-value]

    def attribute(self, path: str) -> object:
        """``attr_at(root, path)``: a parameter or buffer straight from its module's own tables (a third of
        the time of ``getattr`` part by part, per ``get_attr`` node of a 100k-op graph); anything else through
        :func:`~fxsplit.attrpath.attr_at`, with its error for a missing part."""
        owner_path, _, name = path.rpartition(".")
        owner = self.get(owner_path)
        if owner is not None:
            found: torch.Tensor | None = owner._parameters.get(name)
            if found is None:
                found = owner._buffers.get(name)
            if found is not None:
                return found
        return attr_at(self._root, path)

    def __iter__(self) -> Iterator[str]:
        return iter(module_table(self._root))

    def __len__(self) -> int:
        return len(module_table(self._root))
