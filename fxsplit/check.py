"""Invariants of plans and split modules, checked by tests and on request.

* :func:`verify_plan`: the rules of :mod:`fxsplit.planning.rules` (devices known,
  cuts that go somewhere, once; fingerprint, tensors and tied groups
  consistent), budgets held (each device's memory total within its budget
  less its reserve), and every node and every parameter and buffer placed.
* :func:`verify_split`: the generated graph copies each value once per
  destination device, never to where it already lives, exactly at the plan's
  cuts, and no op reads values from two devices (found by following devices
  through the graph, not by trusting the plan).
* :class:`DeviceChecker`: a dispatch mode that makes logical devices
  (``"cpu:0"``, ``"cpu:1"``, which torch runs on one CPU) *real*: it tags each
  tensor with the device it was made on or copied to, and fails an op that
  mixes two, as it would fail on two GPUs.

Each checker raises :class:`InvariantError` listing every violation it found.
(``fxsplit.check_plan`` is another thing: it checks a *saved* plan against a
model and budgets, for users.)

>>> import torch, fxsplit
>>> from fxsplit.check import DeviceChecker, verify_plan, verify_split
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
>>> gm = fxsplit.fxsplit(model, {"cpu:0": 100, "cpu:1": 100}, trace="fx")
>>> plan = gm.meta["fxsplit_plan"]
>>> verify_plan(plan, model=model); verify_split(gm)
>>> with DeviceChecker(plan, gm) as checker:
...     out = gm(torch.randn(2, 4))
>>> checker.device_of(out)
'cpu:1'
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.fx
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from fxsplit import runtime
from fxsplit.attrpath import attr_at
from fxsplit.codegen.meta import COPY_META, DEVICE_META, CopyRecord
from fxsplit.eagermode import EagerDispatchMode, is_higher_order
from fxsplit.errors import InvariantError
from fxsplit.options import STORAGE_TIERS
from fxsplit.planning.plan import Plan
from fxsplit.planning.rules import budget_overruns, plan_problems
from fxsplit.tracing.graphinfo import NONTENSOR, alias_root, element_size, mutated_inputs, value_kind
from fxsplit.yamlfile import format_path

__all__ = ["DeviceChecker", "InvariantError", "verify_plan", "verify_split"]


def _raise(what: str, problems: list[str]) -> None:
    if problems:
        raise InvariantError(f"{what} breaks {len(problems)} invariant(s):\n  " + "\n  ".join(problems))


def verify_plan(
    plan: Plan, graph_module: torch.fx.GraphModule | None = None, model: torch.nn.Module | None = None
) -> None:
    """Check a plan on its own, and against the traced graph and model when given.

    Args:
        plan: the plan.
        graph_module: the traced graph the plan was made from; each of its
            nodes must be placed, and nothing else (not the split module: its
            copies and the nodes they displace have other names).
        model: the model; every parameter and buffer name must be placed, and
            each device's ``device_bytes`` must cover the tensors placed there.

    Each device must hold what it needs (its ``memory`` total, or its
    ``device_bytes`` without a memory breakdown) within its budget less its
    reserve: :func:`fxsplit.planning.rules.budget_overruns`.

    Raises:
        InvariantError: listing every violation.
    """
    problems = [f"{format_path(p.path)}: {p.message}" for p in plan_problems(plan)]
    problems += [str(overrun) for overrun in budget_overruns(plan)]
    if graph_module is not None:
        problems += _repeated_cuts(plan, graph_module)
        names = [n.name for n in graph_module.graph.nodes]
        problems += [f"node '{n}' is not placed" for n in names if n not in plan.placement]
        problems += [
            f"placement names '{n}', which is not a node of the graph" for n in sorted(set(plan.placement) - set(names))
        ]
    if model is not None:
        problems += _param_problems(plan, model)
    _raise("the plan", problems)


def _repeated_cuts(plan: Plan, graph_module: torch.fx.GraphModule) -> list[str]:
    """A value cut twice to one device, though no op writes the tensor behind it (only then is it copied again)."""
    nodes = {n.name: n for n in graph_module.graph.nodes}
    modules = dict(graph_module.named_modules())
    roots = [alias_root(t) for n in graph_module.graph.nodes for t in mutated_inputs(n, modules)]
    written = {r.name for r in roots} | {str(r.target) for r in roots if r.op == "get_attr"}
    seen: set[tuple[str, str]] = set()
    problems = []
    for index, cut in enumerate(plan.cuts):
        if cut.kind == "stream":
            continue
        node = nodes.get(cut.producer)
        rewritten = alias_root(node).name in written if node is not None else cut.producer in written
        if (cut.producer, cut.destination) in seen and not rewritten:
            problems.append(
                f"cuts[{index}]: '{cut.producer}' is cut to '{cut.destination}' more than once, though nothing "
                "writes it in place"
            )
        seen.add((cut.producer, cut.destination))
    return problems


def _param_problems(plan: Plan, model: torch.nn.Module) -> list[str]:
    problems: list[str] = []
    held: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    planned = getattr(torch, plan.dtype) if plan.dtype else None  # floating tensors count at the plan's dtype
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if tensor is None:
            continue
        device = plan.param_devices.get(name)
        if device is None:
            problems.append(f"'{name}' of the model has no device in param_devices")
        elif name in plan.streamed:
            seen.add(id(tensor))  # stored off the devices: no device holds it
        elif id(tensor) not in seen:
            seen.add(id(tensor))
            for holder in plan.holders(name) if name in plan.replicas else (device,):
                held[holder] += tensor.numel() * element_size(tensor.dtype, planned)
    for device, nbytes in held.items():
        if plan.device_bytes.get(device, 0) < nbytes:
            problems.append(
                f"'{device}' holds {nbytes} bytes of parameters and buffers but device_bytes says "
                f"{plan.device_bytes.get(device, 0)}"
            )
    return problems


def verify_split(gm: torch.fx.GraphModule, plan: Plan | None = None) -> None:
    """Check the copies of a split module and that no op reads values from two devices.

    Devices are followed through the graph: a weight is where
    ``plan.param_devices`` puts it, a copy is at its destination, an op is
    where its tensor inputs are (or where its ``device=`` argument says);
    that must agree with the device the emitter recorded on the node.

    Args:
        gm: the module :func:`fxsplit.fxsplit` returned.
        plan: its plan (default: ``gm.meta["fxsplit_plan"]``).

    Raises:
        InvariantError: listing every violation.
    """
    plan = plan if plan is not None else gm.meta["fxsplit_plan"]
    problems: list[str] = []
    where: dict[torch.fx.Node, str | None] = {}
    copies: dict[tuple[str, str], str] = {}
    made: set[tuple[str, str]] = set()  # copies since the last grad-mode change (after one, copies are made again)
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            made.clear()
        if mutated_inputs(node, modules):
            made.clear()  # after an in-place write, copies of what it wrote are made again
        if COPY_META in node.meta:
            problems += _copy_problems(node, where, copies, made)
            where[node] = node.meta[COPY_META].destination
        elif node.op == "placeholder":
            where[node] = None
        elif node.op == "call_function" and node.target is runtime.replica:
            where[node] = _replica_device(plan, node, problems)
        elif node.op == "get_attr":
            target = str(node.target)
            home = plan.streamed.get(target) or plan.param_devices.get(target)
            where[node] = home if _is_tensor(gm, node) else None
        elif node.op == "output":
            found = {d for n in node.all_input_nodes if (d := where.get(n)) and value_kind(n) != NONTENSOR}
            problems += [
                f"an output is returned on '{d}', not on output_device '{plan.output_device}'"
                for d in sorted(found - {plan.output_device})
            ]
        else:
            where[node] = _op_device(gm, plan, node, where, problems)
        claimed = node.meta.get(DEVICE_META)
        if claimed is not None and where.get(node) not in (None, *STORAGE_TIERS) and claimed != where[node]:
            problems.append(f"'{node.name}' is marked to run on '{claimed}' but its values are on '{where[node]}'")
    cut_pairs = {(c.producer, c.destination) for c in plan.cuts}
    copy_pairs = {pair for pair, source in copies.items() if source != "?"}
    problems += [
        f"the plan cuts '{p}' to '{d}' but the code makes no such copy" for p, d in sorted(cut_pairs - copy_pairs)
    ]
    problems += [
        f"the code copies '{p}' to '{d}' but the plan has no such cut" for p, d in sorted(copy_pairs - cut_pairs)
    ]
    _raise("the split module", problems)


def _copy_problems(
    node: torch.fx.Node,
    where: dict[torch.fx.Node, str | None],
    copies: dict[tuple[str, str], str],
    made: set[tuple[str, str]],
) -> list[str]:
    record: CopyRecord = node.meta[COPY_META]
    key, source, destination = record.producer, record.source, record.destination
    problems: list[str] = []
    if (key, destination) in made and source not in STORAGE_TIERS:  # a streamed weight is copied once per reader
        problems.append(f"'{key}' is copied to '{destination}' twice (again by '{node.name}')")
    if source == destination:
        problems.append(f"'{node.name}' copies '{key}' to '{destination}', where it already lives")
    arg = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    actual = where.get(arg) if arg is not None else None
    if actual is not None and actual != source:
        problems.append(f"'{node.name}' says it copies '{key}' from '{source}' but the value is on '{actual}'")
    if source is None and arg is not None and arg.op != "placeholder":
        problems.append(f"'{node.name}' copies '{key}' from an unknown device but it is not a model input")
    copies[(key, destination)] = "?" if source is None else source
    made.add((key, destination))
    return problems


def _replica_device(plan: Plan, node: torch.fx.Node, problems: list[str]) -> str:
    """The device whose own copy of a replicated weight ``node`` reads; a problem if the plan has no such replica."""
    name, device = str(node.args[1]), str(node.args[3])
    if name not in plan.replicas or device not in plan.replicas[name].devices:
        problems.append(f"'{node.name}' reads a replica of '{name}' on '{device}', which plan.replicas does not hold")
    return device


def _is_tensor(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    return isinstance(attr_at(gm, str(node.target), None), torch.Tensor)


_MOVES = frozenset({"to", "_to_copy", "cuda", "cpu"})
_WRITES_ACROSS = frozenset({"copy_"})


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _op_device(
    gm: torch.fx.GraphModule,
    plan: Plan,
    node: torch.fx.Node,
    where: dict[torch.fx.Node, str | None],
    problems: list[str],
) -> str | None:
    """The device ``node`` runs on, from its inputs; records a problem if they disagree."""
    reads = {n: where.get(n) for n in node.all_input_nodes if value_kind(n) != NONTENSOR}
    devices = {d for d in reads.values() if d}
    devices |= set(_module_weight_devices(gm, plan, node))
    name = _op_name(node)
    target = _device_argument(node)
    if name in _MOVES and target is not None:
        return target
    if target is not None and devices and target not in devices:
        problems.append(f"'{node.name}' names device '{target}' but reads values on {sorted(devices)}")
    if len(devices) > 1 and name not in _WRITES_ACROSS:
        listed = ", ".join(f"'{n.name}' on '{d}'" for n, d in reads.items() if d)
        problems.append(f"'{node.name}' reads values on {sorted(devices)} ({listed})")
    if name in _WRITES_ACROSS and reads:
        return next(iter(reads.values()))
    if devices:
        return min(devices)
    return target


def _module_weight_devices(gm: torch.fx.GraphModule, plan: Plan, node: torch.fx.Node) -> Iterable[str]:
    """Devices of the parameters and buffers a module call reads in place (not passed in as copies)."""
    if node.op == "call_module":
        path, replaced = str(node.target), set()
    elif node.op == "call_function" and node.target is runtime.call_with_weights:
        path, replaced = str(node.args[0].target), set(node.args[1])  # type: ignore[union-attr,arg-type]
    else:
        return []
    module = gm.get_submodule(path)
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    found = (plan.param_devices.get(f"{path}.{name}") for name, _ in tensors if name not in replaced)
    return [d for d in found if d]


def _device_argument(node: torch.fx.Node) -> str | None:
    """The device a node's arguments name (``device=...`` or the target of ``.to(...)``), canonical."""
    candidates = [node.kwargs.get("device")]
    if _op_name(node) in _MOVES:
        candidates += list(node.args[1:])
    for value in candidates:
        if isinstance(value, torch.device):
            return str(value)
        if isinstance(value, str):
            try:
                return str(torch.device(value))
            except RuntimeError:
                continue
    return None


