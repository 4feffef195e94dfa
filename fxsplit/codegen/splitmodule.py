"""The class a split is built as: what a plain ``GraphModule`` would get wrong for some traced graphs.

* :class:`ExportedSplit`: a ``torch.export`` graph fixed its train/eval mode
  when traced; switching it raises instead of changing nothing, and its
  input check (:class:`InputGuard`) says how to split for other inputs.
* :class:`GradModeSafeSplit`: code that sets the grad mode puts the caller's
  mode back even when an op inside the region raises.
* :class:`ModeReadSplit`: a ``torch.fx`` trace read some modules' ``training``
  flag (:mod:`fxsplit.tracing.trainingreads`), which fixed what they do; switching
  the split to another mode raises instead of changing nothing there.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
import torch.fx

from fxsplit.codegen.meta import kept_on_copy
from fxsplit.codegen.splitbase import Split
from fxsplit.errors import FxsplitError, InputMismatchError
from fxsplit.planning.plan import Plan
from fxsplit.tracing.dynamic import TRACED_INPUTS, describe_inputs
from fxsplit.tracing.gradmode import autocast_devices, is_mode_node, modes_kept
from fxsplit.tracing.modereads import MODE_READS, ModeRead, check_modes
from fxsplit.tracing.trainingreads import TRAINING_READS

__all__ = [
    "ExportedSplit",
    "GradModeSafeSplit",
    "InputGuard",
    "ModeReadGradModeSafeSplit",
    "ModeReadSplit",
    "split_module",
]


class ExportedSplit(Split):
    """A split of a ``torch.export`` graph, whose train/eval behaviour was fixed when it was traced.

    ``torch.export`` bakes the mode into the graph (dropout on or off, batch
    norm using batch or running statistics). Switching the mode of a graph
    that has such ops would silently change nothing, so it raises instead.
    """

    traced_training: bool = False
    mode_ops: tuple[str, ...] = ()
    mode_read: ModeRead | None = None
    traced_default_dtype: torch.dtype = torch.float32  # torch.get_default_dtype() when it was split

    def train(self, mode: bool = True) -> ExportedSplit:
        if mode != self.traced_training and self.mode_ops:
            traced = "training" if self.traced_training else "eval"
            wanted = "train()" if mode else "eval()"
            raise FxsplitError(
                f"this split was traced by torch.export in {traced} mode, which fixed the behaviour of "
                f"{', '.join(self.mode_ops[:3])} in the graph, so {wanted} cannot change it; call "
                f"model.{wanted} before fxsplit(...) and split again (or use trace='fx')"
            )
        self.training = mode
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        check_modes(self.mode_read)
        try:
            return super().__call__(*args, **kwargs)
        except RuntimeError as error:
            if not str(error).startswith("Tensor dtype mismatch"):
                raise
            default, traced = torch.get_default_dtype(), self.traced_default_dtype
            if default != traced:
                raise FxsplitError(
                    f"a value of this split has another dtype than torch.export traced ({str(error).splitlines()[0]}):"
                    f" torch's default dtype is {_name(default)} now and was {_name(traced)} when the model was split, "
                    "and the graph keeps the dtype of the tensors the model makes (torch.full(...), torch.tensor(...)) "
                    f"as traced; call it under {_name(traced)} (torch.set_default_dtype({traced})), or split the model "
                    "again under the default dtype you run it with"
                ) from error
            raise FxsplitError(
                f"a value of this split has another dtype than torch.export traced ({str(error).splitlines()[0]}), "
                "although its inputs passed export's checks: it runs under another torch.autocast than it was "
                f"traced under (autocast now: {_autocast_now()}); call it as it was traced, split the model under "
                "the autocast you run it with (with torch.autocast(...): fxsplit.fxsplit(...)), or trace with "
                "torch.fx (trace='fx'), whose split follows the caller's autocast"
            ) from error

    def __deepcopy__(self, memo: dict[int, Any]) -> ExportedSplit:
        """A deep copy, without the FutureWarning torch's pytree spec prints when copied (``LeafSpec``)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)
            return super().__deepcopy__(memo)  # type: ignore[return-value]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _autocast_now() -> str:
    on = [f"{d} at {str(torch.get_autocast_dtype(d)).removeprefix('torch.')}" for d in ("cpu", "cuda")]
    found = [text for d, text in zip(("cpu", "cuda"), on, strict=True) if torch.is_autocast_enabled(d)]
    return "on for " + ", ".join(found) if found else "off"


