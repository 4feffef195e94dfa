"""Constant keyword inputs of an export trace as defaults, so a split is called as the model was.

``torch.export`` specialises the graph on non-tensor keyword inputs (``use_cache=False``) and guards that each
call passes the same value; :func:`default_constant_keywords` makes that value the default of the graph's
``forward``. Modules made from that graph that take the model's arguments (a pipeline's input binder, the first
stage of a pipeline across processes) take them the same way through :func:`calls_like`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.fx
from torch.fx.graph import CodeGen, _PyTreeCodeGen, _PyTreeInfo

__all__ = ["calls_like", "default_constant_keywords"]

_CONSTANT_TYPES = (bool, int, float, str, type(None))


class _KeywordDefaults(_PyTreeCodeGen):
    """Export's code generator, with the constant keyword inputs of the trace as defaults.

    ``torch.export`` specialises the graph on non-tensor keyword inputs
    (``use_cache=False``) and guards that each call passes the same value;
    making that value the default lets ``gm(ids)`` work like ``model(ids)``
    for the configuration it was traced in (another value still fails the guard).
    When a constant comes before a keyword input without a default, the keyword
    inputs from ``keyword_only`` on are keyword-only (``def forward(self, ids, *,
    use_cache=False, decoder_input_ids)``), as they were passed when traced.
    """

    def __init__(self, pytree_info: Any, defaults: dict[str, Any], keyword_only: str | None = None) -> None:
        super().__init__(pytree_info)
        self.defaults = defaults
        self.keyword_only = keyword_only

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, *, expanded_def: bool = False) -> str:
        names = list(self.pytree_info.orig_args)
        if names and names[0] == "self":
            free_vars.insert(0, "self")
        signature = [f"{n}={self.defaults[n]!r}" if n in self.defaults else n for n in names]
        if self.keyword_only in names:
            signature.insert(names.index(self.keyword_only), "*")
        definition = CodeGen.gen_fn_def(self, signature, maybe_return_annotation, expanded_def=expanded_def)
        if free_vars:
            definition += self.gen_var_bindings(names, free_vars, expanded_def)
        return definition


def default_constant_keywords(graph_module: torch.fx.GraphModule, kwargs: Mapping[str, Any]) -> None:
    """Give the keyword inputs that were constants (bool, int, str, None) their traced value as default."""
    codegen = graph_module.graph._codegen
    if type(codegen) is not _PyTreeCodeGen or not kwargs:
        return
    keywords = [name for name in codegen.pytree_info.orig_args if name in kwargs]
    defaults = {name: kwargs[name] for name in keywords if isinstance(kwargs[name], _CONSTANT_TYPES)}
    trailing = next((i for i in range(len(keywords), 0, -1) if keywords[i - 1] not in defaults), 0)
    keyword_only = keywords[0] if any(name in defaults for name in keywords[:trailing]) else None
    if defaults:
        graph_module.graph.set_codegen(_KeywordDefaults(codegen.pytree_info, defaults, keyword_only))
        graph_module.recompile()


def calls_like(codegen: CodeGen, info: _PyTreeInfo) -> _PyTreeCodeGen:
    """A code generator for ``info`` (a graph of other outputs) that takes the arguments as ``codegen`` does:
    with its constant keyword defaults when ``info`` has the same arguments."""
    if isinstance(codegen, _KeywordDefaults) and list(info.orig_args) == list(codegen.pytree_info.orig_args):
        return _KeywordDefaults(info, codegen.defaults, codegen.keyword_only)
    return _PyTreeCodeGen(info)
