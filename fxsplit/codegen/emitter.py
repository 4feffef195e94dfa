"""Emit the split model: a new ``GraphModule`` whose weights live on their devices.

Each op keeps its place in the graph; a value needed on a device other than
its home is copied with ``.to(device)`` once per destination device, right
before its first reader there. Ops that create tensors on a hard-coded device
(``device=...`` arguments, ``.to("cpu")``, ``.cuda()``) are rewritten to the
device of their stage. No hooks: the generated ``forward`` is all there is.
"""

from __future__ import annotations

import builtins
import re
from typing import Any, Callable

import torch
import torch.fx

from fxsplit import runtime
from fxsplit.attrpath import attr_at
from fxsplit.codegen.fastattr import mirror_registries
from fxsplit.codegen.meta import COPY_META, DEVICE_META, CopyRecord
from fxsplit.codegen.nested import pin_device_arguments, pin_subgraph_devices
from fxsplit.cost.build import Weight
from fxsplit.errors import DeviceError, FxsplitError, InputMismatchError
from fxsplit.planning.build import Read, reads_of
from fxsplit.planning.plan import Plan
from fxsplit.tracing.dynamic import TRACED_INPUTS, describe_inputs
from fxsplit.tracing.gradmode import is_grad_mode_node
from fxsplit.tracing.graphinfo import TENSOR, input_writers, value_kind
from fxsplit.units import format_size

__all__ = [
    "COPY_META",
    "DEVICE_META",
    "ExportedSplit",
    "GradModeSafeSplit",
    "MovedWeights",
    "check_input_writes",
    "emit",
    "move_weights",
]


class MovedWeights:
    """What :func:`move_weights` moved, and from where: :meth:`undo` puts every tensor back.

    The same tensor objects are kept; only their ``.data`` (and their
    gradient's) is swapped, as ``Module.to`` does.
    """

    def __init__(self) -> None:
        self._before: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []

    def __len__(self) -> int:
        return len(self._before)

    def move(self, tensor: torch.Tensor, device: torch.device) -> None:
        """Move ``tensor`` (and its gradient) to ``device``; both copies are made before either is swapped in."""
        grad = tensor.grad
        data = tensor.data.to(device)
        grad_data = grad.data.to(device) if grad is not None else None
        self._before.append((tensor, tensor.data, grad, grad.data if grad is not None else None))
        try:
            with torch.no_grad():
                tensor.data = data
                if grad is not None and grad_data is not None:
                    grad.data = grad_data
        except BaseException:
            self._put_back(*self._before.pop())
            raise

    def undo(self) -> None:
        """Put every moved tensor and gradient back on the device it came from, newest first."""
        while self._before:
            self._put_back(*self._before.pop())

    @staticmethod
    def _put_back(
        tensor: torch.Tensor, data: torch.Tensor, grad: torch.Tensor | None, grad_data: torch.Tensor | None
    ) -> None:
        with torch.no_grad():
            tensor.data = data
            if grad is not None and grad_data is not None:
                grad.data = grad_data


def check_input_writes(graph_module: torch.fx.GraphModule, plan: Plan) -> None:
    """Refuse a plan that updates an input in place away from the input's copy (the caller would miss it).

    The generated code writes an input's in-place updates back to the
    caller's tensor from the input's copy on its home device (where it is
    first read); an update made on another device would not reach it.

    Raises:
        FxsplitError: names the input, the writing node and both devices.
    """
    writers = input_writers(graph_module.graph, dict(graph_module.named_modules()))
    for placeholder, nodes in writers.items():
        home = plan.placement.get(placeholder)
        elsewhere = [w for w in nodes if plan.placement.get(w) != home]
        if home is not None and elsewhere:
            raise FxsplitError(
                f"input '{placeholder}' is updated in place by '{elsewhere[0]}' on "
                f"{plan.placement.get(elsewhere[0])}, but its copy lives on {home}, where it is first read, so the "
                f"update could not reach the caller's tensor; pin the ops that read and write '{placeholder}' to one "
                "device (pins=...), or do not update the input in place"
            )


