"""Ops of a model cast to a dtype that take tensors of two floating dtypes where kernels need one.

A model planned at bf16 is traced with its weights at bf16, but on fake tensors,
whose kernels do not check dtypes: a model that computes ``x.float() @ w`` with
``w`` now bf16 is traced and planned, and fails when it first runs. The CPU's
kernels (measured on torch 2.13) refuse two floating dtypes in:

* matrix products, convolutions, attention's q/k/v, ``bilinear``, ``dot``,
  ``tensordot``, ``cdist``, ``grid_sample``, recurrent layers (LSTM, GRU, RNN),
  ``prelu``, ``lerp``, ``embedding_bag``, a loss's class ``weight``, and writes
  of one tensor into another (``scatter``, ``index_add``, ``index_copy``,
  ``masked_scatter``, ``put``): rule ``same``, every floating tensor the op
  takes (or the ones named) of one dtype;
* ``index_put`` (``x[idx] = y``): rule ``index``, the same, except a 0-d value
  written under a boolean mask (``x[mask] = v`` runs as ``masked_fill``);
* layer, group, batch and instance norms: rule ``norm``, their parameters and
  running statistics of one dtype, the input's, except a bf16 or fp16 input
  beside float32 parameters (the mixed precision these kernels accept).

Elementwise ops, ``cat``, ``where``, ``rms_norm`` and ``masked_fill`` promote
and run. :func:`mixed_dtype_ops` finds the refused ones in the traced graph, so
that the plan can say so before the weights are loaded.
"""

from __future__ import annotations

import operator
import os
import traceback
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence, Union

import torch
import torch.fx
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from fxsplit.eagermode import EagerDispatchMode
from fxsplit.tracing.nodesource import source_line

__all__ = [
    "INSIDE",
    "Inside",
    "InsideModules",
    "looking_inside",
    "looks_inside",
    "mixed_dtype_message",
    "mixed_dtype_ops",
]

Slots = Union[None, int, tuple[tuple[int, str], ...]]
"""Which arguments a rule reads: all of them (None), the first n, or ``(position, keyword)`` pairs."""


class _Rule(NamedTuple):
    kind: str  # "same", "index" (slots: the written tensor, its indices, the value) or "norm" (the input first)
    slots: Slots = None


_SAME = _Rule("same")
_QKV = _Rule("same", 3)
_INDEX = _Rule("index", ((0, "self"), (1, "indices"), (2, "values")))
_LOSS = _Rule("same", ((0, "input"), (2, "weight")))  # (input, target, weight): a float target may differ
_NORM_23 = _Rule("norm", ((0, "input"), (2, "weight"), (3, "bias")))  # (input, shape or groups, weight, bias)
_NORM_12 = _Rule("norm", ((0, "input"), (1, "weight"), (2, "bias")))
_NORM_1234 = _Rule("norm", ((0, "input"), (1, "weight"), (2, "bias"), (3, "running_mean"), (4, "running_var")))
_F_NORM_1234 = _Rule(  # F.batch_norm, F.instance_norm: (input, running_mean, running_var, weight, bias)
    "norm", ((0, "input"), (1, "running_mean"), (2, "running_var"), (3, "weight"), (4, "bias"))
)


def _aten(rule: _Rule, *names: str) -> dict[object, _Rule]:
    """``{aten overload: rule}`` for each ``"op.overload"`` name this torch has."""
    found: dict[object, _Rule] = {}
    for name in names:
        op, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, op, None)
        target = getattr(packet, overload or "default", None) if packet is not None else None
        if target is not None:
            found[target] = rule
    return found


