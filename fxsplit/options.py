"""fxsplit's options and budgets as values: plain data, no torch.

The stages that act on an option, the spec reader and the command line all take its choices from
here, so they agree, and reading a spec or ``fxsplit --help`` loads no stage. :class:`Options`
holds every option of :func:`fxsplit.plan` but the budgets; :class:`Budgets` holds those, made
once from what the user wrote and passed whole to every stage that needs them.

>>> budgets = Budgets({"cpu:0": 1000, "cpu:1": 2000}, reserved={"cpu:0": 100, "cpu:1": 0})
>>> budgets.devices, budgets.usable, budgets.caps()
(('cpu:0', 'cpu:1'), {'cpu:0': 900, 'cpu:1': 2000}, [900, 2000])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from fxsplit.errors import SpecError
from fxsplit.pipelineconfig import BATCH_STATS_MODES, CHECKPOINT_MODES, PipelineConfig
from fxsplit.units import format_size

__all__ = [
    "BATCH_STATS_MODES",
    "CHECKPOINT_MODES",
    "DYNAMIC_SHAPES",
    "MAX_PREFETCH",
    "MODES",
    "OBJECTIVES",
    "OPTIMIZERS",
    "STORAGE_TIERS",
    "TRACE_MODES",
    "Budgets",
    "Offload",
    "Options",
    "PipelineConfig",
    "usable_bytes",
]

TRACE_MODES = ("auto", "fx", "export")  # trace: torch.export with a torch.fx fallback, or one of them
# objective: fewest bytes copied, the most even devices, the fastest pipeline, the shortest forward
OBJECTIVES = ("min_transfer", "balanced", "throughput", "latency")
MODES = ("inference", "training", "weights")  # mode: what the budgets hold
OPTIMIZERS = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}  # optimizer: state tensors per parameter
DYNAMIC_SHAPES = ("batch", "all")  # dynamic_shapes shorthands: which input sizes an export split keeps variable
STORAGE_TIERS = ("host", "disk")  # where offloaded weights are stored, in the order they are filled
MAX_PREFETCH = 8  # offload prefetch: at most this many ops ahead


def usable_bytes(limit: int, reserved: int) -> int:
    """What planning lets a device hold: its budget ``limit`` less ``reserved``, never negative."""
    return max(0, limit - reserved)


@dataclass(frozen=True)
class Budgets:
    """What each device may hold: its full budget, the part held back, and what planning uses.

    Made once from what the user wrote (:meth:`parse`) and passed whole to
    every stage: the partitioner plans under :attr:`usable` (:meth:`caps`,
    in stage order), a :class:`~fxsplit.planning.plan.Plan` records
    :attr:`limits` and :attr:`reserved`, and checks hold each device's
    memory to :attr:`usable`. Direct construction takes canonical device
    names and byte counts, and checks them.

    Attributes:
        limits: device name -> full budget in bytes, in stage order.
        reserved: device -> bytes held back from its budget (the ``reserve``
            option); a device not named holds nothing back. Always less than
            a non-zero budget, and 0 where the budget is 0.

    Raises:
        SpecError: no device, a name that is not a string, a byte count
            that is not an int >= 0, a reserve for a device without a
            budget, or a reserve that leaves nothing of a budget.
    """

    limits: Mapping[str, int]
    reserved: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.limits, Mapping) or not self.limits:
            raise SpecError(f"budgets must name at least one device, like {{'cuda:0': 2**30}} (got {self.limits!r})")
        if not isinstance(self.reserved, Mapping):
            raise SpecError(f"reserved must be a mapping of device to bytes (got {type(self.reserved).__name__})")
        for what, sizes in (("budget", self.limits), ("reserve", self.reserved)):
            for device, nbytes in sizes.items():
                if not isinstance(device, str) or not device:
                    raise SpecError(f"{what} devices must be device names like 'cuda:0' (got {device!r})")
                if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
                    raise SpecError(f"{what} of '{device}' must be an int >= 0 bytes (got {nbytes!r})")
        for device, nbytes in self.reserved.items():
            if device not in self.limits:
                raise SpecError(f"reserve names '{device}', which has no budget (devices: {', '.join(self.limits)})")
            if nbytes and nbytes >= self.limits[device]:
                raise SpecError(
                    f"reserve {format_size(nbytes)} of '{device}' leaves nothing of its budget "
                    f"{format_size(self.limits[device])}; reserve less or raise the budget"
                )
        object.__setattr__(self, "limits", dict(self.limits))
        object.__setattr__(self, "reserved", dict(self.reserved))

    @classmethod
    def parse(cls, budgets: Any, reserve: Any = None) -> Budgets:
        """Budgets from what users write: the one place sizes, device names and reserves are read.

        Loads torch, which knows the device names (importing this module does not).

        Args:
            budgets: device -> bytes or a size string (``{"cuda:0": "20GiB"}``;
                keys as :func:`fxsplit.devices.normalize_device` reads them),
                in stage order; or ``"auto"``: the free memory of every
                visible GPU less 1 GiB (:func:`fxsplit.auto_budgets`).
            reserve: headroom kept free: a size, ``"10%"`` of the budget, or
                a mapping device -> either (None: nothing held back).

        Raises:
            SpecError: as :func:`fxsplit.devices.normalize_budgets` and
                :func:`fxsplit.reserve.reserve_bytes` (a bad device or size, a
                device named twice, a reserve that leaves nothing).
        """
        from fxsplit.devices import normalize_budgets
        from fxsplit.reserve import reserve_bytes

        if isinstance(budgets, str) and budgets == "auto":
            from fxsplit.memory.autobudget import auto_budgets

            budgets = auto_budgets()
        limits = normalize_budgets(budgets)
        return cls(limits, reserve_bytes(reserve, limits))

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices, in stage order."""
        return tuple(self.limits)

    @property
    def usable(self) -> dict[str, int]:
        """Device -> bytes planning may fill: its budget less its reserve."""
        return {d: usable_bytes(b, self.reserved.get(d, 0)) for d, b in self.limits.items()}

    def caps(self) -> list[int]:
        """The usable bytes in stage order, as the partitioner takes them."""
        return list(self.usable.values())


