"""Find what depends on the whole batch: batch normalisation in training, and state updated in place.

Pipelining runs a model on micro-batches; an op that normalises with the
statistics of its batch then sees each micro-batch's statistics instead of
the full batch's, and updates running statistics once per micro-batch. Such
ops make pipelined outputs differ from the unsplit model's, and so does any
other parameter or buffer the forward updates in place (a counter, a running
mean of its own): the update runs once per micro-batch, on its rows only.
"""

from __future__ import annotations

import torch
import torch.fx

from fxsplit.planning.plan import Plan

__all__ = ["batch_stat_ops", "state_written"]


def batch_stat_ops(graph_module: torch.fx.GraphModule) -> list[str]:
    """Names of the nodes of ``graph_module`` that normalise with batch statistics, in its current mode.

    Example:
        >>> import torch
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)))
        >>> batch_stat_ops(gm), batch_stat_ops(gm.eval())
        (['_1'], [])
    """
    modules = dict(graph_module.named_modules())
    found = []
    for node in graph_module.graph.nodes:
        if node.op == "call_module" and _module_uses_batch(modules.get(str(node.target))):
            found.append(node.name)
        elif node.op == "call_function" and _function_uses_batch(node):
            found.append(node.name)
    return found


_BATCH_NORM_STATE = ("running_mean", "running_var", "num_batches_tracked")


def state_written(plan: Plan) -> list[str]:
    """The parameters and buffers the forward updates in place (:attr:`Plan.mutated`), but BatchNorm's running
    statistics (:func:`batch_stat_ops` finds those by the module's mode)."""
    return sorted(name for name in plan.mutated if name.rpartition(".")[2] not in _BATCH_NORM_STATE)


def _module_uses_batch(module: torch.nn.Module | None) -> bool:
    if not isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        return False
    return module.training or module.running_mean is None


def _function_uses_batch(node: torch.fx.Node) -> bool:
    target = node.target
    if target is torch.nn.functional.batch_norm:
        training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else False)
        return training is True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if "batch_norm" not in schema.name or "no_training" in schema.name:
        return False
    for index, argument in enumerate(schema.arguments):
        if argument.name == "training":
            value = node.args[index] if index < len(node.args) else node.kwargs.get("training")
            return value is True
    return "backward" not in schema.name
