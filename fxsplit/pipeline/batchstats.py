"""Find what depends on the whole batch: batch normalisation in training, state updated in place, random draws.

Pipelining runs a model on micro-batches; an op that normalises with the
statistics of its batch then sees each micro-batch's statistics instead of
the full batch's, and updates running statistics once per micro-batch. Such
ops make pipelined outputs differ from the unsplit model's, and so does any
other parameter or buffer the forward updates in place (a counter, a running
mean of its own): the update runs once per micro-batch, on its rows only. An
op that draws random numbers (dropout in training) draws them per micro-batch,
in the schedule's order: the same distribution, not the unsplit model's numbers.
"""

from __future__ import annotations

import torch
import torch.fx

from fxsplit.planning.plan import Plan
from fxsplit.tracing.graphinfo import module_path

__all__ = ["batch_stat_ops", "drawing", "labelled", "random_candidates", "random_ops", "state_written"]


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


def random_ops(graph_module: torch.fx.GraphModule) -> list[str]:
    """Names of the nodes of ``graph_module`` that draw random numbers when run in its current mode: dropout in
    training with ``p > 0`` (modules, functions, torch.export's ops), and the ops torch tags as seeded
    (``rand``, ``bernoulli``, ``normal_``, ...). Random draws inside a kept custom Function or checkpoint are not
    seen.

    Example:
        >>> import torch
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
        >>> random_ops(gm), random_ops(gm.eval())
        (['_1'], [])
    """
    return drawing(random_candidates(graph_module))


def random_candidates(graph_module: torch.fx.GraphModule) -> list[tuple[str, torch.nn.Module | None]]:
    """The nodes of ``graph_module`` that may draw random numbers, found once: ``(name, module)`` for a module that
    draws in training (dropout, RReLU), ``(name, None)`` for a call that draws as it was traced (its arguments are
    fixed). :func:`drawing` says which draw in the modules' current mode, without walking the graph again."""
    modules = dict(graph_module.named_modules())
    found: list[tuple[str, torch.nn.Module | None]] = []
    for node in graph_module.graph.nodes:
        if node.op == "call_module":
            module = modules.get(str(node.target))
            if isinstance(module, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU)):
                found.append((node.name, module))
        elif node.op in ("call_function", "call_method"):
            op = _seeded(node.target)
            if op is not None and _draws(node, op):
                found.append((node.name, None))
    return found


def drawing(candidates: list[tuple[str, torch.nn.Module | None]]) -> list[str]:
    """The names of :func:`random_candidates` that draw now: calls always, modules in training (dropout with
    ``p > 0``)."""
    return [name for name, module in candidates if module is None or (module.training and _random_module(module))]


def _random_module(module: torch.nn.Module) -> bool:
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p > 0
    return isinstance(module, torch.nn.RReLU)


def _seeded(target: object) -> torch._ops.OpOverload | None:
    """The ATen op tagged as drawing random numbers that ``target`` is (an op) or names (a torch function or a
    tensor method: ``F.dropout`` is ``aten.dropout``), or None."""
    if isinstance(target, torch._ops.OpOverload):
        return target if torch.Tag.nondeterministic_seeded in target.tags else None
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    packet = getattr(torch.ops.aten, name, None) if name and not name.startswith("_") else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    tagged = [op for o in packet.overloads() if torch.Tag.nondeterministic_seeded in (op := getattr(packet, o)).tags]
    return tagged[0] if tagged else None


def _draws(node: torch.fx.Node, op: torch._ops.OpOverload) -> bool:
    """Whether ``node``, a call of the seeded ``op`` (or of the function named after it), draws as called: one with a
    dropout probability (``dropout_p``; ``p`` beside a training flag) draws when it is above 0 and the flag
    (``train``, ``training``) is not false; ``rrelu`` in training; every other one always. A value only known when
    run (a node) counts as drawing. Arguments are read by the op's schema (its positions match the functions')."""
    arguments = {a.name: a for a in op._schema.arguments}
    positions = {a.name: k for k, a in enumerate(op._schema.arguments)}

    def given(*names: str) -> object:
        for name in names:
            if name in node.kwargs:
                return node.kwargs[name]
        for name in names:
            if name in positions and positions[name] < len(node.args):
                return node.args[positions[name]]
            if name in arguments and arguments[name].has_default_value():
                return arguments[name].default_value
        return None

    flag = given("train", "training")
    if "dropout_p" in arguments or ("p" in arguments and flag is not None):
        p = given("dropout_p", "p")
        return flag is not False and not (isinstance(p, (int, float)) and p == 0)
    if "training" in arguments:  # rrelu: random slopes in training only
        return flag is not False
    return True


def labelled(graph_module: torch.fx.GraphModule, names: list[str]) -> list[str]:
    """``'node' (in 'module.path')`` for each named node of ``graph_module`` (the path left out where it is the
    node's own name or the root)."""
    if not names:
        return []
    nodes = {node.name: node for node in graph_module.graph.nodes}
    found = []
    for name in names:
        path = module_path(nodes[name]) if name in nodes else ""
        found.append(f"{name!r} (in {path!r})" if path and path.replace(".", "_") != name else repr(name))
    return found
