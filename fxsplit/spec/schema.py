"""What a validated spec holds: :class:`Spec`; the keys a spec may use; :class:`SpecProblems`, every problem at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fxsplit.hardware import Hardware
from fxsplit.options import Offload, PipelineConfig
from fxsplit.reserve import Headroom
from fxsplit.yamlfile import YamlPath, YamlProblems, format_path

__all__ = ["DEVICE_KEYS", "OFFLOAD_KEYS", "SPEC_KEYS", "Spec", "SpecProblems"]

SPEC_KEYS = (
    "devices",
    "reserve",
    "pin",
    "device_map",
    "together",
    "leaf_modules",
    "trace",
    "output_device",
    "objective",
    "dtype",
    "pipeline",
    "contiguous",
    "mode",
    "optimizer",
    "accumulate_grads",
    "dynamic_shapes",
    "offload",
    "hardware",
    "profile",
    "replicate",
)
DEVICE_KEYS = ("budget", "reserve")
OFFLOAD_KEYS = tuple(Offload.__dataclass_fields__)  # host, disk, dir, prefetch


class SpecProblems(YamlProblems):
    """A spec with problems; ``problems`` lists each, the message shows them (the first 50)."""


@dataclass(frozen=True)
class Spec:
    """A validated partition spec. Fields left out of the file are empty or None.

    Attributes:
        devices: device -> budget in bytes, in stage order.
        reserve: device -> headroom named under that device.
        default_reserve: headroom for every device without its own.
        pins: module path or glob -> device.
        device_map: module or tensor name -> device, as Accelerate writes it: where the weights live.
        together: groups of module patterns whose ops must share a device.
        leaf_modules: module paths or class names fx must not trace into.
        trace: ``"auto"``, ``"fx"`` or ``"export"``.
        output_device: where outputs are returned.
        objective: ``"min_transfer"``, ``"balanced"``, ``"throughput"`` or ``"latency"``.
        dtype: plan as if floating tensors had this dtype (``"bfloat16"``).
        pipeline: micro-batch pipelining (``{chunks: 4, checkpoint: except_last}``), or None.
        contiguous: keep each device's ops one consecutive run, in device order (None: the default, False).
        mode: what the budgets must hold: ``"inference"``, ``"training"`` or ``"weights"``.
        optimizer: the optimizer counted in training (``"adam"``, ``"sgd"``, ..., settings such as
            ``{name: adamw, fused: true}``, or bytes per parameter).
        accumulate_grads: in training, plan for backward passes adding to existing ``.grad`` tensors
            (gradient accumulation) (None: the default, False).
        dynamic_shapes: input sizes a torch.export split keeps variable: ``"batch"`` or ``"all"``.
        offload: where weights the devices cannot hold are stored (``{host: 16GiB, disk: 100GiB,
            dir: offload/}``), or None. A relative ``dir`` in a spec file is relative to the file's folder.
        hardware: device speeds and links for time estimates (``{devices: {cuda: {flops: 300T}}, links:
            {cuda:0 <-> cuda:1: {bandwidth: 300GB/s}}}``), or None.
        profile: time the ops by running them instead of estimating (None: the default, False).
        replicate: let read-only weights be held on several devices when that copies less (None: the
            default, True).
        source: the file name, for messages.
        lines: YAML path -> line number, for messages that come later.
    """

    devices: dict[str, int] = field(default_factory=dict)
    reserve: dict[str, Headroom] = field(default_factory=dict)
    default_reserve: Headroom | None = None
    pins: dict[str, str] = field(default_factory=dict)
    device_map: dict[str, str] | None = None
    together: tuple[tuple[str, ...], ...] = ()
    leaf_modules: tuple[str, ...] = ()
    trace: str | None = None
    output_device: str | None = None
    objective: str | None = None
    dtype: str | None = None
    pipeline: PipelineConfig | None = None
    contiguous: bool | None = None
    mode: str | None = None
    optimizer: str | int | dict[str, Any] | None = None
    accumulate_grads: bool | None = None
    dynamic_shapes: str | None = None
    offload: Offload | None = None
    hardware: Hardware | None = None
    profile: bool | None = None
    replicate: bool | None = None
    source: str = "<spec>"
    lines: dict[YamlPath, int] = field(default_factory=dict, compare=False, repr=False)

    def reserve_for(self, device: str) -> Headroom:
        """The headroom ``device`` keeps: its own, else the spec-wide one, else none."""
        return self.reserve.get(device) or self.default_reserve or Headroom()

    def locate(self, path: YamlPath) -> str:
        """``"file.yaml:7: pin['lm_head']"`` for messages about a spec entry."""
        line = self.lines.get(path)
        return f"{self.source}:{line}: {format_path(path)}" if line else f"{self.source}: {format_path(path)}"

    def options(self) -> dict[str, Any]:
        """The spec as keyword options of :func:`fxsplit.fxsplit` (only what it sets; no budgets, no reserve)."""
        found: dict[str, Any] = {}
        if self.pins:
            found["pins"] = dict(self.pins)
        if self.device_map is not None:
            found["device_map"] = dict(self.device_map)
        if self.together:
            found["together"] = self.together
        if self.leaf_modules:
            found["leaf_modules"] = self.leaf_modules
        for name in SPEC_KEYS[SPEC_KEYS.index("trace") :]:  # the options, named as the call's keywords
            if getattr(self, name) is not None:
                found[name] = getattr(self, name)
        return found