def move_weights(graph_module: torch.fx.GraphModule, plan: Plan, weights: list[Weight]) -> MovedWeights:
    """Move every weight of the traced module to its planned device, in place (like ``Module.to``).

    Checks first that the plan can be emitted (:func:`check_input_writes`), so a refusal moves nothing.
    Returns what was moved, so that a caller failing later can put it back.

    Raises:
        DeviceError: a move failed (out of memory, a device error); every
            tensor moved before it has been put back, so nothing has changed.
    """
    check_input_writes(graph_module, plan)
    moved = MovedWeights()
    for weight in weights:
        tensor = _weight_tensor(graph_module, weight)
        if tensor is None or tensor.device.type == "meta":
            continue
        device = torch.device(plan.param_devices[weight.names[0]])
        try:
            moved.move(tensor, device)
        except Exception as error:  # noqa: BLE001 - a device may fail in any way; the model must come back whole
            count = len(moved)
            moved.undo()
            first = (str(error).strip().splitlines() or [""])[0]
            raise DeviceError(
                f"moving '{weight.names[0]}' ({_describe(tensor)}) to '{device}' failed: {type(error).__name__}: "
                f"{first}. The {count} tensor(s) moved before it were put back: the model is as it was. Free memory "
                f"on '{device}', lower its budget, or leave it out"
            ) from error
    return moved


def _describe(tensor: torch.Tensor) -> str:
    shape = ", ".join(str(size) for size in tensor.shape)
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}[{shape}] on {tensor.device}, {format_size(tensor.numel() * tensor.element_size())}"


def _weight_tensor(graph_module: torch.fx.GraphModule, weight: Weight) -> torch.Tensor | None:
    for path in (*weight.names, *_node_targets(graph_module, weight)):
        tensor = attr_at(graph_module, path, None)
        if isinstance(tensor, torch.Tensor):
            return tensor
    return None


def _node_targets(graph_module: torch.fx.GraphModule, weight: Weight) -> list[str]:
    return [str(n.target) for n in graph_module.graph.nodes if n.name in weight.nodes and n.op == "get_attr"]


