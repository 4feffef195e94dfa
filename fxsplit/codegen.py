"""Emit the split model: a new ``GraphModule`` whose weights live on their devices.

Each op keeps its place in the graph; a value needed on a device other than
its home is copied with ``.to(device)`` once per destination device, right
before its first reader there. Ops that create tensors on a hard-coded device
(``device=...`` arguments, ``.to("cpu")``, ``.cuda()``) are rewritten to the
device of their stage. No hooks: the generated ``forward`` is all there is.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx

from fxsplit import runtime
from fxsplit.cost import Weight
from fxsplit.dynamic import TRACED_INPUTS, describe_inputs
from fxsplit.errors import FxsplitError, InputMismatchError
from fxsplit.fastattr import mirror_registries
from fxsplit.graphinfo import TENSOR, value_kind
from fxsplit.plan import Plan
from fxsplit.planning import Read, reads_of

__all__ = ["COPY_META", "DEVICE_META", "ExportedSplit", "emit", "move_weights"]

COPY_META = "fxsplit_copy"
DEVICE_META = "fxsplit_device"
"""``node.meta`` key: the device an emitted op, copy or weight read runs on (placeholders have none)."""


def move_weights(graph_module: torch.fx.GraphModule, plan: Plan, weights: list[Weight]) -> None:
    """Move every weight of the traced module to its planned device, in place (like ``Module.to``)."""
    for weight in weights:
        tensor = _weight_tensor(graph_module, weight)
        if tensor is None:
            continue
        device = torch.device(plan.param_devices[weight.names[0]])
        if tensor.device.type == "meta":
            continue
        with torch.no_grad():
            tensor.data = tensor.data.to(device)
            if tensor.grad is not None:
                tensor.grad.data = tensor.grad.data.to(device)


def _weight_tensor(graph_module: torch.fx.GraphModule, weight: Weight) -> torch.Tensor | None:
    for path in (*weight.names, *_node_targets(graph_module, weight)):
        tensor = _lookup(graph_module, path)
        if isinstance(tensor, torch.Tensor):
            return tensor
    return None


def _node_targets(graph_module: torch.fx.GraphModule, weight: Weight) -> list[str]:
    return [str(n.target) for n in graph_module.graph.nodes if n.name in weight.nodes and n.op == "get_attr"]


def _lookup(root: Any, path: str) -> Any:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class _Emitter:
    def __init__(self, graph_module: torch.fx.GraphModule, plan: Plan, by_node: dict[str, list[Weight]]) -> None:
        self.source = graph_module
        self.plan = plan
        self.by_node = by_node
        self.graph = torch.fx.Graph()
        self.graph.set_codegen(graph_module.graph._codegen)
        self.env: dict[str, torch.fx.Node] = {}
        self.copies: dict[tuple[str, str], torch.fx.Node] = {}
        self.modules = dict(graph_module.named_modules())

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
        for node in [n for n in self.graph.nodes if n.op == "get_attr" and not n.users]:
            self.graph.erase_node(node)  # a tied weight read through its other name: no dead line in the code
        return self.graph

    def _lookup_env(self, node: torch.fx.Node) -> torch.fx.Node:
        return self.env[node.name]

    def _copy_node(self, node: torch.fx.Node, replaced: dict[str, torch.fx.Node],
                   foreign: dict[str, tuple[Weight, torch.fx.Node]], device: str) -> torch.fx.Node:
        def remap(arg: torch.fx.Node) -> torch.fx.Node:
            return replaced.get(arg.name) or self.env[arg.name]

        if foreign:
            return self._functional_call(node, foreign, remap)
        new = self.graph.node_copy(node, remap)
        if node.op != "output":
            _pin_device_arguments(new, device)
        return new

    def _functional_call(self, node: torch.fx.Node, foreign: dict[str, tuple[Weight, torch.fx.Node]],
                         remap: Callable[[torch.fx.Node], torch.fx.Node]) -> torch.fx.Node:
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
        cached = self.copies.get((read.key, device))
        if cached is not None:
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
        copy.meta[COPY_META] = (read.key, None if is_input and home == device else home, device)
        copy.meta[DEVICE_META] = device
        if read.node is not None and "val" in read.node.meta:
            copy.meta["val"] = read.node.meta["val"]
        self.copies[(read.key, device)] = copy
        return copy

    def _weight_node(self, read: Read) -> torch.fx.Node:
        assert read.weight is not None
        for path in read.weight.names:
            if isinstance(_lookup(self.source, path), torch.Tensor):
                return self._home_attr(path, read.key)
        for path in _node_targets(self.source, read.weight):
            return self._home_attr(path, read.key)
        raise AssertionError(f"no attribute path reaches weight {read.key!r}")  # pragma: no cover

    def _home_attr(self, path: str, key: str) -> torch.fx.Node:
        attr = self.graph.get_attr(path)
        attr.meta[DEVICE_META] = self.plan.param_devices[key]
        return attr


def _pin_device_arguments(node: torch.fx.Node, device: str) -> None:
    """Point every hard-coded device in the node's arguments at ``device``."""
    if node.op == "call_method" and node.target in ("cuda", "cpu"):
        node.target = "to"
        node.args = (node.args[0], device)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k == "non_blocking"}
        return
    is_to = (node.op == "call_method" and node.target == "to") or (
        isinstance(node.target, torch._ops.OpOverload) and node.target._schema.name in ("aten::to", "aten::_to_copy")
    )
    target_device = torch.device(device)

    def fix(value: Any, positional_to: bool) -> Any:
        if isinstance(value, torch.device):
            return target_device
        if positional_to and isinstance(value, str) and _is_device_string(value):
            return device
        if positional_to and isinstance(value, torch.fx.Node) and _is_device_node(value):
            return device
        if isinstance(value, (list, tuple)) and not isinstance(value, torch.fx.Node):
            return type(value)(fix(v, False) for v in value)
        return value

    node.args = tuple(fix(a, is_to and i > 0) for i, a in enumerate(node.args))
    kwargs = dict(node.kwargs)
    if "device" in kwargs and kwargs["device"] is not None:
        kwargs["device"] = device if isinstance(kwargs["device"], str) else target_device
    node.kwargs = {k: (v if k == "device" else fix(v, False)) for k, v in kwargs.items()}


