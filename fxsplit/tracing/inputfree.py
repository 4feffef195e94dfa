"""Whether a tensor a torch.fx trace computed depends on the model's inputs.

A cache that ``forward`` fills at its first call (:mod:`~fxsplit.tracing.heldstate`,
:mod:`~fxsplit.tracing.pythonstate`) and reads from the second call on is computed anew by the split at every
call. When the traced graph computed it from the model's own tensors alone (timm's LeViT and EfficientFormer-V2
keep a table of attention biases made from their parameters), each call of the split computes what the cache
holds: the same outputs, nothing to say. One computed from the inputs is what the split cannot carry.

Only torch.fx says where a value came from (an :class:`torch.fx.Proxy` holds its node); a fake tensor of
torch.export does not, and counts as made from the inputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["made_from_inputs"]


def made_from_inputs(value: Any, depth: int = 3) -> bool:
    """Whether ``value`` (a tensor, an fx proxy, or containers of them a few levels down) may depend on the
    inputs: an fx proxy whose node is reached from a placeholder, or a fake tensor (not known). A tensor torch.fx
    computed for real (a constant of the graph) does not."""
    if isinstance(value, torch.fx.Proxy):
        return _reaches_placeholder(value.node)
    if isinstance(value, FakeTensor):
        return True
    if depth == 0:
        return False
    if isinstance(value, (list, tuple)):
        return any(made_from_inputs(item, depth - 1) for item in value)
    if isinstance(value, dict):
        return any(made_from_inputs(item, depth - 1) for item in value.values())
    return False


def _reaches_placeholder(node: torch.fx.Node) -> bool:
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        found = todo.pop()
        if found.op == "placeholder":
            return True
        if found not in seen:
            seen.add(found)
            todo.extend(found.all_input_nodes)
    return False