_PRODUCTS = (
    "linear mm bmm addmm baddbmm matmul mv addmv einsum dot vdot tensordot bilinear cdist _cdist_forward "
    "conv1d conv2d conv3d convolution conv_transpose1d conv_transpose2d.input conv_transpose3d.input "
    "grid_sampler grid_sampler_2d grid_sampler_3d prelu _prelu_kernel lerp.Scalar lerp.Tensor lerp_.Scalar "
    "lerp_.Tensor scatter.src scatter_.src scatter_add scatter_add_ index_add index_add_ index_copy index_copy_ "
    "masked_scatter masked_scatter_ put put_ embedding_bag embedding_bag.padding_idx _embedding_bag "
    "lstm.input gru.input rnn_tanh.input rnn_relu.input lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell"
).split()
_RULES: dict[object, _Rule] = {
    **_aten(_SAME, *_PRODUCTS),
    **_aten(_QKV, "scaled_dot_product_attention"),
    **_aten(_INDEX, "index_put", "index_put_"),
    **_aten(_LOSS, "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss_nd"),
    **_aten(_NORM_23, "layer_norm", "native_layer_norm", "group_norm"),
    **_aten(_NORM_12, "native_group_norm"),
    **_aten(
        _NORM_1234,
        "batch_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit_no_training",
        "instance_norm",
    ),
    **dict.fromkeys(
        (F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d),
        _SAME,
    ),
    **dict.fromkeys((F.bilinear, F.grid_sample, F.prelu, F.embedding_bag, operator.matmul), _SAME),
    **dict.fromkeys(
        (torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.mv, torch.addmv, torch.einsum),
        _SAME,
    ),
    **dict.fromkeys((torch.dot, torch.vdot, torch.tensordot, torch.cdist, torch.bilinear, torch.prelu), _SAME),
    **dict.fromkeys(
        (torch.lerp, torch.scatter, torch.scatter_add, torch.index_add, torch.index_copy, torch.masked_scatter),
        _SAME,
    ),
    F.scaled_dot_product_attention: _QKV,
    torch.index_put: _INDEX,
    operator.setitem: _INDEX,
    **dict.fromkeys((F.cross_entropy, F.nll_loss), _LOSS),
    **dict.fromkeys((F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm), _NORM_23),
    **dict.fromkeys((torch.batch_norm, torch.instance_norm), _NORM_1234),
    **dict.fromkeys((F.batch_norm, F.instance_norm), _F_NORM_1234),
}
_METHODS: dict[str, _Rule] = {
    **dict.fromkeys(
        "matmul mm bmm __matmul__ __rmatmul__ dot vdot lerp lerp_ scatter scatter_ scatter_add scatter_add_ "
        "index_add index_add_ index_copy index_copy_ masked_scatter masked_scatter_ put put_ prelu".split(),
        _SAME,
    ),
    **dict.fromkeys(("index_put", "index_put_", "__setitem__"), _INDEX),
}
_NORMS = (
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
)
_FIRST_ARGUMENT = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)  # the input and the module's own weights
_ALL_ARGUMENTS = (  # every tensor argument and every weight of the module
    torch.nn.modules.rnn.RNNBase,
    torch.nn.modules.rnn.RNNCellBase,
    torch.nn.PReLU,
    torch.nn.Bilinear,
    torch.nn.EmbeddingBag,
    torch.nn.MultiheadAttention,
)
_LOW = (torch.bfloat16, torch.float16)
_LIBRARIES = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))  # torch's, fxsplit's


def mixed_dtype_ops(graph_module: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, list[str]]]:
    """Each op of the graph that needs one floating dtype and takes two or more, with those dtypes' names; a
    module the graph calls as one op (a leaf) counts when an op inside it does (:class:`InsideModules`)."""
    found = []
    for node in graph_module.graph.nodes:
        dtypes = _refused_dtypes(node, graph_module)
        if not dtypes and node.op == "call_module":
            dtypes = sorted({d for inside in node.meta.get(INSIDE, ()) for d in inside.dtypes}, key=str)
        if dtypes:
            found.append((node, sorted({str(d).removeprefix("torch.") for d in dtypes})))
    return found


