"""Cut a split ``GraphModule`` into an ordered list of per-device stages.

The stages are the plan's devices, in the plan's order, that run at least one
op; stage ``s`` holds the ops (and the ``.to(device)`` copies into its device)
that the generated graph runs on that device. Values flow only forward: a
value made on a later stage and read on an earlier one cannot be pipelined,
and :func:`split_stages` says which value and how to change the plan.

Two ways to hand values from stage to stage:

* direct (``relay=False``, in-process pipelining): a stage's inputs are the
  values it reads from earlier stages (and the model inputs it reads); its
  outputs are the values any later stage or the final output reads. Each
  weight lives in exactly one stage, its home: another stage that reads it
  receives it as an input, and autograd sums its gradients into the one
  tensor.
* relay (``relay=True``, one process per stage): stage ``s`` talks only to
  ``s - 1`` and ``s + 1``, as ``torch.distributed.pipelining`` requires. Its
  inputs are every value live across the boundary before it (a skip
  connection passes through the stages in between); stage 0 takes the model's
  inputs with the model's signature, and the last stage returns the model's
  output structure. Weights read by several stages are *replicated* into each
  of them (see :mod:`fxsplit.pipeline.distributed` for the gradient reduction), so no
  stage ever sends a weight.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.fx
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

from fxsplit.attrpath import attr_at
from fxsplit.codegen.meta import COPY_META, DEVICE_META
from fxsplit.codegen.splitbase import Reloadable
from fxsplit.errors import FxsplitError
from fxsplit.pipeline.gradlayout import contiguous_grad, may_be_floating
from fxsplit.planning.plan import Plan
from fxsplit.tracing.gradmode import open_regions
from fxsplit.tracing.graphinfo import TENSOR, module_path, value_kind
from fxsplit.tracing.keyworddefaults import calls_like

__all__ = ["StageSpec", "StageSplit", "split_stages"]


@dataclass(frozen=True)
class StageSpec:
    """One stage as plain data.

    Attributes:
        index: position in the pipeline.
        device: where its ops run.
        inputs: names of the values it takes, in the order of its ``forward``
            arguments (graph node names of the split module).
        outputs: names of the values it returns, in order.
        nodes: the graph nodes it computes, in graph order.
    """

    index: int
    device: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass
class StageSplit:
    """The stages of a split graph, and how the model's inputs and outputs map onto them.

    Attributes:
        specs: one :class:`StageSpec` per stage.
        modules: one ``GraphModule`` per stage; they share the split module's
            weights and submodules (nothing is copied).
        input_names: the model's flat inputs (placeholder names), in order.
        input_targets: the argument names of those inputs.
        relay: how values are handed on (see the module docstring).
        release: per stage, the values no later stage or output reads after
            it ran (direct mode), so a runner can drop them.
    """

    specs: tuple[StageSpec, ...]
    modules: tuple[torch.fx.GraphModule, ...]
    input_names: tuple[str, ...]
    input_targets: tuple[str, ...]
    relay: bool
    release: tuple[tuple[str, ...], ...]
    _binder: torch.fx.GraphModule
    _template: Any
    _moves: dict[str, tuple[str, str]]
    _out_spec: Any

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        """The model's inputs, called like the model, as a flat tuple in ``input_names`` order."""
        return tuple(self._binder(*args, **kwargs))

    def restore(self, values: Mapping[str, Any]) -> Any:
        """The model's output structure from the values of one run (direct mode)."""
        from fxsplit.runtime import move

        def fill(arg: Any) -> Any:
            if not isinstance(arg, _Ref):
                return arg
            if arg.name in self._moves:
                source, device = self._moves[arg.name]
                return move(values[source], device)
            return values[arg.name]

        flat = _thaw(torch.fx.node.map_aggregate(self._template, fill))
        if self._out_spec is None:
            return flat
        return pytree.tree_unflatten(list(flat) if isinstance(flat, (tuple, list)) else [flat], self._out_spec)


def split_stages(graph_module: torch.fx.GraphModule, plan: Plan, *, relay: bool = False) -> StageSplit:
    """Cut the module made by ``fxsplit.fxsplit`` (or ``codegen.emit``) into stages.

    Args:
        graph_module: the split module; its nodes carry ``meta["fxsplit_device"]``.
        plan: the plan that produced it (for the device order).
        relay: hand values only to the next stage (one process per stage)
            instead of straight to their readers (one process).

    Raises:
        FxsplitError: a value goes back to an earlier stage (names the value,
            both devices and what to change), or, with ``relay``, a value that
            is not a tensor must cross a process boundary.
    """
    return _Cutter(graph_module, plan, relay).run()