class InputGuard(torch.nn.Module):
    """torch.export's input check, failing with what the split was traced with and how to accept more.

    Wraps the ``_guards_fn`` that export puts first in the graph: same check,
    but an :class:`~fxsplit.errors.InputMismatchError` that names the inputs'
    traced sizes and the ``dynamic_shapes`` option instead of a bare
    ``AssertionError: Guard failed``. A failed check on a non-tensor input
    (``use_cache == False``) says to split again with that value in
    ``example_kwargs``: no ``dynamic_shapes`` can vary a value export fixed.
    """

    def __init__(
        self, check: torch.nn.Module, traced_with: str, dynamic: str | None, input_names: tuple[str, ...] = ()
    ) -> None:
        super().__init__()
        self.check = check
        self.traced_with = traced_with
        self.dynamic = dynamic
        self.input_names = input_names

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.check(*args, **kwargs)
        except AssertionError as error:
            fixed = self._non_tensor(str(error), args)
            if fixed is not None:
                name, value = fixed
                fix = (
                    f"Call it with {name} as traced; {name} is not a tensor, so torch.export fixed its value in "
                    f"the graph and no dynamic_shapes can vary it: to call it with {name}={value!r}, split again "
                    f"with example_kwargs={{{name!r}: {value!r}}} (one split per value), or use trace='fx'"
                )
            else:
                fix = (
                    "Call it with inputs like those (same sizes where they are fixed, same non-tensor values), or "
                    f"split again with {_WIDER.get(self.dynamic, 'a wider dynamic_shapes spec')}, or use trace='fx'"
                )
            raise InputMismatchError(
                f"the inputs do not match what torch.export traced this split with ({error}); traced with "
                f"{self.traced_with}. {fix}"
            ) from None

    def _non_tensor(self, failed: str, args: tuple[Any, ...]) -> tuple[str, Any] | None:
        """``(name, value)`` of the non-tensor input a failed guard tests, if it tests one."""
        subject = re.search(r"Guard failed: (\w+)", failed)
        if subject is None or subject[1] not in self.input_names[: len(args)]:
            return None
        value = args[self.input_names.index(subject[1])]
        return None if isinstance(value, torch.Tensor) else (subject[1], value)


def _guard_inputs(graph: torch.fx.Graph) -> tuple[str, ...]:
    """Names of the values the graph passes to ``_guards_fn``, in order."""
    for node in graph.nodes:
        if node.op == "call_module" and node.target == "_guards_fn":
            return tuple(arg.name if isinstance(arg, torch.fx.Node) else "" for arg in node.args)
    return ()


_WIDER = {
    None: "dynamic_shapes='batch' (any batch size) or 'all' (every size the model allows)",
    "batch": "dynamic_shapes='all' (every size the model allows) or a torch.export spec",
}
"""What to split with for more input sizes, by the ``dynamic_shapes`` the split was made with."""


class GradModeSafeSplit(Split):
    """An fx split whose code sets the grad mode or autocast (a recorded ``no_grad`` or ``torch.autocast``
    region): the caller's modes come back.

    The generated code restores the mode at the end of each region, as the
    ``with`` block did; if an op inside the region raises, the code stops
    before that restore, so the call itself puts the caller's modes back, as
    leaving the ``with`` block by an exception would have. (``torch.save``
    of a whole split reloads it as a plain ``GraphModule``, without this.)
    ``autocast_devices``: the device types of its autocast regions. ``mode_read``: where the traced code read
    the grad mode or autocast, which fixed its graph (:mod:`fxsplit.tracing.modereads`): calls under other
    modes raise.
    """

    autocast_devices: tuple[str, ...] = ()
    mode_read: ModeRead | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        check_modes(self.mode_read)
        if self.autocast_devices:
            with modes_kept(self.autocast_devices):
                return super().__call__(*args, **kwargs)
        with torch.set_grad_enabled(torch.is_grad_enabled()):
            return super().__call__(*args, **kwargs)