@dataclass(frozen=True)
class Offload:
    """Where weights the devices cannot hold may be stored, to be streamed in by the generated code.

    The partitioner first plans as without offload; only when the budgets
    cannot hold the model does it keep as much as fits on each device
    (resident) and store the rest in host memory, then on disk, each weight
    copied to its device right before the op that reads it (prefetched while
    the op before runs) and freed after it. See docs/OFFLOAD.md.

    Attributes:
        host: bytes of host memory for stored weights (pinned when CUDA is
            present); None: none.
        disk: bytes of disk space for stored weights; None: none.
        dir: the directory that holds the weights stored on disk (one
            safetensors file, memory-mapped); needed with ``disk``.
        prefetch: how many weight-reading ops ahead a streamed weight starts
            its copy (0: right before its op); None (the default): 1 when a
            device of the plan is a CUDA device, whose side stream overlaps
            the copy with the ops in between, else 0 (elsewhere a copy runs
            in line, and a second buffer would only hold fewer weights
            resident). Each device is charged the streamed weights of its
            largest window of ``prefetch + 1`` consecutive weight-reading ops.

    >>> Offload.coerce({"host": "1GiB", "disk": "4GiB", "dir": "offload/"}).tiers()
    {'host': 1073741824, 'disk': 4294967296}
    """

    host: int | None = None
    disk: int | None = None
    dir: str | None = None
    prefetch: int | None = None

    def __post_init__(self) -> None:
        for tier in STORAGE_TIERS:
            nbytes = getattr(self, tier)
            if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
                raise SpecError(f"offload {tier} must be an int >= 0 bytes (got {nbytes!r})")
        if self.host is None and self.disk is None:
            raise SpecError("offload must give a 'host' or 'disk' budget, like {'host': '16GiB'}")
        if self.disk is not None and not self.dir:
            raise SpecError("offload 'disk' needs 'dir', the directory the stored weights are written to")
        if self.dir is not None and not isinstance(self.dir, str):
            object.__setattr__(self, "dir", str(self.dir))
        if self.prefetch is not None and (
            isinstance(self.prefetch, bool)
            or not isinstance(self.prefetch, int)
            or not 0 <= self.prefetch <= MAX_PREFETCH
        ):
            raise SpecError(f"offload prefetch must be an int from 0 to {MAX_PREFETCH} (got {self.prefetch!r})")

    @classmethod
    def coerce(cls, value: Any) -> Offload | None:
        """An Offload from an Offload, None, or a mapping as users write it (sizes as strings, ``dir`` a path)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise SpecError(
                f"offload must be a mapping like {{'host': '16GiB', 'disk': '100GiB', 'dir': 'offload/'}} "
                f"(got {type(value).__name__})"
            )
        unknown = sorted(str(k) for k in value if k not in cls.__dataclass_fields__)
        if unknown:
            raise SpecError(
                f"unknown offload option(s) {', '.join(map(repr, unknown))}; options are "
                f"{', '.join(cls.__dataclass_fields__)}"
            )
        from fxsplit.units import parse_size

        sizes = {t: parse_size(value[t], what=f"offload {t}") for t in STORAGE_TIERS if value.get(t) is not None}
        dir_ = value.get("dir")
        return cls(**sizes, dir=None if dir_ is None else str(dir_), prefetch=value.get("prefetch"))

    def resolved(self, devices: Iterable[str]) -> Offload:
        """This offload with ``prefetch`` decided for ``devices`` when it was left to fxsplit (None)."""
        if self.prefetch is not None:
            return self
        cuda = any(str(d).startswith("cuda") for d in devices)
        return Offload(self.host, self.disk, self.dir, 1 if cuda else 0)

    def tiers(self) -> dict[str, int]:
        """Storage tier -> bytes, for the tiers given, in the order they are filled."""
        return {t: n for t in STORAGE_TIERS if (n := getattr(self, t)) is not None}

    def to_dict(self) -> dict[str, Any]:
        """As plain data (bytes as ints), for plans and specs."""
        return {"host": self.host, "disk": self.disk, "dir": self.dir, "prefetch": self.prefetch}


@dataclass(frozen=True)
class Options:
    """Every option :func:`fxsplit.fxsplit` and :func:`fxsplit.plan` take besides the model, inputs and budgets.

    Each field's default is the option's default; ``fxsplit.api`` checks
    the values once, before any work.

    Attributes:
        example_kwargs: keyword inputs for tracing, beside ``example_inputs``.
        trace: how to trace, one of :data:`TRACE_MODES`: ``"auto"`` (torch.export,
            torch.fx when export fails), ``"fx"`` or ``"export"``.
        leaf_modules: module classes, or module paths or class names, that
            torch.fx keeps as one op instead of tracing into them.
        concrete_args: arguments of ``forward`` fixed while tracing with fx
            (``torch.fx.symbolic_trace``'s ``concrete_args``).
        output_device: where the outputs are returned (None: the device of
            the last op).
        objective: what the partitioner optimises, one of :data:`OBJECTIVES`:
            ``"min_transfer"`` (fewest bytes copied), ``"balanced"`` (most
            even parameter bytes), ``"throughput"`` (contiguous stages whose
            slowest stage, compute plus the copies it receives, is fastest)
            or ``"latency"`` (the shortest forward, stages one after
            another); times come from ``hardware`` or ``profile``. None
            (the default): ``"throughput"`` with ``pipeline``, else
            ``"min_transfer"``.
        pins: module path or glob -> the device its ops and tensors must go to.
            Pins that cannot be op pins but place every parameter and buffer
            are read as a ``device_map`` (with a warning).
        device_map: module or tensor name -> device, as Accelerate writes it
            (``""``: the whole model): where every parameter and buffer
            lives (the longest key naming it or its module); the ops go
            where they copy the fewest bytes. None: fxsplit places the weights.
        pipeline: run micro-batches through the stages: a :class:`PipelineConfig`,
            a mapping (``{"chunks": 4}``) or an int (chunks); None: no
            pipeline. Implies ``contiguous``.
        contiguous: keep each device's ops one consecutive run of the graph,
            in device order.
        together: groups of module patterns whose ops must share a device.
        reserve: headroom kept free on each device: a size, ``"10%"`` of the
            budget, or a mapping device -> either (read into :class:`Budgets`).
        dtype: plan as if floating tensors had this dtype (``"bfloat16"``,
            ``torch.float16``, ...); the model is cast only when a checkpoint fills it. None: its own dtypes.
        spec: a :class:`~fxsplit.spec.Spec`, a spec file or YAML text; its
            devices are the budgets when none are given, and explicit options
            override its fields.
        check: verify the invariants of the plan and the split (:mod:`fxsplit.check`).
        mode: what the budgets hold, one of :data:`MODES` (see :mod:`fxsplit.memory`).
        optimizer: the optimizer counted with ``mode="training"``: a name from :data:`OPTIMIZERS`, its settings
            (:mod:`fxsplit.optimizer`) or bytes per parameter element (None: ``"adam"`` in training).
        accumulate_grads: with ``mode="training"``, plan for backward passes that add to ``.grad`` tensors
            that exist (gradient accumulation over several batches before a step, or ``zero_grad(set_to_none=
            False)``): each weight's new gradient is then held until it is added, beside the ``.grad``. False:
            each step's one backward starts without them (``zero_grad()``'s default), and each weight's first
            gradient becomes its ``.grad``. A pipeline of several micro-batches accumulates: planned so, whatever
            this says.
        dynamic_shapes: input sizes a torch.export split keeps variable: one
            of :data:`DYNAMIC_SHAPES` or a torch.export ``dynamic_shapes`` spec.
        offload: where weights the devices cannot hold are stored and
            streamed from: an :class:`Offload` or a mapping (``{"host":
            "16GiB", "disk": "100GiB", "dir": "offload/"}``); None: the
            budgets must hold the whole model. Inference only.
        hardware: device speeds and links for time estimates: a
            :class:`~fxsplit.hardware.Hardware` or a mapping (``{"devices":
            {"cuda": {"flops": "300T", "bandwidth": "2TB/s"}}, "links":
            {"cuda:0 <-> cuda:1": {"bandwidth": "300GB/s"}}}``); None: the
            defaults of :mod:`fxsplit.hardware`.
        profile: time every op by running it on each kind of device the
            budgets name (a few repeats) instead of estimating from FLOPs and
            bytes; needs real weights and ``example_inputs``.
        replicate: let a read-only parameter or buffer read on several
            devices be held on each of them (charged to each) instead of
            copied, when that copies fewer bytes per forward and the budgets
            allow (``Plan.replicas``; with ``mode="inference"`` or
            ``"weights"`` and the ``"min_transfer"`` objective, without a
            pipeline or offload). False: each tensor on one device.
    """

    example_kwargs: Mapping[str, Any] | None = None
    trace: str = "auto"
    leaf_modules: Iterable[type | str] = ()
    concrete_args: Mapping[str, Any] | None = None
    output_device: Any = None
    objective: str | None = None
    pins: Mapping[str, Any] | None = None
    device_map: Mapping[str, Any] | None = None
    pipeline: PipelineConfig | Mapping[str, Any] | int | None = None
    contiguous: bool = False
    together: Iterable[Iterable[str]] = ()
    reserve: Any = None
    dtype: Any = None
    spec: Any = None
    check: bool = False
    mode: str = "inference"
    optimizer: Any = None
    accumulate_grads: bool = False
    dynamic_shapes: Any = None
    offload: Offload | Mapping[str, Any] | None = None
    hardware: Any = None
    profile: bool = False
    replicate: bool = True

    @property
    def chosen_objective(self) -> str:
        """The objective planned for: the one given, else ``"throughput"`` with a pipeline, else ``"min_transfer"``."""
        if self.objective is not None:
            return self.objective
        return "throughput" if self.pipeline is not None else "min_transfer"
