"""Traced values used as dict keys by the model's code, and the outputs a torch.fx graph lost to them.

torch.fx gives each use of a traced value a new ``Proxy``. Python code that keys a dict (or a set) by one
stores under that object, and a later lookup with another use of the same value (``x.device`` asked again)
finds nothing: timm's ``FeatureHookNet`` collects its feature maps in forward hooks, in a dict keyed by
``out.device``, and returns ``self._feature_outputs[x.device]``. Traced, that dict is empty, so the graph
returned ``[]`` where the model returns three feature maps, silently.

:func:`recording_proxy_keys` notes where the model's code hashes a ``Proxy`` while fx traces it (torch.fx itself
does not). Only then :func:`refuse_lost_outputs` runs the model on fake tensors and compares the tensors it
returns with the graph's: fewer, or other shapes, is refused. Code that hashes a traced value harmlessly (a cache
keyed by its argument) costs that one fake run and nothing more.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.passes.shape_prop import TensorMetadata

from fxsplit.errors import TraceError
from fxsplit.tracing.modereads import internal_code, short_filename

__all__ = ["recording_proxy_keys", "refuse_lost_outputs"]


@contextmanager
def recording_proxy_keys() -> Iterator[dict[str, None]]:
    """Within the block, note (``"forward at model.py:12"``, in order) where code other than torch's and fxsplit's
    hashes a torch.fx ``Proxy``: uses a traced value as a dict key or set member."""
    found: dict[str, None] = {}
    original = torch.fx.Proxy.__hash__

    def noted(self: torch.fx.Proxy) -> int:
        caller = sys._getframe(1)
        filename = caller.f_code.co_filename
        if not internal_code(filename):
            name = getattr(caller.f_code, "co_qualname", caller.f_code.co_name)
            found.setdefault(f"{name} at {short_filename(filename)}:{caller.f_lineno}")
        return original(self)

    torch.fx.Proxy.__hash__ = noted  # type: ignore[method-assign,assignment]
    try:
        yield found
    finally:
        torch.fx.Proxy.__hash__ = original  # type: ignore[method-assign]


def refuse_lost_outputs(
    graph_module: torch.fx.GraphModule,
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    keyed: tuple[str, ...],
) -> None:
    """Raise a :class:`TraceError` if ``graph_module`` (traced by fx, its shapes found on the example inputs)
    returns fewer tensors than ``model`` does on them, or tensors of other shapes. ``keyed``: where the model's
    code used a traced value as a key (what :func:`recording_proxy_keys` noted). Nothing is said when the model
    cannot run on fake tensors (nothing to compare with)."""
    from fxsplit.tracing.example_inputs import outputs_on_fakes

    returned, failure = outputs_on_fakes(model, args, kwargs, no_grad=False)  # in the modes it was traced in
    if failure is not None:
        return
    expected = _shapes(returned)
    output = next((node for node in reversed(graph_module.graph.nodes) if node.op == "output"), None)
    returns = output.args[0] if output is not None and output.args else None
    got = _shapes(torch.fx.node.map_arg(returns, _value))
    if got == expected:
        return
    places = "; ".join(list(keyed)[:3]) + (f" and {len(keyed) - 3} more" if len(keyed) > 3 else "")
    raise TraceError(
        f"torch.fx's graph of the model returns {_describe(got)} where the model returns {_describe(expected)} on "
        f"the example inputs: its code uses a traced value as a dict key or set member ({places}), and torch.fx "
        "gives each use of a value a new object, so what is stored under one use is not found under the next "
        "(forward hooks collecting outputs in a dict keyed by out.device, for one). Trace with torch.export "
        "(trace='export'), which runs the code on real values, or make the module that does this a leaf module "
        "(leaf_modules=[...]), which the split calls as it is"
    )


def _value(node: torch.fx.Node) -> Any:
    meta = node.meta
    return meta["val"] if "val" in meta else meta.get("tensor_meta")


def _shapes(value: Any) -> list[tuple[int, ...]]:
    """The shapes of the tensors in ``value`` (any nesting; a shape pass's ``TensorMetadata`` counts as one)."""
    leaves = pytree.tree_leaves(value, is_leaf=lambda leaf: type(leaf) is TensorMetadata)
    return [tuple(int(d) for d in leaf.shape) for leaf in leaves if isinstance(leaf, (torch.Tensor, TensorMetadata))]


def _describe(shapes: list[tuple[int, ...]]) -> str:
    if not shapes:
        return "no tensor"
    listed = ", ".join(str(list(shape)) for shape in shapes[:4]) + (", ..." if len(shapes) > 4 else "")
    return f"{len(shapes)} tensor{'s' if len(shapes) > 1 else ''} ({listed})"