def _logical(device: Any) -> str:
    return str(torch.device(device))


class DeviceChecker(EagerDispatchMode):
    """Run code with logical devices made real: fail any op that mixes two of them.

    Torch runs ``"cpu:0"`` and ``"cpu:1"`` on the same CPU, so a split model
    that forgets a copy still works there and would only fail on real GPUs.
    Inside this mode every tensor carries the logical device it was created
    on (``device=`` of factory ops) or copied to (``.to(device)``); results
    of other ops carry their inputs' device. Parameters and buffers carry the
    device ``plan.param_devices`` gives them. Tensors made outside the mode
    (model inputs) may go anywhere, and so may 0-dim tensors on the host
    (as CUDA accepts CPU scalars); a 0-dim tensor on ``"cpu:1"`` may not.
    ``copy_`` may write across devices, as it can on GPUs.

    A tensor on ``"cpu:1"`` says its device is the plain ``"cpu"``, so ``x.type_as(y)`` (``x.to(y)``, as torch's
    decomposition of ``type_as`` runs it) asks for a copy to ``"cpu"`` where on GPUs it would ask for ``y``'s
    device. Unless the plain ``"cpu"`` is one of the plan's devices, such a copy of a tensor on ``"cpu:k"`` stays
    on ``"cpu:k"``. (A factory op given ``device=y.device`` still makes its result on the host.)

    Use it around forward passes: autograd on the CPU skips the copy back in
    backward (source and destination are the same memory), so gradients do
    not keep their logical device. ``torch.tensor(data, device=...)`` reaches
    the mode without its device, so such a tensor is taken to be on the host;
    and ``.to("cpu")`` of a CPU tensor returns the tensor itself without an
    op, so a copy to the plain ``"cpu"`` device goes unseen.

    Args:
        plan: whose ``param_devices`` say where weights live.
        *modules: modules whose tensors, looked up by those names, get tagged
            (the split module; the original model too, if it is used).
        host_anywhere: a tensor made on the plain ``"cpu"`` may go anywhere, unless the plan places something
            there. For models that make tensors with ``device=x.device`` (Mixtral's experts) and ops whose torch
            implementation does (attention's causal mask): on logical devices that is the host, on GPUs
            ``x``'s device. A copy fxsplit makes always goes to one of the plan's devices, so this misses none.

    Raises:
        InvariantError: from the op that mixes devices, naming them.
    """

    def __init__(self, plan: Plan | None = None, *modules: torch.nn.Module, host_anywhere: bool = False) -> None:
        super().__init__()
        self._tags: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        for module in modules:
            for name, device in plan.param_devices.items() if plan else ():
                tensor = attr_at(module, name, None)
                if isinstance(tensor, torch.Tensor):
                    self._tags[tensor] = device
            for store in module.modules():  # replicas: on the device that holds them
                if isinstance(store, runtime.ReplicaStore):
                    for (_, held_on), (_, copy) in store.held.items():
                        self._tags[copy] = _logical(held_on)
        self.ops_checked = 0
        self._host_placed = plan is not None and any(_logical(d) == "cpu" for d in plan.devices)
        self._host_anywhere = host_anywhere and not self._host_placed

    def tag(self, tensor: torch.Tensor, device: str) -> None:
        """Say that ``tensor`` lives on ``device``."""
        self._tags[tensor] = _logical(device)

    def device_of(self, tensor: torch.Tensor) -> str | None:
        """The logical device of ``tensor`` (None: made outside the mode, fits anywhere)."""
        return self._tags.get(tensor)

    def _is_wildcard(self, tensor: torch.Tensor) -> bool:
        device = self._tags.get(tensor)
        return device is None or (tensor.dim() == 0 and torch.device(device).index is None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        name = func.name() if is_higher_order(func) else func._schema.name.split("::")[-1]
        seen = {self._tags[t] for t in tensors if not self._is_wildcard(t)}
        if len(seen) > 1 and name not in _WRITES_ACROSS and name != "_to_copy":
            described = ", ".join(f"{tuple(t.shape)} on '{self._tags.get(t) or 'anywhere'}'" for t in tensors)
            raise InvariantError(
                f"{func} mixes tensors on devices {sorted(seen)}: {described}; on real devices "
                "this op would fail (a copy is missing)"
            )
        self.ops_checked += 1
        out = func(*args, **kwargs)
        device, anywhere = kwargs.get("device"), False
        if device is not None and not self._host_placed and _logical(device) == "cpu":
            if name == "_to_copy":
                device = None  # to another tensor's device, read as the plain "cpu" (see the class docstring)
            else:
                anywhere = self._host_anywhere  # made on the host: anywhere (``host_anywhere``), else on the host
        if anywhere:
            result: str | None = None
        elif device is not None:
            result = _logical(device)
        elif name in _WRITES_ACROSS:
            result = self._tags.get(tensors[0]) if tensors else None
        else:
            result = min(seen) if seen else next((self._tags[t] for t in tensors if t in self._tags), None)
        if result is not None:
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and not (name in _WRITES_ACROSS and tensor in self._tags):
                    self._tags[tensor] = result
        return out
