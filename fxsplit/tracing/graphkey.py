"""Whether two traces of one model computed the same graph: its code and the constants the trace made.

Tracing again under other conditions (another grad mode, autocast, random draws turned the other way) and
comparing tells whether a graph depends on them (:mod:`fxsplit.tracing.modereads`,
:mod:`fxsplit.tracing.randomdraws`). The code alone is not the graph, nor the same text for the same graph:

* a tensor made in ``forward`` (``x * torch.tensor(2.0)``, a drawn array turned into a tensor) is a constant
  the graph reads, and its values are not in the code;
* torch.fx names those constants ``_tensor_constant0``, ``_tensor_constant1``, ... on the model being traced,
  so a second trace while the first one's are still set names them from 1 on: the same graph, other text.

:class:`GraphKey` holds the code with the constants renamed in order of appearance, and their values.
"""

from __future__ import annotations

import re

import torch
import torch.fx

from fxsplit.attrpath import attr_at

__all__ = ["GraphKey"]

_FX_CONSTANT = re.compile(r"\b_tensor_constant\d+\b")


class GraphKey:
    """What two graphs of one model must share to compute the same (``==``)."""

    def __init__(self, graph_module: torch.fx.GraphModule, model: torch.nn.Module) -> None:
        ours = {id(tensor) for tensor in [*model.parameters(), *model.buffers()]}
        self.constants: list[torch.Tensor] = []
        for node in graph_module.graph.nodes:
            if node.op == "get_attr":
                value = attr_at(graph_module, str(node.target), None)
                if isinstance(value, torch.Tensor) and id(value) not in ours:
                    self.constants.append(value)
        names: dict[str, str] = {}  # fx's name -> the constant's place among them
        self.code = _FX_CONSTANT.sub(
            lambda found: names.setdefault(found.group(0), f"_tensor_constant#{len(names)}"), graph_module.code
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GraphKey):
            return NotImplemented
        return (
            self.code == other.code
            and len(self.constants) == len(other.constants)
            and all(map(_equal, self.constants, other.constants))
        )

    __hash__ = None  # type: ignore[assignment]


def _equal(one: torch.Tensor, other: torch.Tensor) -> bool:
    if one.shape != other.shape or one.dtype != other.dtype:
        return False
    if one.is_meta or other.is_meta:
        return True  # no values to compare
    return bool(torch.equal(one.detach().cpu(), other.detach().cpu()))
