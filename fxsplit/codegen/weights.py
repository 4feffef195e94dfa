"""The traced module's weights in the split: which node reads which, where each tensor is, moving them.

:func:`weights_read` finds the weights each node reads from the graph and the
plan alone, so that a plan is all :func:`~fxsplit.codegen.emitter.emit` needs
besides the graph. :func:`move_weights` moves parameters and buffers in
place, as ``Module.to`` does, after :func:`check_input_writes` has found the
plan emittable, and hands back what it moved so that a later failure can put
it all back.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.fx

from fxsplit.attrpath import attr_at
from fxsplit.cost.build import Weight, storage_key, tensor_reads
from fxsplit.errors import DeviceError, FxsplitError
from fxsplit.planning.plan import Plan
from fxsplit.tracing.graphinfo import element_size, input_writers
from fxsplit.units import format_size

__all__ = [
    "MovedWeights",
    "check_input_writes",
    "move_weights",
    "stored_in",
    "weight_path",
    "weight_tensor",
    "weights_read",
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

    def move(self, tensor: torch.Tensor, device: torch.device, *, pin: bool = False) -> None:
        """Move ``tensor`` (and its gradient) to ``device``; both copies are made before either is swapped in.

        ``pin``: page-lock the host copy (for weights streamed to CUDA devices).
        """
        data = tensor.data.to(device)
        self.assign(tensor, data.pin_memory() if pin and not data.is_pinned() else data, device)

    def assign(self, tensor: torch.Tensor, data: torch.Tensor, device: torch.device | None = None) -> None:
        """Give ``tensor`` new ``data`` (its gradient moves to ``device``, or to ``data``'s device)."""
        grad = tensor.grad if tensor.is_leaf else None  # a non-leaf (a buffer written under autograd) has none
        grad_data = grad.data.to(device or data.device) if grad is not None else None
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


def move_weights(
    graph_module: torch.fx.GraphModule, plan: Plan, weights: list[Weight], model: torch.nn.Module | None = None
) -> MovedWeights:
    """Move every weight of the traced module to its planned device, in place (like ``Module.to``).

    A weight the traced module does not hold (no op reads it: an unused submodule) is found in ``model``.

    Checks first that the plan can be emitted (:func:`check_input_writes`), so a refusal moves nothing.
    Returns what was moved, so that a caller failing later can put it back.

    Raises:
        DeviceError: a move failed (out of memory, a device error); every
            tensor moved before it has been put back, so nothing has changed.
    """
    check_input_writes(graph_module, plan)
    moved = MovedWeights()
    to_disk: dict[str, torch.Tensor] = {}
    first_of: dict[tuple[object, ...], tuple[torch.Tensor, str]] = {}  # storage -> the tensor moved for it, where
    for weight in weights:
        tensor = weight_tensor(graph_module, weight)
        if tensor is None and model is not None:
            tensor = next((t for n in weight.names if isinstance(t := attr_at(model, n, None), torch.Tensor)), None)
        if tensor is None or tensor.device.type == "meta":
            continue
        tier = stored_in(plan, weight.names)
        key = storage_key(tensor)
        target = tier or plan.param_devices[weight.names[0]]
        if key is not None and key in first_of and first_of[key][1] == target and tier != "disk":
            moved.assign(tensor, first_of[key][0].data)  # two objects, one tensor: they stay one
            continue
        if key is not None:
            first_of.setdefault(key, (tensor, target))
        if tier == "disk":
            to_disk[weight.names[0]] = tensor
            continue
        device = torch.device("cpu" if tier == "host" else plan.param_devices[weight.names[0]])
        try:
            moved.move(tensor, device, pin=tier == "host" and torch.cuda.is_available())
        except Exception as error:  # noqa: BLE001 - a device may fail in any way; the model must come back whole
            _failed(moved, f"moving '{weight.names[0]}' ({_describe(tensor)}) to '{device}'", error, str(device))
    if to_disk:
        _store_on_disk(moved, plan, to_disk)
    return moved


def stored_in(plan: Plan, names: tuple[str, ...]) -> str | None:
    """Where the weight named ``names`` is stored off the devices (``"host"``, ``"disk"``), or None: resident."""
    return next((plan.streamed[n] for n in names if n in plan.streamed), None)


def _store_on_disk(moved: MovedWeights, plan: Plan, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` to a new safetensors file in the plan's offload dir and make them views of it."""
    from fxsplit.checkpoint.write import store_on_disk

    directory = plan.offload.get("dir") or "."
    try:
        layout = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
        views = store_on_disk(directory, plan.fingerprint or "model", layout, tensors.__getitem__)
        for name, tensor in tensors.items():
            moved.assign(tensor, views[name])
    except Exception as error:  # noqa: BLE001 - a full disk, a bad directory: the model must come back whole
        _failed(moved, f"writing {len(tensors)} offloaded weight(s) to '{directory}'", error, "the disk")


def _failed(moved: MovedWeights, what: str, error: Exception, where: str) -> NoReturn:
    count = len(moved)
    moved.undo()
    first = (str(error).strip().splitlines() or [""])[0]
    raise DeviceError(
        f"{what} failed: {type(error).__name__}: {first}. The {count} tensor(s) moved before it were put back: "
        f"the model is as it was. Free memory on {where}, lower its budget, or leave it out"
    ) from error


def _describe(tensor: torch.Tensor) -> str:
    shape = ", ".join(str(size) for size in tensor.shape)
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}[{shape}] on {tensor.device}, {format_size(tensor.numel() * tensor.element_size())}"


def weights_read(graph_module: torch.fx.GraphModule, plan: Plan) -> dict[str, list[Weight]]:
    """Graph node name -> the weights it reads, from the graph and the plan alone.

    The same as :func:`fxsplit.planning.build.weights_by_node` of the costs
    the plan was made from: each tensor is one weight, however many nodes and
    paths read it, named as the model names it. A graph path is a name of the
    model; a tensor with several names (tied) takes the plan's ``tied`` group
    that holds the path, canonical name first, and a tensor read by several
    paths that no group names is named by the first path the graph reads it by.
    """
    groups = {name: group for group in plan.tied for name in group}
    dtype = getattr(torch, plan.dtype) if plan.dtype else None
    found: dict[int, tuple[tuple[str, ...], torch.Tensor, list[str]]] = {}
    for node, path, tensor in tensor_reads(graph_module):
        names = found[id(tensor)][0] if id(tensor) in found else groups.get(path, (path,))
        found.setdefault(id(tensor), (names, tensor, []))[2].append(node.name)
    by_node: dict[str, list[Weight]] = {}
    for names, tensor, nodes in found.values():
        is_buffer = not isinstance(tensor, torch.nn.Parameter)
        weight = Weight(names, tensor.numel() * element_size(tensor.dtype, dtype), is_buffer, tuple(nodes))
        for node_name in nodes:
            by_node.setdefault(node_name, []).append(weight)
    return by_node


def weight_tensor(graph_module: torch.fx.GraphModule, weight: Weight) -> torch.Tensor | None:
    """The tensor of ``weight`` in ``graph_module``: under its first name found there, else a get_attr target."""
    for path in (*weight.names, *_node_targets(graph_module, weight)):
        tensor = attr_at(graph_module, path, None)
        if isinstance(tensor, torch.Tensor):
            return tensor
    return None


def _node_targets(graph_module: torch.fx.GraphModule, weight: Weight) -> list[str]:
    return [str(n.target) for n in graph_module.graph.nodes if n.name in weight.nodes and n.op == "get_attr"]


def weight_path(graph_module: torch.fx.GraphModule, weight: Weight) -> str | None:
    """The path a ``get_attr`` reads ``weight`` by: its first name that reaches a tensor, else a get_attr target."""
    for path in weight.names:
        if isinstance(attr_at(graph_module, path, None), torch.Tensor):
            return path
    return next(iter(_node_targets(graph_module, weight)), None)
