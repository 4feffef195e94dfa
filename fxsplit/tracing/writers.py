"""Which ops of a graph write an input in place: :func:`~fxsplit.tracing.graphinfo.mutated_inputs`, asked only
of the ops that can.

Almost no op writes its inputs, and whether one can is mostly a fact of its
target (``torch.relu`` never does; ``add_`` always may; ``F.relu`` only given
``inplace=True``). :func:`writing_ops` decides that once per target and asks
:func:`mutated_inputs` only where the target, the arguments or the module say
it may: the same answer as asking every op, without the per-op checks on
graphs of 100k ops.
"""

from __future__ import annotations

import operator
from typing import Mapping, Sequence

import torch
import torch.fx

from fxsplit.tracing.customgrad import kept_function
from fxsplit.tracing.graphinfo import (
    _inplace_flag,
    _inplace_position,
    _is_inplace_name,
    _is_stat,
    _schema_writes,
    mutated_inputs,
)
from fxsplit.tracing.keptcheckpoint import is_kept_checkpoint

__all__ = ["writing_ops"]

_ALWAYS, _NEVER = -1, 1 << 30  # ask when ``len(args) > bar``; _NEVER with ``kwargs_ask`` False: never ask


def writing_ops(
    ops: Sequence[torch.fx.Node], modules: Mapping[str, torch.nn.Module]
) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """``{op: mutated_inputs(op, modules)}`` for each op of ``ops`` that writes an input in place."""
    rules: dict[tuple[str, object], tuple[int, bool]] = {}
    found: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in ops:
        op = node.op
        kwargs = node.kwargs
        if op == "call_module":
            ask = kwargs.get("out") is not None or _inplace_flag(modules.get(str(node.target)))
        else:
            key = (op, node.target)
            try:
                rule = rules.get(key)
            except TypeError:  # an unhashable target: ask
                rule = (_ALWAYS, True)
            if rule is None:
                rule = rules[key] = _rule(op, node.target)
            bar, kwargs_ask = rule
            ask = len(node.args) > bar or (
                kwargs_ask and bool(kwargs) and (kwargs.get("out") is not None or kwargs.get("inplace") is True)
            )
        if ask and (targets := mutated_inputs(node, modules)):
            found[node] = targets
    return found


def _rule(op: str, target: object) -> tuple[int, bool]:
    """``(bar, kwargs_ask)``: ask :func:`mutated_inputs` of an op with this target when it has more than ``bar``
    positional arguments, or (``kwargs_ask``) an ``out=`` or ``inplace=True`` keyword argument."""
    if op == "call_function":
        if isinstance(target, torch._ops.HigherOrderOperator):
            return _ALWAYS, True
        if isinstance(target, torch._ops.OpOverload):  # the schema says what it writes, whatever the arguments
            positions, stat = _schema_writes(target)
            return (_ALWAYS, True) if positions or stat else (_NEVER, False)
        name = getattr(target, "__name__", "")
        if (
            _is_inplace_name(name)
            or target is operator.setitem
            or _is_stat(name)
            or kept_function(target)
            or is_kept_checkpoint(target)
        ):
            return _ALWAYS, True  # (a kept custom Function's call says in its node's meta whether it wrote)
        try:
            position = _inplace_position(target)  # type: ignore[arg-type]
        except TypeError:  # an unhashable callable
            return _ALWAYS, True
        return (_NEVER if position is None else position), True
    if op == "call_method":
        if isinstance(target, str) and (_is_inplace_name(target) or target == "__setitem__"):
            return _ALWAYS, True
        return _NEVER, True
    return _NEVER, False  # placeholder, get_attr, output: read, never write
