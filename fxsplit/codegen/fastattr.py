"""Attribute lookups at dictionary speed for the modules fxsplit builds.

Generated code reads weights by path (``getattr(self.blocks, "0").fc.weight``).
Each step is ``nn.Module.__getattr__``: a failed normal lookup, then a Python
function searching three registries, about 0.7-0.9 us. A ``torch.export``
graph reads every parameter this way on every call, so a 48-layer MLP spent
5% of its forward walking paths.

The fix keeps every registry entry (parameter, buffer, submodule) *also* in
the module's instance ``__dict__``, where Python finds it without calling
``__getattr__``. The copy cannot go stale: the registries themselves are
:class:`MirroredRegistry` dictionaries, which write every change (set, delete,
pop, update, clear) through to ``__dict__``. So whatever replaces a weight
(``setattr``, ``load_state_dict(assign=True)``, ``module.to()`` that creates
new parameters, ``torch.func.functional_call``, parametrizations) is seen by
the next lookup, exactly as with a plain module.

Only modules fxsplit made get this: the split ``GraphModule`` itself and the
plain ``nn.Module`` containers it holds weights in. The user's own modules
(leaf modules an fx split calls) are left as they are.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["Container", "MirroredRegistry", "mirror_registries"]

_REGISTRIES = ("_parameters", "_buffers", "_modules")
_MISSING = object()


class MirroredRegistry(dict):  # type: ignore[type-arg]
    """A module registry (name -> tensor or module) that keeps ``view`` (the module's ``__dict__``) in step."""

    def __init__(self, items: Iterable[tuple[str, Any]] = (), view: dict[str, Any] | None = None) -> None:
        super().__init__(items)
        self._view = view
        if view is not None:
            view.update(self)

    def _mirror(self) -> dict[str, Any] | None:
        # getattr: while unpickling, items arrive before the attribute does (the module's own
        # pickled __dict__ already holds the same entries then).
        return getattr(self, "_view", None)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        view = self._mirror()
        if view is not None:
            view[key] = value

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        view = self._mirror()
        if view is not None:
            view.pop(key, None)

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        if default is _MISSING:
            value = super().pop(key)
        else:
            value = super().pop(key, default)
        view = self._mirror()
        if view is not None:
            view.pop(key, None)
        return value

    def popitem(self) -> tuple[str, Any]:
        key, value = super().popitem()
        view = self._mirror()
        if view is not None:
            view.pop(key, None)
        return key, value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def clear(self) -> None:
        view = self._mirror()
        if view is not None:
            for key in self:
                view.pop(key, None)
        super().clear()

    def __ior__(self, other: Any) -> MirroredRegistry:  # type: ignore[override,misc]
        self.update(other)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled and copied as a plain dict: the view is the owner's live __dict__, which a copy
        # must not share (and which may hold what cannot be pickled, like a GraphModule's graph).
        # A Container re-mirrors itself on load; a copied GraphModule is rebuilt by torch anyway.
        return (dict, (dict(self),))


class Container(torch.nn.Module):
    """The plain module that holds a split's weights by path, with mirrored registries.

    Pickling and ``copy.deepcopy`` store plain registries without the mirrored
    entries and rebuild the mirror on load, so a copy never shares or keeps a
    stale view. Prints as ``Module``, like the container it replaces.
    """

    def _get_name(self) -> str:
        return "Module"

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()  # type: ignore[misc]
        for registry in _REGISTRIES:
            entries = state.get(registry)
            if isinstance(entries, MirroredRegistry):
                state[registry] = dict(entries)
                for name, value in entries.items():
                    if name in state and state[name] is value:
                        del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        _mirror(self)


def mirror_registries(root: torch.nn.Module) -> None:
    """Give ``root`` and the plain ``nn.Module`` containers under it mirrored registries.

    The containers become :class:`Container` (same state, class swapped in
    place). Idempotent. Modules of any other class (the user's) are not changed.
    """
    for module in root.modules():
        if module is not root and type(module) not in (torch.nn.Module, Container):
            continue
        if module is not root:
            module.__class__ = Container
        _mirror(module)


def _mirror(module: torch.nn.Module) -> None:
    state = module.__dict__
    for registry in _REGISTRIES:
        current = state.get(registry)
        if current is None or (isinstance(current, MirroredRegistry) and current._view is state):
            continue
        if any(name in state and state[name] is not value for name, value in current.items()):
            continue  # an instance attribute with a registry entry's name: leave this registry alone
        state[registry] = MirroredRegistry(current.items(), state)
