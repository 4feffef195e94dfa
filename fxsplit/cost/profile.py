"""Measure how long each op of a traced graph takes on a real device (``profile=True``).

:func:`profile_op_seconds` runs the traced graph node by node (a
``torch.fx.Interpreter``) on the device, under ``torch.no_grad()``, with
*copies* of the graph's parameters, buffers and constants and of the inputs
on that device, and times each op's call alone: its arguments are fetched
before the clock starts, so the interpreter's own work between ops is not
charged to any op. On CPU the clock is ``time.perf_counter``; on CUDA a pair
of events around each op, read once the run is done (the GPU's time from the
end of the previous op's work to the end of this op's, launch delays
included). Every op's time is the median over ``repeats`` runs of the whole
graph after ``warmup`` runs. It is forward time: a backward costs more, and
scaling for it is the caller's job.

The user's model and the traced graph keep their tensors, devices and values
(the run writes, as a forward may, into the copies only), at the price of one
copy of the weights on the device while it runs; the random number generators
are put back as they were (dropout draws from them). Ops use the threads torch
has (``torch.set_num_threads``): set them as the model will run.

>>> import torch, fxsplit
>>> from fxsplit.api import trace_and_plan
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
>>> x = torch.randn(8, 64)
>>> planned = trace_and_plan(model, {"cpu:0": "1MiB"}, (x,), {"trace": "fx"})
>>> seconds = profile_op_seconds(planned.traced.graph_module, planned.costs.ops, (x,), {}, "cpu:0")
>>> [op.name for op in planned.costs.ops], len(seconds), all(s > 0 for s in seconds)
(['_0', '_1'], 2, True)
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_leaves, tree_map_only

from fxsplit.devices import normalize_device, require_usable
from fxsplit.errors import SpecError
from fxsplit.memory.activations import replace_graph_tensors
from fxsplit.memory.measure import flat_inputs
from fxsplit.tracing.graphinfo import is_guard

__all__ = ["profile_op_seconds"]

_REFUSAL = "profile=True runs the model:"
_FIX = "pass example_inputs the model runs on and load real weights, or leave profile off to estimate from FLOPs"


def profile_op_seconds(
    graph_module: torch.fx.GraphModule,
    ops: Sequence[torch.fx.Node],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any] | None,
    device: str,
    *,
    repeats: int = 3,
    warmup: int = 1,
    backward: bool = False,
) -> list[float]:
    """Seconds each op of ``ops`` takes on ``device`` (median over ``repeats`` runs after ``warmup``).

    The graph is run whole each time (placeholders, ``get_attr``, guards and
    the output too), but only the nodes in ``ops`` are timed and reported, in
    the order of ``ops``. Neither the model nor ``graph_module`` is modified.

    Args:
        graph_module: the traced graph (``Traced.graph_module``).
        ops: the nodes to time, e.g. ``GraphCosts.ops`` (the partitioner's ops).
        args: the example inputs, as the user passes them to the model.
        kwargs: the example keyword inputs (None: none).
        device: where to run: ``"cpu"``, ``"cpu:1"`` (the CPU), ``"cuda:0"``.
        repeats: timed runs (at least 1); each op reports its median.
        warmup: untimed runs first (at least 0).
        backward: also time each op's backward, alone: the op runs with gradients on inputs of its
            own (detached from the ops before it), then ``torch.autograd.grad`` takes the gradients of
            its floating inputs and of the parameters it reads from a gradient of ones; an op's time
            is then its forward's plus its backward's (a training step's share).

    Returns:
        One time in seconds per op of ``ops``.

    Raises:
        SpecError: a weight or input is on ``meta``, the inputs are missing or
            do not fit the graph's signature, ``repeats``/``warmup`` are out of
            range, or an op is not a node of the graph.
        DeviceError: ``device`` is not usable here.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise SpecError(f"repeats must be an int >= 1 (got {repeats!r}); each op reports the median of its runs")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise SpecError(f"warmup must be an int >= 0 (got {warmup!r})")
    name = normalize_device(device)
    require_usable([name])
    target = torch.device(name)
    if target.type == "cpu":
        target = torch.device("cpu")  # "cpu:1" is a logical device of the one CPU
    elif target.type != "cuda":
        raise SpecError(f"profiling times ops on 'cpu' and 'cuda' devices only (got {name!r}); profile on one of those")
    slots = _slots(graph_module, ops)
    inputs = _inputs(graph_module, args, kwargs)
    trainable = {n for n, p in graph_module.named_parameters(remove_duplicate=False) if p.is_floating_point()}
    copies = replace_graph_tensors(graph_module, functools.partial(_copy_weight, target, trainable if backward else ()))
    clock = _CudaClock(target, len(ops)) if target.type == "cuda" else _WallClock(len(ops))
    runner = _TimedRunner(graph_module, slots, clock, backward=backward)
    runs: list[list[float]] = []
    swapped = _reparametrize_module(graph_module, copies, tie_weights=True, strict=False)
    if target.type == "cuda":  # dropout draws from the generators: put them back after
        index = target.index if target.index is not None else torch.cuda.current_device()
        rng = torch.random.fork_rng(devices=[index], device_type="cuda")
    else:
        rng = torch.random.fork_rng(devices=[])
    with torch.set_grad_enabled(backward), swapped, rng:
        for done in range(warmup + repeats):
            fresh = tree_map_only(torch.Tensor, lambda t: t.detach().to(target, copy=True), inputs)
            clock.begin()
            runner.run(*fresh)
            times = clock.end()
            if done >= warmup:
                runs.append(times)
    return [statistics.median(run[i] for run in runs) for i in range(len(ops))]


def _slots(graph_module: torch.fx.GraphModule, ops: Sequence[torch.fx.Node]) -> dict[torch.fx.Node, int]:
    nodes = set(graph_module.graph.nodes)
    slots: dict[torch.fx.Node, int] = {}
    for i, op in enumerate(ops):
        if op not in nodes:
            raise SpecError(
                f"ops[{i}] ({getattr(op, 'name', op)!r}) is not a node of this graph; pass the ops of the "
                "graph being profiled (Planned.costs.ops with Planned.traced.graph_module)"
            )
        if op.op not in ("call_function", "call_method", "call_module"):
            raise SpecError(f"ops[{i}] ({op.name!r}) is a {op.op} node, not an op; only calls can be timed")
        if op in slots:
            raise SpecError(f"ops[{i}] ({op.name!r}) is listed twice (also ops[{slots[op]}])")
        slots[op] = i
    return slots


def _inputs(graph_module: torch.fx.GraphModule, args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None) -> Any:
    """The graph's placeholder values for the user's inputs, refusing what cannot run."""
    placeholders = [n.name for n in graph_module.graph.nodes if n.op == "placeholder"]
    if args is None and not kwargs and placeholders:
        raise SpecError(f"{_REFUSAL} no example inputs were given for {', '.join(placeholders)}; {_FIX}")
    args = tuple(args) if isinstance(args, (tuple, list)) else ((args,) if args is not None else ())
    try:
        values = flat_inputs(graph_module, args, dict(kwargs or {}))
    except TypeError as error:
        raise SpecError(f"{_REFUSAL} the example inputs do not fit the graph's inputs ({error}); {_FIX}") from None
    for position, value in enumerate(tree_leaves(values)):
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise SpecError(f"{_REFUSAL} example input {position} is on the meta device (no data); {_FIX}")
    return values


def _copy_weight(device: torch.device, trainable: Any, name: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "meta":
        raise SpecError(f"{_REFUSAL} {name!r} is on the meta device (no data); {_FIX}")
    return tensor.detach().to(device, copy=True).requires_grad_(name in trainable)


class _WallClock:
    """Host time around each op: right for the CPU, whose ops finish before they return."""

    def __init__(self, count: int) -> None:
        self.times = [0.0] * count

    def begin(self) -> None:
        self.times = [0.0] * len(self.times)

    def start(self) -> Any:
        return time.perf_counter()

    def stop(self, slot: int, started: Any) -> None:
        self.times[slot] += time.perf_counter() - started

    def end(self) -> list[float]:
        return list(self.times)


class _CudaClock:
    """CUDA events around each op, read after one synchronisation at the end of the run."""

    def __init__(self, device: torch.device, count: int) -> None:
        self.device = device
        self.count = count
        self.pairs: list[tuple[int, Any, Any]] = []

    def begin(self) -> None:
        self.pairs = []
        torch.cuda.synchronize(self.device)  # the copies of the inputs are done before the first op

    def start(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stop(self, slot: int, started: Any) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self.pairs.append((slot, started, event))

    def end(self) -> list[float]:
        torch.cuda.synchronize(self.device)
        times = [0.0] * self.count
        for slot, started, stopped in self.pairs:
            times[slot] += started.elapsed_time(stopped) / 1000.0  # milliseconds
        return times


def _own_input(leaves: list[torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    """A floating input as a leaf of its own that takes a gradient (kept in ``leaves``), passed on through a
    copy so that an op that writes its input in place may (autograd refuses that on a leaf); others as they are."""
    if not tensor.is_floating_point() or tensor.requires_grad:
        return tensor
    leaf = tensor.detach().requires_grad_(True)
    leaves.append(leaf)
    return leaf.clone()


class _TimedRunner(torch.fx.Interpreter):
    """Runs every node; times the call of each node in ``slots``, with its arguments already fetched."""

    def __init__(
        self,
        graph_module: torch.fx.GraphModule,
        slots: dict[torch.fx.Node, int],
        clock: _WallClock | _CudaClock,
        *,
        backward: bool = False,
    ) -> None:
        super().__init__(graph_module, garbage_collect_values=True)
        self.slots = slots
        self.clock = clock
        self.backward = backward

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            return self._timed(n) if n in self.slots else super().run_node(n)
        except AssertionError as error:
            if not is_guard(n):
                raise
            first = (str(error).strip().splitlines() or [""])[0]  # export's check of the inputs' sizes and values
            self.extra_traceback = False  # this message says it all; torch's "While executing ..." is for op errors
            raise SpecError(
                f"{_REFUSAL} the example inputs do not match what torch.export traced ({first}); profile with "
                "inputs like the traced ones (with pipeline=, one micro-batch of them)"
            ) from None

    def _timed(self, n: torch.fx.Node) -> Any:
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            leaves: list[torch.Tensor] = []
            if self.backward:  # inputs of its own, so that the backward below is this op's alone
                args, kwargs = tree_map_only(torch.Tensor, functools.partial(_own_input, leaves), (args, kwargs))
            call = self._call(n, tuple(args), dict(kwargs))
            started = self.clock.start()
            value = call()
            self.clock.stop(self.slots[n], started)
            if self.backward:
                self._backward(n, value, leaves)
                value = tree_map_only(torch.Tensor, torch.Tensor.detach, value)
        return value

    def _backward(self, n: torch.fx.Node, value: Any, leaves: list[torch.Tensor]) -> None:
        """Time the gradients of ``n``'s inputs and of the parameters it reads, from a gradient of ones."""
        outputs = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        wanted = leaves + [p for p in self._parameters_of(n) if p.requires_grad]
        if not outputs or not wanted:
            return
        ones = [torch.ones_like(t) for t in outputs]
        started = self.clock.start()
        torch.autograd.grad(outputs, wanted, ones, allow_unused=True)
        self.clock.stop(self.slots[n], started)

    def _parameters_of(self, n: torch.fx.Node) -> list[torch.Tensor]:
        if n.op == "call_module":
            return list(self.fetch_attr(str(n.target)).parameters())
        return [
            self.env[a] for a in n.all_input_nodes if a.op == "get_attr" and isinstance(self.env.get(a), torch.Tensor)
        ]

    def _call(self, n: torch.fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any]:
        if n.op == "call_module":
            return functools.partial(self.fetch_attr(str(n.target)), *args, **kwargs)
        if n.op == "call_method":
            return functools.partial(getattr(args[0], str(n.target)), *args[1:], **kwargs)
        function = n.target
        if not callable(function):  # pragma: no cover - fx gives call_function nodes a callable target
            raise SpecError(f"node {n.name!r} calls {function!r}, which is not callable")
        return functools.partial(function, *args, **kwargs)