class _Emitter:
    def __init__(self, graph_module: torch.fx.GraphModule, plan: Plan, by_node: dict[str, list[Weight]]) -> None:
        self.source = graph_module
        self.plan = plan
        self.by_node = by_node
        self.graph = torch.fx.Graph()
        self.graph.set_codegen(graph_module.graph._codegen)
        self.env: dict[str, torch.fx.Node] = {}
        self.copies: dict[tuple[str, str], tuple[torch.fx.Node, int | None]] = {}
        self.modules = dict(graph_module.named_modules())
        self.writers = input_writers(graph_module.graph, self.modules)
        self.last_writes: dict[str, list[str]] = {}
        for placeholder, writers in self.writers.items():
            self.last_writes.setdefault(writers[-1], []).append(placeholder)
        self.grad_region = 0  # bumped at each grad-mode change: copies made under another mode are not reused

    def run(self) -> torch.fx.Graph:
        for node in self.source.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                self.env[node.name] = self.graph.node_copy(node, self._lookup_env)
                if node.op == "get_attr" and node.name in self.plan.placement:
                    self.env[node.name].meta[DEVICE_META] = self.plan.placement[node.name]
                continue
            device = self.plan.placement[node.name]
            replaced: dict[str, torch.fx.Node] = {}
            foreign: dict[str, tuple[Weight, torch.fx.Node]] = {}
            for read in reads_of(node, self.by_node):
                fetched = self._fetch(read, device)
                if fetched is None:
                    continue
                if read.node is not None:
                    replaced[read.node.name] = fetched
                elif read.weight is not None:
                    foreign[read.key] = (read.weight, fetched)
            new = self._copy_node(node, replaced, foreign, device)
            if node.op != "output":
                new.meta[DEVICE_META] = device
            self.env[node.name] = new
            for placeholder in self.last_writes.get(node.name, ()):
                self._write_back(placeholder)
            if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
                self.grad_region += 1
        for node in [n for n in self.graph.nodes if n.op == "get_attr" and not n.users]:
            self.graph.erase_node(node)  # a tied weight read through its other name: no dead line in the code
        for node in self.graph.nodes:
            if isinstance(node.type, str):
                node.type = _annotation(node.type)
        return self.graph

    def _lookup_env(self, node: torch.fx.Node) -> torch.fx.Node:
        return self.env[node.name]

    def _copy_node(
        self,
        node: torch.fx.Node,
        replaced: dict[str, torch.fx.Node],
        foreign: dict[str, tuple[Weight, torch.fx.Node]],
        device: str,
    ) -> torch.fx.Node:
        def remap(arg: torch.fx.Node) -> torch.fx.Node:
            return replaced.get(arg.name) or self.env[arg.name]

        if foreign:
            return self._functional_call(node, foreign, remap)
        new = self.graph.node_copy(node, remap)
        if node.op != "output":
            pin_device_arguments(new, device)
        return new

    def _functional_call(
        self,
        node: torch.fx.Node,
        foreign: dict[str, tuple[Weight, torch.fx.Node]],
        remap: Callable[[torch.fx.Node], torch.fx.Node],
    ) -> torch.fx.Node:
        """A call_module whose weights live elsewhere: call it with copies of them."""
        module = self.modules[str(node.target)]
        copies = {id(_weight_tensor(self.source, weight)): copy for weight, copy in foreign.values()}
        local: dict[str, torch.fx.Node] = {}
        tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        for name, tensor in tensors:
            if id(tensor) in copies:
                local[name] = copies[id(tensor)]
        module_node = self.graph.get_attr(str(node.target))
        module_node.meta[DEVICE_META] = self.plan.placement[node.name]
        args = torch.fx.map_arg(node.args, remap)
        kwargs = torch.fx.map_arg(node.kwargs, remap)
        new = self.graph.call_function(runtime.call_with_weights, (module_node, local, tuple(args), dict(kwargs)))
        new.meta = dict(node.meta)
        return new

    def _fetch(self, read: Read, device: str) -> torch.fx.Node | None:
        """The node that holds ``read`` on ``device``, copying it there on first need."""
        if read.weight is not None:
            home = self.plan.param_devices[read.key]
        else:
            home = self.plan.placement[read.key]
        is_input = read.node is not None and read.node.op == "placeholder"
        if home == device and not is_input:
            return None
        cached, region = self.copies.get((read.key, device), (None, None))
        if cached is not None and region in (None, self.grad_region):
            return cached
        if is_input and home != device:
            source = self._fetch(read, home)
        elif read.node is not None:
            source = self.env[read.node.name]
        else:
            source = self._weight_node(read)
        known_tensor = read.weight is not None or (read.node is not None and value_kind(read.node) == TENSOR)
        if known_tensor:
            copy = self.graph.call_method("to", (source, device))
        else:
            copy = self.graph.call_function(runtime.move, (source, device))
        copy.meta[COPY_META] = CopyRecord(read.key, None if is_input and home == device else home, device)
        copy.meta[DEVICE_META] = device
        if read.node is not None and "val" in read.node.meta:
            copy.meta["val"] = read.node.meta["val"]
        # A copy made under no_grad carries no gradient: made again after the mode changes.
        # An input written in place keeps one copy at home, the one the writes reach.
        keep = is_input and home == device and read.key in self.writers
        self.copies[(read.key, device)] = (copy, None if keep else self.grad_region)
        return copy

    def _write_back(self, placeholder: str) -> None:
        """Copy the home copy of an input written in place back into the caller's tensor (as eager would)."""
        home = self.plan.placement[placeholder]
        moved, _ = self.copies.get((placeholder, home), (None, None))
        if moved is None:
            return
        write = self.graph.call_function(runtime.write_back, (self.env[placeholder], moved))
        write.meta[DEVICE_META] = home

    def _weight_node(self, read: Read) -> torch.fx.Node:
        assert read.weight is not None
        for path in read.weight.names:
            if isinstance(attr_at(self.source, path, None), torch.Tensor):
                return self._home_attr(path, read.key)
        for path in _node_targets(self.source, read.weight):
            return self._home_attr(path, read.key)
        raise AssertionError(f"no attribute path reaches weight {read.key!r}")  # pragma: no cover

    def _home_attr(self, path: str, key: str) -> torch.fx.Node:
        attr = self.graph.get_attr(path)
        attr.meta[DEVICE_META] = self.plan.param_devices[key]
        return attr