def mixed_dtype_message(found: list[tuple[torch.fx.Node, list[str]]], dtype: str) -> str:
    """The warning for :func:`mixed_dtype_ops`'s ops of the model at ``dtype``."""
    named = "; ".join(f"'{node.name}' takes {' and '.join(dtypes)}{_where(node)}" for node, dtypes in found[:3])
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return (
        f"the model at {dtype} mixes floating dtypes where kernels need one: {named}{more}; traced on fake tensors, "
        f"which do not check this, it was planned, but it will fail there when it runs at {dtype}: give those ops "
        "inputs of one dtype (cast the other tensor, or keep that part of the model at its dtype)"
    )


INSIDE = "fxsplit_mixed_inside"
"""``node.meta`` key of a ``call_module`` node: the :class:`Inside` ops of its module that refuse their dtypes."""


class Inside(NamedTuple):
    """An op inside a module called as one op that takes floating dtypes its kernel refuses together."""

    op: str  # the aten op, "aten.mm.default"
    dtypes: tuple[torch.dtype, ...]
    at: str  # '"file", line n, in function: code': the innermost frame outside torch and fxsplit, or ""


class InsideModules(EagerDispatchMode):
    """While active (under the fake mode of a shape propagation), the ops a module runs that refuse their
    floating dtypes together, by the same rules as the graph's ops: a module the trace keeps whole (a leaf)
    hides its ops from the graph. ``found`` holds them, in order. Higher-order ops (flex_attention, cond) are
    passed on as they are, their bodies unseen."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[Inside] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            rule = _RULES.get(func)
        except TypeError:
            rule = None
        if rule is not None:
            dtypes = _verdict(rule, _selected(args, kwargs, rule.slots), _tensors)
            if dtypes:
                self.found.append(Inside(str(func), tuple(dtypes), _frame_outside_torch()))
        return func(*args, **kwargs)


_LOOKING: ContextVar[bool] = ContextVar("fxsplit_looking_inside", default=False)


@contextmanager
def looking_inside(wanted: bool = True) -> Iterator[None]:
    """Inside the block (when ``wanted``: a model planned at a dtype), shape propagations look inside the modules
    :func:`looks_inside` names. Not otherwise: only a cast model meets dtypes it did not choose, and a module run
    under the mode runs its compiled code uncompiled (:mod:`fxsplit.eagermode`)."""
    token = _LOOKING.set(wanted)
    try:
        yield
    finally:
        _LOOKING.reset(token)


def looks_inside(module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` needs :class:`InsideModules`: inside :func:`looking_inside`, not one
    :func:`mixed_dtype_ops` rules on as a whole, nor one of torch.nn's own that holds no tensor and no submodule
    (activations, pooling, dropout: they compute from their inputs alone, elementwise or one tensor at a time)."""
    if not _LOOKING.get() or _module_rule(module) is not None:
        return False
    plain = type(module).__module__.startswith("torch.nn.")
    return not plain or bool(module._parameters or module._buffers or module._modules)


def _module_rule(owner: torch.nn.Module) -> tuple[_Rule, list[torch.Tensor]] | None:
    """The rule of a call of ``owner`` and the module's own tensors it reads, or None (no rule)."""
    if isinstance(owner, _NORMS):
        return _Rule("norm", 1), [*owner.parameters(recurse=False), *owner.buffers(recurse=False)]
    if isinstance(owner, _FIRST_ARGUMENT):
        return _Rule("same", 1), list(owner.parameters(recurse=False))
    if isinstance(owner, _ALL_ARGUMENTS):
        return _SAME, list(owner.parameters())
    return None


def _refused_dtypes(node: torch.fx.Node, graph_module: torch.fx.GraphModule) -> list[torch.dtype]:
    """The floating dtypes ``node`` takes where its kernel refuses them together; [] when it runs."""
    weights: list[torch.Tensor] = []
    if node.op == "call_function":
        try:
            rule = _RULES.get(node.target)
        except TypeError:  # an unhashable target
            return []
    elif node.op == "call_method" and isinstance(node.target, str):
        rule = _METHODS.get(node.target)
    elif node.op == "call_module":
        ruled = _module_rule(graph_module.get_submodule(str(node.target)))
        if ruled is None:
            return []
        rule, weights = ruled
    else:
        return []
    if rule is None:
        return []
    return _verdict(rule, _selected(node.args, node.kwargs, rule.slots), _values, weights)


