"""torch.fx's tracer as fxsplit runs it: the user's leaf modules kept whole, buffers traced, and the forward
that ``model(...)`` runs, or a refusal.

torch.fx traces ``type(model).forward``, the class's method, whatever ``model(...)`` runs. Two models run
something else, and their splits computed the class's ``forward`` alone, silently:

* a ``forward`` set on the instance (``model.forward = ...``: Accelerate's hooks and its ``prepare`` with mixed
  precision do it, and so does code that wraps it in a decorator): ``self.b(torch.relu(self.a(x))) * 3`` set on
  the instance was traced as the class's ``self.b(self.a(x))``;
* a class that defines ``__call__`` (``return super().__call__(x * 2) + 1``): the scaling and the ``+ 1`` were
  left out.

torch.export calls the model as it is called, so :meth:`LeafTracer.trace` refuses such a root and says so. A
submodule is called through ``Module.__call__`` under torch.fx too, so its own ``forward`` or ``__call__`` runs
as it would.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.fx

from fxsplit.errors import TraceError

__all__ = ["LeafTracer", "instance_forward"]


class LeafTracer(torch.fx.Tracer):
    # Buffers read in forward become graph nodes, so ``self.buf.mul_(m).add_(x)`` is traced, not run on
    # the model's buffer while tracing (torch.fx's default) and left out of the graph.
    proxy_buffer_attributes = True

    def __init__(self, leaf_types: tuple[type, ...], leaf_names: frozenset[str]) -> None:
        super().__init__()
        self._leaf_types = leaf_types
        self._leaf_names = leaf_names

    @classmethod
    def of(cls, leaves: Iterable[type | str]) -> LeafTracer:
        leaves = list(leaves)
        return cls(tuple(x for x in leaves if isinstance(x, type)), frozenset(x for x in leaves if isinstance(x, str)))

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self._leaf_names or (self._leaf_types and isinstance(m, self._leaf_types)):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> torch.fx.Graph:
        if isinstance(root, torch.nn.Module) and (runs := _runs_more(root)) is not None:
            what, fix = runs
            raise TraceError(
                f"model(...) does not run {type(root).__name__}.forward alone: {what}. torch.fx traces the class's "
                "forward, so the split would compute that, not what model(...) runs. Trace with torch.export, which "
                f"calls the model as it is called (example_inputs=(...), trace='export' or 'auto'); or {fix}"
            )
        return super().trace(root, concrete_args)


def _runs_more(model: torch.nn.Module) -> tuple[str, str] | None:
    """What ``model(...)`` runs besides its class's ``forward``, and how to make it run that alone (else None)."""
    own = instance_forward(model)
    if own is not None:
        return (
            f"its forward is set on the instance ({_describe(own)})",
            "if the class's forward is the one to split, remove the instance's (del model.forward; for Accelerate's "
            "hooks, accelerate.hooks.remove_hook_from_module(model))",
        )
    call = type(model).__call__
    if call is not torch.nn.Module.__call__ and not isinstance(model, torch.fx.GraphModule):
        owner = next(kind for kind in type(model).__mro__ if "__call__" in vars(kind))
        return (
            f"{owner.__name__} defines __call__ ({_describe(call)}), which runs around it",
            "move what __call__ adds into forward",
        )
    return None


def instance_forward(model: torch.nn.Module) -> Callable[..., Any] | None:
    """The ``forward`` set on ``model`` itself, when it is not its class's method bound to it (else None)."""
    own = vars(model).get("forward")
    if own is None:
        return None
    if getattr(own, "__self__", None) is model and getattr(own, "__func__", None) is type(model).forward:
        return None  # ``model.forward = model.forward``: the class's, bound
    return own


def _describe(forward: Callable[..., Any]) -> str:
    name = getattr(forward, "__qualname__", None) or getattr(getattr(forward, "func", None), "__qualname__", None)
    module = getattr(forward, "__module__", None) or getattr(getattr(forward, "func", None), "__module__", None)
    return f"{module}.{name}" if name and module else type(forward).__name__