def _is_device_string(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, TypeError):
        return False
    return True


def _is_device_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] == "device"


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
    ``AssertionError: Guard failed``.
    """

    def __init__(self, check: torch.nn.Module, traced_with: str, dynamic: str | None) -> None:
        super().__init__()
        self.check = check
        self.traced_with = traced_with
        self.dynamic = dynamic

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.check(*args, **kwargs)
        except AssertionError as error:
            wider = _WIDER.get(self.dynamic, "a wider dynamic_shapes spec")
            raise InputMismatchError(
                f"the inputs do not match what torch.export traced this split with ({error}); traced with "
                f"{self.traced_with}. Call it with inputs like those (same sizes where they are fixed, same "
                f"non-tensor values), or split again with {wider}, or use trace='fx'"
            ) from None


_WIDER = {
    None: "dynamic_shapes='batch' (any batch size) or 'all' (every size the model allows)",
    "batch": "dynamic_shapes='all' (every size the model allows) or a torch.export spec",
}
"""What to split with for more input sizes, by the ``dynamic_shapes`` the split was made with."""


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
            exported._guards_fn = InputGuard(guard, traced_with, plan.dynamic_shapes)
        split: torch.fx.GraphModule = exported
    else:
        split = torch.fx.GraphModule(graph_module, graph, type(graph_module).__name__)
    split.recompile()
    mirror_registries(split)  # weights by path at dict speed (see fxsplit.fastattr)
    split.meta["fxsplit_plan"] = plan
    return split