def _verdict(
    rule: _Rule, selected: list[Any], leaves: Callable[[Any], list[Any]], weights: Sequence[torch.Tensor] = ()
) -> list[torch.dtype]:
    """The floating dtypes an op under ``rule`` refuses together, of its ``selected`` arguments (one entry per
    slot, ``leaves`` of each: the tensors in it) and a module's own ``weights``; [] when it runs."""
    groups = [_floating(leaves(argument)) for argument in selected]
    if rule.kind == "norm":
        given = groups[0] if groups else []
        params = [*(t for group in groups[1:] for t in group), *_floating(weights)]
        return _norm_refuses(given, params)
    if rule.kind == "index" and len(groups) == 3:
        indices = [v for v in leaves(selected[1]) if isinstance(v, torch.Tensor)]
        if _masked_fill(indices, groups[2]):
            return []
    dtypes = {t.dtype for group in groups for t in group} | {t.dtype for t in _floating(weights)}
    return sorted(dtypes, key=str) if len(dtypes) > 1 else []


def _selected(args: Sequence[Any], kwargs: Mapping[str, Any], slots: Slots) -> list[Any]:
    """The arguments ``slots`` names, one entry per slot (all arguments: one per argument)."""
    if slots is None:
        return [*args, *kwargs.values()]
    if isinstance(slots, int):
        return list(args[:slots])
    return [args[at] if at < len(args) else kwargs.get(keyword) for at, keyword in slots]


def _values(argument: Any) -> list[Any]:
    """The recorded values of the nodes inside ``argument`` (a node, or a list or tuple of them)."""
    return [a.meta.get("val") for a in tree_leaves(argument) if isinstance(a, torch.fx.Node)]


def _tensors(argument: Any) -> list[Any]:
    """The tensors inside ``argument`` (a tensor, or a list or tuple of them)."""
    return [a for a in tree_leaves(argument) if isinstance(a, torch.Tensor)]


def _floating(values: Iterable[Any]) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]


def _norm_refuses(given: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.dtype]:
    """A norm's input dtype and its parameters' when the kernel refuses them together; [] when it runs."""
    kinds = {t.dtype for t in params}
    if not given or not kinds:
        return []
    dtype = given[0].dtype
    if len(kinds) == 1 and (kinds == {dtype} or (dtype in _LOW and kinds == {torch.float32})):
        return []
    return sorted({dtype, *kinds}, key=str)


def _masked_fill(indices: list[torch.Tensor], value: list[torch.Tensor]) -> bool:
    """Whether an ``index_put`` writes a 0-d value under boolean masks only (a ``masked_fill``, which promotes),
    or (``x[0:2] = y``) indexes with no tensor at all (a copy)."""
    if not indices:
        return True
    return bool(value) and value[0].dim() == 0 and all(i.dtype == torch.bool for i in indices)


def _where(node: torch.fx.Node) -> str:
    """Where the user's code mixes the dtypes: the first op inside a leaf module that does (its aten op and
    line), else the node's own line."""
    inside = node.meta.get(INSIDE)
    if inside:
        first = inside[0]
        more = f"; and {len(inside) - 1} more op{'s' if len(inside) > 2 else ''}" if len(inside) > 1 else ""
        return f" inside its module ({first.op}{' at ' + first.at if first.at else ''}{more})"
    return _line(node)


def _frame_outside_torch() -> str:
    """``"file", line n, in function: code`` of the running stack's innermost frame outside torch and fxsplit
    (the module's own code), or ""."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARIES) and not frame.filename.startswith("<eval_with_key"):
            code = (frame.line or "").strip()
            return f'"{frame.filename}", line {frame.lineno}, in {frame.name}{": " + code if code else ""}'
    return ""


def _line(node: torch.fx.Node) -> str:
    """`` (at file:line: code)``: where in the model's code ``node`` was made, or ""."""
    at = source_line(node)
    return f" (at {at})" if at else ""