class _Cutter:
    def __init__(self, graph_module: torch.fx.GraphModule, plan: Plan, relay: bool) -> None:
        self.gm = graph_module
        self.relay = relay
        self.nodes = list(graph_module.graph.nodes)
        self.order = {n.name: i for i, n in enumerate(self.nodes)}
        self.output = next(n for n in self.nodes if n.op == "output")
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.moves = {n.name: n for n in self.nodes if _is_output_move(n, self.output)}
        ops = [n for n in self.nodes if n.op.startswith("call_") and n.name not in self.moves]
        for node in ops:
            if DEVICE_META not in node.meta:
                raise FxsplitError(
                    f"node '{node.name}' has no device; split_stages needs a module made by "
                    "fxsplit.fxsplit (its nodes record their device)"
                )
        used = {n.meta[DEVICE_META] for n in ops}
        self.devices = tuple(d for d in plan.devices if d in used) or (plan.output_device,)
        self.index = {d: i for i, d in enumerate(self.devices)}
        self.stage: dict[str, int] = {n.name: self.index[n.meta[DEVICE_META]] for n in ops}
        for node in self.nodes:
            if node.op == "get_attr" and not relay and node.users and self._is_weight(node):
                device = node.meta.get(DEVICE_META)
                if device in self.index:
                    self.stage[node.name] = self.index[device]
            elif node.op == "placeholder" and relay:
                self.stage[node.name] = 0

    def _is_weight(self, node: torch.fx.Node) -> bool:
        return isinstance(attr_at(self.gm, str(node.target), None), torch.Tensor)

    def _is_free(self, node: torch.fx.Node) -> bool:
        """Duplicated into every stage that reads it (attributes that are not homed weights)."""
        return node.op == "get_attr" and node.name not in self.stage

    def _held_weight(self, node: torch.fx.Node) -> torch.fx.Node | None:
        """The weight a ``.to(device)`` copy reads, where the stage holds the weight itself (relay), else None.

        Each process's stage has its own copy of every weight it reads, moved to its device by
        ``build_stage``, so the copy the one-process module makes there is dropped: on a GPU ``.to`` of a
        tensor already there returns it, but on the logical ``cpu:N`` devices it copies every call (GPT-2's
        tied 147 MiB head weight, every micro-batch, forward and backward).
        """
        if not self.relay or not self._is_copy(node):
            return None
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and self._is_free(source) and self._is_weight(source):
            return source
        return None

    def _received(self, node: torch.fx.Node, spec: StageSpec) -> torch.fx.Node | None:
        """The stage input a ``.to(device)`` copy reads, where the input arrives on the stage's device (relay,
        after the first stage: ``torch.distributed.pipelining`` receives it there), else None: the copy the
        one-process module makes there is dropped, as :meth:`_held_weight` drops a weight's (on ``cpu:N``
        ``.to`` copies even a tensor already there)."""
        if not self.relay or spec.index == 0 or not self._is_copy(node):
            return None
        source = node.args[0]
        return source if isinstance(source, torch.fx.Node) and source.name in spec.inputs else None

    @staticmethod
    def _is_copy(node: torch.fx.Node) -> bool:
        """A ``.to(device)`` the code generator inserted (not one of the model's own)."""
        return COPY_META in node.meta and node.op == "call_method" and node.target == "to"

    def _source(self, node: torch.fx.Node) -> torch.fx.Node:
        """What the output really reads: output moves stand for the value they move."""
        if node.name in self.moves:
            arg = self.moves[node.name].args[0]
            assert isinstance(arg, torch.fx.Node)
            return self._source(arg)
        return node

    def run(self) -> StageSplit:
        self._check_grad_regions()
        last = len(self.devices) - 1
        readers: dict[str, set[int]] = {}
        for node in self.nodes:
            if node.name in self.stage:
                for arg in node.all_input_nodes:
                    self._check_forward(arg, node)
                    readers.setdefault(arg.name, set()).add(self.stage[node.name])
        # The output reads on the last stage (relay) or after every stage (direct, where the
        # runner gathers the results and makes the moves to output_device itself).
        at_end = last if self.relay else last + 1
        for node in self.output.all_input_nodes:
            readers.setdefault(self._source(node).name, set()).add(at_end)
        inputs, outputs = self._relay_sets(readers) if self.relay else self._direct_sets(readers)
        specs, modules = [], []
        for s, device in enumerate(self.devices):
            nodes = tuple(n.name for n in self.nodes if self.stage.get(n.name) == s and n.op != "placeholder")
            specs.append(StageSpec(s, device, inputs[s], outputs[s], nodes))
            modules.append(self._build(specs[-1], s == last))
        release = self._release(specs, readers)
        return StageSplit(
            specs=tuple(specs),
            modules=tuple(modules),
            input_names=tuple(p.name for p in self.placeholders),
            input_targets=tuple(str(p.target) for p in self.placeholders),
            relay=self.relay,
            release=release,
            _binder=self._binder(),
            _template=torch.fx.node.map_arg(self.output.args[0], lambda n: _Ref(n.name)),  # type: ignore[arg-type,return-value]
            _moves={name: (self._source(n).name, n.meta[COPY_META].destination) for name, n in self.moves.items()},
            _out_spec=self._out_spec(),
        )

    def _check_grad_regions(self) -> None:
        """Refuse a ``no_grad`` (or ``enable_grad``, ``set_grad_enabled``) region that spans two stages.

        Stages of different micro-batches interleave, so a grad mode set on one
        stage and restored on another would leak into the stages run between.
        """
        ops = [n for n in self.nodes if n.name in self.stage and n.op.startswith("call_")]
        after = dict(zip(ops, open_regions(ops, after=True), strict=True))  # open once the node has run
        for before, node in itertools.pairwise(ops):
            if self.stage[before.name] != self.stage[node.name] and after[before] > 0:
                path = module_path(node) or node.name
                raise FxsplitError(
                    "this plan cannot run as a pipeline: a grad-mode or autocast region (torch.no_grad(), "
                    "enable_grad(), set_grad_enabled() or torch.autocast()) in forward() spans stages "
                    f"{self.devices[self.stage[before.name]]} and {self.devices[self.stage[node.name]]} "
                    f"(at '{node.name}' in '{path}'); each stage runs on its "
                    "own, so the mode would leak between micro-batches. Fix: keep the region's modules on one "
                    "device (together=[[...]] or pins=...), or split without pipeline=..."
                )

    def _check_forward(self, value: torch.fx.Node, reader: torch.fx.Node) -> None:
        made, used = self.stage.get(value.name), self.stage[reader.name]
        if made is None or made <= used:
            return
        readers = [u for u in reader.users if COPY_META not in u.meta] if COPY_META in reader.meta else [reader]
        who = readers[0] if readers else reader
        name = reader.meta[COPY_META].producer if COPY_META in reader.meta else value.name
        path = module_path(who) or who.name
        here, there = self.devices[made], self.devices[used]
        raise FxsplitError(
            f"this plan cannot run as a pipeline: '{name}' comes from {here} (stage {made}) but '{who.name}' "
            f"(in '{path}') reads it on {there} (stage {used}); stages run in device order "
            f"{' -> '.join(self.devices)}, so values may only flow to later stages. Fix: list {here} before "
            f"{there} in the budgets, or pin '{path}' to {here} (pins={{{path!r}: {here!r}}}), or split without "
            "pipeline=..."
        )

    def _direct_sets(self, readers: dict[str, set[int]]) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
        count = len(self.devices)
        inputs: list[list[str]] = [[] for _ in range(count)]
        outputs: list[list[str]] = [[] for _ in range(count)]
        for node in self.nodes:
            made = self.stage.get(node.name, -1 if node.op == "placeholder" else None)
            if made is None:
                continue
            for s in sorted(readers.get(node.name, ())):
                if s > made and s < count:
                    inputs[s].append(node.name)
            if made >= 0 and any(s > made for s in readers.get(node.name, ())):
                outputs[made].append(node.name)
        return [tuple(i) for i in inputs], [tuple(o) for o in outputs]

    def _relay_sets(self, readers: dict[str, set[int]]) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
        count = len(self.devices)
        live: list[list[str]] = [[] for _ in range(count)]
        for node in self.nodes:
            made = self.stage.get(node.name)
            if made is None or not readers.get(node.name):
                continue
            for boundary in range(made, max(readers[node.name])):
                if value_kind(node) != TENSOR:
                    raise FxsplitError(
                        f"'{node.name}' ({_describe(node)}) must go from stage {made} ({self.devices[made]}) to "
                        f"stage {boundary + 1} ({self.devices[boundary + 1]}), but pipeline stages in separate "
                        "processes exchange tensors only; pass example_inputs so fxsplit knows every value's "
                        "type (torch.export turns sizes into constants), or pin its readers to the same device"
                    )
                live[boundary].append(node.name)
        inputs = [tuple(p.name for p in self.placeholders)] + [tuple(v) for v in live[:-1]]
        return inputs, [tuple(v) for v in live[:-1]] + [()]

    def _release(self, specs: list[StageSpec], readers: dict[str, set[int]]) -> tuple[tuple[str, ...], ...]:
        if self.relay:
            return tuple(() for _ in specs)
        done: list[list[str]] = [[] for _ in specs]
        for name, stages in readers.items():
            if stages and max(stages) < len(specs):
                done[max(stages)].append(name)
        return tuple(tuple(sorted(d, key=self.order.__getitem__)) for d in done)

    def _build(self, spec: StageSpec, is_last: bool) -> torch.fx.GraphModule:
        graph = torch.fx.Graph()
        env: dict[str, torch.fx.Node] = {}
        by_name = {n.name: n for n in self.nodes}
        if self.relay and spec.index == 0:
            for node in self.placeholders:
                env[node.name] = graph.node_copy(node)
        else:
            for name in spec.inputs:
                env[name] = graph.placeholder(name)
                env[name].meta.update({k: v for k, v in by_name[name].meta.items() if k in ("val", "tensor_meta")})
            if self.relay:  # what a stage hands back to the one before it must be contiguous (see contiguous_grad)
                for name in spec.inputs:
                    if may_be_floating(env[name]):
                        received = env[name]
                        env[name] = graph.call_function(contiguous_grad, (received,))
                        env[name].meta.update(received.meta)

        def arg(node: torch.fx.Node) -> torch.fx.Node:
            if node.name not in env:
                if not self._is_free(node):
                    raise AssertionError(f"stage {spec.index} reads '{node.name}', which it was not given")
                env[node.name] = graph.node_copy(node)
            return env[node.name]

        for name in spec.nodes:
            held = self._held_weight(by_name[name]) or self._received(by_name[name], spec)
            env[name] = arg(held) if held is not None else graph.node_copy(by_name[name], arg)
        if self.relay and is_last:
            graph.output(torch.fx.node.map_arg(self.output.args[0], lambda n: arg(self._source(n))))
        elif self.relay:  # sent to the next process: gloo sends and receives contiguous tensors only (a cut at a
            # transpose or a slice gave the receiver a strided buffer: "input tensor has to be contiguous")
            graph.output(tuple(graph.call_method("contiguous", (arg(by_name[name]),)) for name in spec.outputs))
        else:
            graph.output(tuple(arg(by_name[name]) for name in spec.outputs))
        self._set_codegen(graph, spec, is_last)
        graph.lint()
        module = Reloadable(self.gm, graph, f"Stage{spec.index}")  # (torch.save keeps its mode regions)
        module.recompile()
        return module

    def _set_codegen(self, graph: torch.fx.Graph, spec: StageSpec, is_last: bool) -> None:
        codegen = self.gm.graph._codegen
        if not self.relay or not isinstance(codegen, _PyTreeCodeGen) or (spec.index > 0 and not is_last):
            return
        info = codegen.pytree_info
        if spec.index == 0:
            orig_args, in_spec = info.orig_args, info.in_spec
        else:
            orig_args, in_spec = list(spec.inputs), pytree.tree_structure((tuple(range(len(spec.inputs))), {}))
        graph.set_codegen(calls_like(codegen, _PyTreeInfo(orig_args, in_spec, info.out_spec if is_last else None)))

    def _binder(self) -> torch.fx.GraphModule:
        """A module that takes the model's arguments and returns its flat inputs."""
        graph = torch.fx.Graph()
        copies = [graph.node_copy(p) for p in self.placeholders]
        graph.output(tuple(copies))
        codegen = self.gm.graph._codegen
        if isinstance(codegen, _PyTreeCodeGen):
            info = codegen.pytree_info
            graph.set_codegen(calls_like(codegen, _PyTreeInfo(info.orig_args, info.in_spec, None)))  # its defaults too
        binder = torch.fx.GraphModule(torch.nn.Module(), graph, "Inputs")
        binder.recompile()
        return binder

    def _out_spec(self) -> Any:
        codegen = self.gm.graph._codegen
        return codegen.pytree_info.out_spec if isinstance(codegen, _PyTreeCodeGen) else None


def _thaw(value: Any) -> Any:
    """fx keeps output containers as immutable_dict / immutable_list; the model returned dicts and lists."""
    if isinstance(value, torch.fx.immutable_collections.immutable_dict):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, torch.fx.immutable_collections.immutable_list):
        return [_thaw(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_thaw(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _thaw(v)) for k, v in value.items())
    return value


def _is_output_move(node: torch.fx.Node, output: torch.fx.Node) -> bool:
    return COPY_META in node.meta and bool(node.users) and all(u is output for u in node.users)


def _describe(node: torch.fx.Node) -> str:
    value = node.meta.get("val")
    if value is None:
        return "of unknown type"
    return f"a {type(value).__name__}"