class ModeReadSplit(Split):
    """An fx split whose trace read modules' ``training`` flags (``F.dropout(x, p, self.training)``,
    ``if self.training:``): torch.fx kept the value each read found, so ``train()``/``eval()`` cannot change what
    those modules do; switching them to another mode raises instead of changing nothing. ``training_read``:
    module path (``""``: the model) -> the flag read there."""

    training_read: dict[str, bool] = {}

    def train(self, mode: bool = True) -> ModeReadSplit:
        fixed = [path for path, value in self.training_read.items() if value != mode]
        if fixed:
            wanted = "train()" if mode else "eval()"
            traced = "training" if not mode else "eval"
            shown = ", ".join(f"'{p}'" if p else "the model's own forward" for p in fixed[:3])
            more = f" and {len(fixed) - 3} more" if len(fixed) > 3 else ""
            leaves = [p for p in fixed if p]
            listed = ", ".join(map(repr, leaves[:3])) + (", ..." if len(leaves) > 3 else "")
            leaf_fix = f", or name them leaf modules (leaf_modules=[{listed}]) so that the split calls them"
            raise FxsplitError(
                f"this split was traced by torch.fx in {traced} mode, and the trace read self.training of {shown}"
                f"{more} (F.dropout(x, p, self.training), if self.training: ...), which torch.fx fixes in the graph, "
                f"so {wanted} cannot change what they do; call model.{wanted} before fxsplit(...) and split again"
                + (leaf_fix if leaves else "")
            )
        return super().train(mode)  # type: ignore[return-value]


class ModeReadGradModeSafeSplit(ModeReadSplit, GradModeSafeSplit):
    """Both: a trace that read ``training`` flags, and code that sets the grad mode."""


_MODE_OPS = ("dropout", "batch_norm", "instance_norm")


def _mode_dependent_ops(graph: torch.fx.Graph) -> tuple[str, ...]:
    found = []
    for node in graph.nodes:
        name = node.target._schema.name if isinstance(node.target, torch._ops.OpOverload) else ""
        if "dropout" in name and len(node.args) > 1 and node.args[1] == 0:
            continue  # p=0: the same in both modes
        if any(op in name for op in _MODE_OPS):
            found.append(node.name)
    return tuple(found)


def split_module(graph_module: torch.fx.GraphModule, graph: torch.fx.Graph, plan: Plan) -> torch.fx.GraphModule:
    """The split's module over ``graph``, sharing ``graph_module``'s weights, of the class its graph needs."""
    if plan.trace == "export":
        exported = ExportedSplit(graph_module, graph, type(graph_module).__name__)
        kept_on_copy(
            exported,
            traced_training=bool(graph_module.training),
            mode_ops=_mode_dependent_ops(graph),
            traced_default_dtype=torch.get_default_dtype(),
        )
        if (mode_read := graph_module.meta.get(MODE_READS)) is not None:
            kept_on_copy(exported, mode_read=mode_read)
        exported.training = exported.traced_training
        guard = getattr(exported, "_guards_fn", None)
        if isinstance(guard, torch.nn.Module) and not isinstance(guard, InputGuard):
            traced_with = graph_module.meta.get(TRACED_INPUTS) or describe_inputs(graph_module.graph)
            exported._guards_fn = InputGuard(guard, traced_with, plan.dynamic_shapes, _guard_inputs(graph))
        return exported
    mode_read = graph_module.meta.get(MODE_READS)  # its calls check the modes, as the mode regions' restore them
    modes = mode_read is not None or any(is_mode_node(node) for node in graph.nodes)
    read = graph_module.meta.get(TRAINING_READS)
    split: torch.fx.GraphModule
    if read:
        kind = ModeReadGradModeSafeSplit if modes else ModeReadSplit
        split = kind(graph_module, graph, type(graph_module).__name__)
        kept_on_copy(split, training_read=dict(read))
    elif modes:
        split = GradModeSafeSplit(graph_module, graph, type(graph_module).__name__)
    else:
        return Split(graph_module, graph, type(graph_module).__name__)
    if isinstance(split, GradModeSafeSplit):
        kept_on_copy(split, autocast_devices=autocast_devices(graph))
        if mode_read is not None:
            kept_on_copy(split, mode_read=mode_read)
    return split