def _annotation(text: str) -> Any:
    """The object a string annotation names (``from __future__ import annotations``), or None.

    torch.fx copies such annotations as strings, which it prints as ``x : _torch_Tensor_`` and
    cannot pickle. ``"torch.Tensor"`` and builtins (``"int"``) are resolved; anything else is
    dropped (annotations do not change what the code does).
    """
    head, _, rest = text.partition(".")
    if head == "torch":
        found = attr_at(torch, rest, None) if rest else torch
    else:
        found = None if rest else getattr(builtins, head, None)
    return found if isinstance(found, type) else None


class ExportedSplit(torch.fx.GraphModule):
    """A split of a ``torch.export`` graph, whose train/eval behaviour was fixed when it was traced.

    ``torch.export`` bakes the mode into the graph (dropout on or off, batch
    norm using batch or running statistics). Switching the mode of a graph
    that has such ops would silently change nothing, so it raises instead.
    """

    traced_training: bool = False
    mode_ops: tuple[str, ...] = ()

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


class GradModeSafeSplit(torch.fx.GraphModule):
    """An fx split whose code sets the grad mode (a recorded ``no_grad`` region): the caller's mode comes back.

    The generated code restores the mode at the end of each region, as the
    ``with`` block did; if an op inside the region raises, the code stops
    before that restore, so the call itself puts the caller's mode back, as
    leaving the ``with`` block by an exception would have. (``torch.save``
    of a whole split reloads it as a plain ``GraphModule``, without this.)
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.set_grad_enabled(torch.is_grad_enabled()):
            return super().__call__(*args, **kwargs)


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


def emit(graph_module: torch.fx.GraphModule, plan: Plan, by_node: dict[str, list[Weight]]) -> torch.fx.GraphModule:
    """Build the split ``GraphModule``; it shares (not copies) the traced module's weights."""
    check_input_writes(graph_module, plan)
    graph = _Emitter(graph_module, plan, by_node).run()
    graph.lint()
    if plan.trace == "export":
        exported = ExportedSplit(graph_module, graph, type(graph_module).__name__)
        exported.traced_training = bool(graph_module.training)
        exported.mode_ops = _mode_dependent_ops(graph)
        exported.training = exported.traced_training
        guard = getattr(exported, "_guards_fn", None)
        if isinstance(guard, torch.nn.Module) and not isinstance(guard, InputGuard):
            traced_with = graph_module.meta.get(TRACED_INPUTS) or describe_inputs(graph_module.graph)
            exported._guards_fn = InputGuard(guard, traced_with, plan.dynamic_shapes, _guard_inputs(graph))
        split: torch.fx.GraphModule = exported
    elif any(is_grad_mode_node(node) for node in graph.nodes):
        split = GradModeSafeSplit(graph_module, graph, type(graph_module).__name__)
    else:
        split = torch.fx.GraphModule(graph_module, graph, type(graph_module).__name__)
    pin_subgraph_devices(split, {n.name: n.meta[DEVICE_META] for n in split.graph.nodes if DEVICE_META in n.meta})
    split.recompile()
    mirror_registries(split)  # weights by path at dict speed (see fxsplit.codegen.fastattr)
    split.meta["fxsplit_plan"] = plan
    return split
