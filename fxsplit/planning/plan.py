"""The plan: what goes where, as inert data.

A :class:`Plan` names graph nodes and model parameters by strings, holds no
torch objects, and can be printed, compared, saved and applied later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fxsplit.options import usable_bytes
from fxsplit.planning.ranges import summarize_modules
from fxsplit.units import format_size

__all__ = ["CUT_KINDS", "Cut", "Plan", "Replica", "RowSplit"]

CUT_KINDS = ("activation", "input", "parameter", "output", "stream")


@dataclass(frozen=True)
class Cut:
    """One value sent from one device to another (a ``.to(device)`` in the generated code).

    Attributes:
        producer: the graph node whose value is sent (for parameters, the
            parameter's qualified name).
        source: the device the value lives on.
        destination: the device it is copied to.
        nbytes: bytes copied per forward, or None when shapes are unknown.
        kind: ``"activation"``, ``"input"`` (a model input needed on a second
            device), ``"parameter"`` (a weight used on a device other than its
            home), ``"output"`` (a result moved to ``output_device``) or
            ``"stream"`` (an offloaded weight copied from its storage,
            ``"host"`` or ``"disk"``, to the device of one op that reads it;
            one such cut per reading op).
    """

    producer: str
    source: str
    destination: str
    nbytes: int | None
    kind: str = "activation"


@dataclass(frozen=True)
class Replica:
    """The extra devices that hold their own copy of a read-only weight (inference plans only).

    Attributes:
        devices: the devices besides the weight's home (``param_devices``)
            that hold a copy, in device order; ops there read that copy, so
            the weight is not copied to them each forward.
        nbytes: bytes of one copy, charged to every device that holds one.
    """

    devices: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class RowSplit:
    """A linear op computed in pieces of its output features, each from its rows of the weight (pipeline stages).

    Attributes:
        weight: the canonical name of the weight whose rows are split (the first of a ``tied`` group).
        bounds: row bounds ``(0, b1, ..., rows)``: piece ``k`` (node ``<op>_rows<k>``) computes outputs
            ``b_k:b_{k+1}`` from those rows, held as ``_fxsplit_rows.<op>_rows<k>_weight`` (and ``_bias``).
    """

    weight: str
    bounds: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """Where every node, parameter and buffer of a model goes.

    Attributes:
        devices: the devices, in stage order (the budgets' order).
        budgets: each device's full budget in bytes, as given (sizes and
            ``"auto"`` resolved), before ``reserved`` is held back; what
            planning filled is :attr:`usable`.
        placement: graph node name -> device, for every node of the traced
            graph (inputs: the device of their first use; the output node:
            ``output_device``).
        param_devices: qualified name of every parameter and buffer of the
            original model (tied names included) -> device.
        device_bytes: device -> bytes of parameters and buffers placed there.
        cuts: every copy between devices, in the order the forward makes them.
        output_device: where the outputs are returned.
        trace: how the graph was traced, ``"fx"`` or ``"export"``.
        objective: what the partitioner optimised.
        modules: device -> module paths with ops placed there, in order.
        fingerprint: hash of the model's structure (names, shapes and dtypes
            of its parameters and buffers, and which are tied), or None.
        tensors: qualified name -> ``"float32[256, 256]"`` for every parameter
            and buffer: what the fingerprint hashes, kept so that a mismatch
            can say what differs.
        tied: groups of names that are one tensor (tied embeddings, shared
            layers); each group lives on one device, copied where the plan's
            ``"parameter"`` cuts say.
        reserved: device -> bytes held back from its budget (``reserve``);
            planning used ``budgets[d] - reserved[d]`` (:attr:`usable`). A
            device not named holds nothing back.
        dtype: the floating dtype planned for (``"bfloat16"``), or None for
            the model's own dtypes.
        leaf_modules: module paths or class names traced as leaves, so that
            the plan can be applied to a fresh trace.
        memory: device -> bytes per component of memory the device needs:
            ``params``, ``buffers``, ``grads``, ``optimizer``,
            ``activations_peak`` (absent when activations were not counted)
            and ``total`` (what the budget holds); see :mod:`fxsplit.memory`.
            Empty for plans made without a memory model.
        dynamic_shapes: which input sizes the export graph kept variable:
            ``"batch"``, ``"all"``, ``"custom"`` (a torch.export spec, to be
            passed again when applying), or None (the example's sizes only;
            always None for fx graphs, which take any size).
        streamed: qualified name (tied names included) -> where the weight is
            stored, ``"host"`` or ``"disk"``, for every weight that is not kept
            on a device but copied to it right before each op that reads it
            (the ``"stream"`` cuts); its ``param_devices`` entry is the device
            of those ops. Empty when everything is resident.
        offload: the offload option the plan was made with (``host`` and
            ``disk`` budgets in bytes, ``dir``, ``prefetch``), or empty.
        stored_bytes: storage tier -> bytes of the weights stored there.
        constants: name -> ``"float32[...]"`` of tensors the plan places that
            only the traced graph holds (``torch.export`` lifts tensor
            attributes that are neither parameters nor buffers, such as a
            static KV cache, into constants); not part of the fingerprint.
        mutated: name -> bytes of each parameter or buffer the forward writes
            in place (a KV cache, running statistics): it lives on the device
            of the ops that write it and keeps its value there between calls.
        timing: time estimates, when the plan was made for time (a time
            objective, a pipeline, ``hardware`` or ``profile``), else empty:
            ``source`` (``"estimate"`` or ``"profile"``), ``chunks`` (the
            pipeline's micro-batches, or None), ``training`` and ``stages``:
            device -> ``{"compute": s, "copies": s}``, the seconds its ops
            take and the copies it receives, per forward (per micro-batch
            with a pipeline; per training step in training). See
            :mod:`fxsplit.planning.timetable`.
        replicas: canonical name (the first of a ``tied`` group) -> :class:`Replica`,
            for each read-only parameter or buffer held on more devices than
            its home, because that copies fewer bytes per forward than
            copying it or the activations around it (``mode="inference"`` or
            ``"weights"`` only; never in training, nor for streamed or
            written tensors). ``device_bytes`` and ``memory`` count it on
            every device that holds it. Empty when nothing is replicated.
        activations_not_counted: why the plan does not count activations
            (and, without sizes, cut bytes) although its memory mode does,
            e.g. ``"no example_inputs, so the graph has no sizes"``; None
            when they are counted or the mode does not count them.
        memory_counts: what ``memory`` counts, in words: the mode and, in training, the optimizer and the step
            torch runs for it (``"mode='training', optimizer='adamw', for-loop step"``); None in plan files
            made before it was recorded.
        row_splits: op name -> :class:`RowSplit`, for each linear op whose output features are computed in
            pieces on the devices ``placement`` gives them, each piece's rows of the weight a tensor of its own
            (a ``constants`` entry, placed by ``param_devices``); the op's node concatenates them
            (:mod:`fxsplit.tracing.rowsplit`). Only :func:`fxsplit.pipeline_stages` runs such a plan; empty when
            no op is split.
    """

    devices: tuple[str, ...]
    budgets: dict[str, int]
    placement: dict[str, str]
    param_devices: dict[str, str]
    device_bytes: dict[str, int]
    cuts: tuple[Cut, ...]
    output_device: str
    trace: str = "fx"
    objective: str = "min_transfer"
    modules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fingerprint: str | None = None
    tensors: dict[str, str] = field(default_factory=dict)
    tied: tuple[tuple[str, ...], ...] = ()
    reserved: dict[str, int] = field(default_factory=dict)
    dtype: str | None = None
    leaf_modules: tuple[str, ...] = ()
    memory: dict[str, dict[str, int]] = field(default_factory=dict)
    dynamic_shapes: str | None = None
    activations_not_counted: str | None = None
    streamed: dict[str, str] = field(default_factory=dict)
    offload: dict[str, Any] = field(default_factory=dict)
    stored_bytes: dict[str, int] = field(default_factory=dict)
    constants: dict[str, str] = field(default_factory=dict)
    mutated: dict[str, int] = field(default_factory=dict)
    timing: dict[str, Any] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    memory_counts: str | None = None
    row_splits: dict[str, RowSplit] = field(default_factory=dict)

    def holders(self, name: str) -> tuple[str, ...]:
        """The devices that hold tensor ``name`` (canonical name): its home, then its replicas' devices."""
        replica = self.replicas.get(name)
        return (self.param_devices[name], *(replica.devices if replica else ()))

    @property
    def usable(self) -> dict[str, int]:
        """Device -> bytes planning let it hold: its budget less its reserve (never negative)."""
        return {d: usable_bytes(b, self.reserved.get(d, 0)) for d, b in self.budgets.items()}

    @property
    def transfer_bytes(self) -> int:
        """Bytes copied between devices per forward, outputs and streamed weights excluded (unknown sizes count 0)."""
        return sum(c.nbytes or 0 for c in self.cuts if c.kind not in ("output", "stream"))

    @property
    def copied_bytes(self) -> int:
        """Bytes copied between devices per forward, the outputs' copies to ``output_device`` included: what the
        default partition minimises (streamed weights excluded; unknown sizes count 0)."""
        return sum(c.nbytes or 0 for c in self.cuts if c.kind != "stream")

    @property
    def stream_bytes(self) -> int:
        """Bytes of offloaded weights copied from storage to the devices per forward."""
        return sum(c.nbytes or 0 for c in self.cuts if c.kind == "stream")

    def streamed_into(self, device: str) -> int:
        """Bytes of offloaded weights streamed into ``device`` per forward."""
        return sum(c.nbytes or 0 for c in self.cuts if c.kind == "stream" and c.destination == device)

    def cuts_into(self, device: str) -> tuple[Cut, ...]:
        """The copies whose destination is ``device``."""
        return tuple(c for c in self.cuts if c.destination == device)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain Python data (dicts, lists, strings, ints)."""
        return {
            "devices": list(self.devices),
            "budgets": dict(self.budgets),
            "placement": dict(self.placement),
            "param_devices": dict(self.param_devices),
            "device_bytes": dict(self.device_bytes),
            "cuts": [
                {
                    "producer": c.producer,
                    "source": c.source,
                    "destination": c.destination,
                    "nbytes": c.nbytes,
                    "kind": c.kind,
                }
                for c in self.cuts
            ],
            "output_device": self.output_device,
            "trace": self.trace,
            "objective": self.objective,
            "modules": {d: list(m) for d, m in self.modules.items()},
            "fingerprint": self.fingerprint,
            "tensors": dict(self.tensors),
            "tied": [list(group) for group in self.tied],
            "reserved": dict(self.reserved),
            "dtype": self.dtype,
            "leaf_modules": list(self.leaf_modules),
            "memory": {d: dict(row) for d, row in self.memory.items()},
            "dynamic_shapes": self.dynamic_shapes,
            "activations_not_counted": self.activations_not_counted,
            "streamed": dict(self.streamed),
            "offload": dict(self.offload),
            "stored_bytes": dict(self.stored_bytes),
            "constants": dict(self.constants),
            "mutated": dict(self.mutated),
            "timing": dict(self.timing),
            "replicas": {n: {"devices": list(r.devices), "nbytes": r.nbytes} for n, r in self.replicas.items()},
            "memory_counts": self.memory_counts,
            "row_splits": {op: {"weight": r.weight, "bounds": list(r.bounds)} for op, r in self.row_splits.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`."""
        return cls(
            devices=tuple(data["devices"]),
            budgets=dict(data["budgets"]),
            placement=dict(data["placement"]),
            param_devices=dict(data["param_devices"]),
            device_bytes=dict(data["device_bytes"]),
            cuts=tuple(Cut(**c) for c in data["cuts"]),
            output_device=data["output_device"],
            trace=data.get("trace", "fx"),
            objective=data.get("objective", "min_transfer"),
            modules={d: tuple(m) for d, m in data.get("modules", {}).items()},
            fingerprint=data.get("fingerprint"),
            tensors=dict(data.get("tensors", {})),
            tied=tuple(tuple(group) for group in data.get("tied", ())),
            reserved=dict(data.get("reserved", {})),
            dtype=data.get("dtype"),
            leaf_modules=tuple(data.get("leaf_modules", ())),
            memory={d: dict(row) for d, row in data.get("memory", {}).items()},
            dynamic_shapes=data.get("dynamic_shapes"),
            activations_not_counted=data.get("activations_not_counted"),
            streamed=dict(data.get("streamed", {})),
            offload=dict(data.get("offload", {})),
            stored_bytes=dict(data.get("stored_bytes", {})),
            constants=dict(data.get("constants", {})),
            mutated=dict(data.get("mutated", {})),
            timing=dict(data.get("timing", {})),
            replicas={n: Replica(tuple(r["devices"]), int(r["nbytes"])) for n, r in data.get("replicas", {}).items()},
            memory_counts=data.get("memory_counts"),
            row_splits={op: RowSplit(r["weight"], tuple(r["bounds"])) for op, r in data.get("row_splits", {}).items()},
        )

    def to_yaml(self) -> str:
        """The plan as a YAML document a person can read and a program can load exactly.

        Per device its budget, bytes used and modules (ranges like
        ``layers.0-11``), then the cuts with their bytes, then the full
        placement. ``Plan.from_yaml(plan.to_yaml()) == plan``.
        """
        from fxsplit.planning.yamlio import plan_to_yaml

        return plan_to_yaml(self)

    @classmethod
    def from_yaml(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_yaml` (safe YAML only; never runs code).

        Raises:
            SpecError: the text is not a plan file, naming what is wrong.
        """
        from fxsplit.planning.yamlio import plan_from_yaml

        return plan_from_yaml(text)

    def __str__(self) -> str:
        from fxsplit.planning import summary

        reserving = any(self.reserved.values())
        header = (
            "device",
            "budget",
            *(("reserve",) if reserving else ()),
            "weights",
            *(("streamed",) if self.streamed else ()),
            "% budget",
            "modules",
            "in",
            "out",
        )
        rows = [header]
        for device in self.devices:
            budget, used = self.budgets[device], self.device_bytes.get(device, 0)
            percent = f"{100 * used / budget:.1f}" if budget else "-"
            incoming = sum(c.nbytes or 0 for c in self.cuts if c.destination == device and c.kind != "stream")
            outgoing = sum(c.nbytes or 0 for c in self.cuts if c.source == device)
            streamed = (format_size(self.streamed_into(device)),) if self.streamed else ()
            reserve = (format_size(self.reserved.get(device, 0)),) if reserving else ()
            rows.append(
                (
                    device,
                    format_size(budget),
                    *reserve,
                    format_size(used),
                    *streamed,
                    percent,
                    _module_summary(self.modules.get(device, ())),
                    format_size(incoming),
                    format_size(outgoing),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
        copies = [c for c in self.cuts if c.kind != "stream"]
        held = sum(c.nbytes or 0 for c in copies if c.kind == "parameter") if self._stage_copies else 0
        lines.append(
            f"cuts: {len(copies)}, transfer per forward: {self._transfer_text()}"
            + (f" (of which {format_size(held)} of weights each stage holds itself: not sent)" if held else "")
            + f"; outputs on {self.output_device}"
            + (f" (copied there: {format_size(out)} more per forward)" if (out := self._output_bytes) else "")
            + (f"; planned as {self.dtype}" if self.dtype else "")
        )
        lines.extend(summary.offload_lines(self))
        lines.extend(summary.state_lines(self))
        lines.extend(summary.replica_lines(self))
        lines.extend(summary.row_split_lines(self))
        lines.extend(self.tied_summary())
        lines.extend(summary.empty_devices_lines(self))
        if self.memory:
            lines.extend(summary.memory_table(self))
        if self.timing:
            from fxsplit.planning.timetable import time_lines

            lines.extend(time_lines(self.timing))
        if self.activations_not_counted:
            # (a size that depends on the inputs' values, memory/charge.py: no other example inputs would fix it)
            fix = "" if "DataDependentSize" in self.activations_not_counted else " or pass example_inputs"
            lines.append(f"activations not counted: {self.activations_not_counted}; leave room in the budgets{fix}")
        return "\n".join(lines)

    @property
    def _output_bytes(self) -> int:
        return sum(c.nbytes or 0 for c in self.cuts if c.kind == "output")

    @property
    def _stage_copies(self) -> bool:
        """Whether the plan is for stages run one per process, each holding the weights it reads."""
        return bool(self.timing and self.timing.get("stage_copies"))

    def _transfer_text(self) -> str:
        unknown = sum(1 for cut in self.cuts if cut.nbytes is None and cut.kind not in ("output", "stream"))
        sized = format_size(self.transfer_bytes)
        if not unknown:
            return sized
        return f"{sized} + {unknown} cut(s) of unknown size" if self.transfer_bytes else f"unknown ({unknown} cut(s))"

    def tied_summary(self) -> list[str]:
        """One line per group of tied names: where the tensor lives and where it is copied."""
        from fxsplit.planning import summary

        return summary.tied_lines(self)


def _module_summary(paths: tuple[str, ...], limit: int = 48) -> str:
    text = ", ".join(summarize_modules(paths)) or "-"
    return text if len(text) <= limit else text[: limit - 3] + "..."
