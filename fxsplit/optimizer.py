"""What an optimizer keeps per parameter, and what ``optimizer.step()`` makes while it runs.

``optimizer=`` names the optimizer (``"adam"``, ``"adamw"``, ``"sgd"``, ``"sgd_momentum"``), or gives its
settings: a mapping (``{"name": "adamw", "fused": True}``, in Python or a spec) or the
``torch.optim`` optimizer itself (SGD, Adam or AdamW). The settings decide two things:

* **state**, kept between steps, each tensor the size of its parameter: Adam and AdamW two
  (``exp_avg``, ``exp_avg_sq``), three with ``amsgrad``; SGD one with ``momentum``, none without.
* **step temporaries**, alive during ``optimizer.step()`` only. They depend on how torch runs the step:
  ``fused``, none; ``foreach`` (torch's default when every parameter is on CUDA or another accelerator),
  one tensor per parameter of a device group for Adam / AdamW, and for SGD with ``weight_decay`` or
  ``maximize`` (none otherwise); the ``for-loop`` step (torch's default on CPU, or when parameters are on
  more than one kind of device), a few tensors the size of the largest parameter: Adam two, three with
  ``maximize`` or a coupled ``weight_decay`` (Adam's, not AdamW's); SGD one for each of ``weight_decay``,
  ``nesterov`` and ``maximize``, two at most (with ``maximize``, at least the largest plus the second largest:
  the previous parameter's gradient being alive when the next is negated). Adam's for-loop step also keeps the
  previous parameter's denominator until the next one is made: one more tensor, the second largest at most.

These counts were measured with torch 2.13 around ``optimizer.step()`` (``tests/test_optimizer_memory.py``
checks every combination against the rows). A name alone cannot say whether weight decay is set, so it
counts it as set (an upper bound: ``"sgd"`` counts one temporary per trainable byte under ``foreach``).

>>> settings = OptimizerSettings.coerce({"name": "adamw", "fused": True})
>>> settings.state_tensors, settings.step_bytes("fused", trainable=4000, sizes=[3000, 1000])
(2, 0)
>>> OptimizerSettings.coerce("adam").step_bytes("for-loop", trainable=4000, sizes=[3000, 1000])
10000
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from fxsplit.errors import SpecError
from fxsplit.options import OPTIMIZERS

__all__ = ["FOREACH_DEVICE_TYPES", "IMPLEMENTATIONS", "OptimizerSettings", "step_types"]

IMPLEMENTATIONS = ("foreach", "for-loop", "fused")
FOREACH_DEVICE_TYPES = ("cuda", "xpu", "mtia", "privateuseone")  # torch's foreach kernels: its default there
_NAMES = tuple(OPTIMIZERS)
_SETTINGS = ("name", "momentum", "weight_decay", "nesterov", "amsgrad", "maximize", "foreach", "fused")


@dataclass(frozen=True)
class OptimizerSettings:
    """The settings of an SGD, Adam or AdamW optimizer that decide its memory.

    Attributes:
        kind: ``"adam"`` (coupled weight decay), ``"adamw"`` (decoupled) or ``"sgd"``.
        momentum: SGD keeps a momentum buffer.
        weight_decay: weight decay is set (nonzero).
        nesterov, amsgrad, maximize: as the torch optimizer's arguments.
        implementation: ``"foreach"``, ``"for-loop"`` or ``"fused"``; None: torch's default for the
            devices the parameters are on (:meth:`implementation_on`).
        given: what the user passed, as they wrote it (for messages).
    """

    kind: str
    momentum: bool = False
    weight_decay: bool = True
    nesterov: bool = False
    amsgrad: bool = False
    maximize: bool = False
    implementation: str | None = None
    given: str = ""

    @property
    def name(self) -> str:
        """The optimizer's name among ``"adam"``, ``"adamw"``, ``"sgd_momentum"``, ``"sgd"``."""
        return "sgd_momentum" if self.kind == "sgd" and self.momentum else self.kind

    @property
    def state_tensors(self) -> int:
        """Tensors of state per parameter, each its size."""
        if self.kind == "sgd":
            return 1 if self.momentum else 0
        return 3 if self.amsgrad else 2

    def implementation_on(self, device_types: Iterable[str]) -> str:
        """How torch runs the step for parameters on devices of these types (``"cuda"``, ``"cpu"`` ...)."""
        if self.implementation is not None:
            return self.implementation
        types = set(device_types)
        return "foreach" if types and types <= set(FOREACH_DEVICE_TYPES) else "for-loop"

    def step_bytes(self, implementation: str, *, trainable: int, sizes: Sequence[int]) -> int:
        """Bytes of the step's temporaries on a device: ``trainable`` bytes of trainable parameters there,
        ``sizes`` their sizes (any order)."""
        if implementation == "fused" or not trainable:
            return 0
        if implementation == "foreach":
            if self.kind == "sgd":
                return trainable if (self.weight_decay or self.maximize) else 0
            return trainable
        largest = sorted(sizes, reverse=True)[:2]
        if not largest:
            return 0
        second = largest[1] if len(largest) > 1 else 0
        if self.kind == "sgd":  # each new gradient is made while the one before it is alive: two at most
            held = min(2, int(self.weight_decay) + int(self.nesterov) + int(self.maximize)) * largest[0]
            if self.maximize and (self.nesterov or not self.momentum):  # -grad is made while the previous
                held = max(held, largest[0] + second)  # parameter's last gradient is still referenced
            return held
        tensors = 3 if self.maximize or (self.kind == "adam" and self.weight_decay) else 2
        return tensors * largest[0] + second  # the previous parameter's denominator is referenced until the next

    @classmethod
    def coerce(cls, optimizer: Any) -> OptimizerSettings:
        """Settings from a name, a mapping of settings, or a ``torch.optim`` SGD / Adam / AdamW optimizer.

        Raises:
            SpecError: an unknown name, setting or optimizer class.
        """
        if isinstance(optimizer, str):
            name = optimizer.lower()
            if name not in _NAMES:
                raise SpecError(
                    f"optimizer must be one of {', '.join(_NAMES)} or bytes per parameter element (got {optimizer!r})"
                )
            return _from_settings({"name": name}, given=repr(optimizer))
        if isinstance(optimizer, Mapping):
            return _from_settings(optimizer, given=repr(dict(optimizer)))
        import torch

        if isinstance(optimizer, torch.optim.Optimizer):
            return _from_optimizer(optimizer)
        raise SpecError(
            "optimizer must be a name, a mapping of settings ({'name': 'adamw', 'fused': True}), a torch.optim "
            f"SGD / Adam / AdamW optimizer, or bytes per parameter element (got {type(optimizer).__name__})"
        )


def _from_settings(settings: Mapping[Any, Any], *, given: str) -> OptimizerSettings:
    unknown = sorted(str(key) for key in settings if key not in _SETTINGS)
    if unknown:
        raise SpecError(f"optimizer settings: unknown {', '.join(map(repr, unknown))}; known: {', '.join(_SETTINGS)}")
    name = settings.get("name")
    if not isinstance(name, str) or name.lower() not in _NAMES:
        raise SpecError(f"optimizer settings need 'name', one of {', '.join(_NAMES)} (got {name!r})")
    name = name.lower()
    for key in ("nesterov", "amsgrad", "maximize"):
        if not isinstance(settings.get(key, False), bool):
            raise SpecError(f"optimizer setting {key!r} must be true or false (got {settings[key]!r})")
    for key in ("foreach", "fused"):
        if settings.get(key) is not None and not isinstance(settings[key], bool):
            raise SpecError(f"optimizer setting {key!r} must be true, false or None (got {settings[key]!r})")
    for key in ("momentum", "weight_decay"):
        value = settings.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise SpecError(f"optimizer setting {key!r} must be a number >= 0 (got {value!r})")
    kind = "sgd" if name.startswith("sgd") else name
    if kind != "sgd" and ("momentum" in settings or "nesterov" in settings):
        raise SpecError(f"optimizer {name!r} has no 'momentum' nor 'nesterov' (SGD's settings)")
    if kind == "sgd" and "amsgrad" in settings:
        raise SpecError("optimizer 'sgd' has no 'amsgrad' (Adam's setting)")
    if settings.get("foreach") and settings.get("fused"):
        raise SpecError("optimizer settings: 'foreach' and 'fused' cannot both be true (torch refuses them)")
    momentum = name == "sgd_momentum" if "momentum" not in settings else settings["momentum"] > 0
    return OptimizerSettings(
        kind,
        momentum=momentum,
        weight_decay=settings["weight_decay"] > 0 if "weight_decay" in settings else True,  # unseen: maybe set
        nesterov=settings.get("nesterov", False),
        amsgrad=settings.get("amsgrad", False),
        maximize=settings.get("maximize", False),
        implementation=_implementation(settings.get("foreach"), settings.get("fused")),
        given=given,
    )


def _implementation(foreach: bool | None, fused: bool | None) -> str | None:
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    if foreach is False:
        return "for-loop"
    return None


def _most_memory(ways: set[str | None]) -> str | None:
    """The implementation of several parameter groups that makes the most temporaries (None: torch's default)."""
    for way in ("for-loop", None, "foreach"):
        if way in ways:
            return way
    return "fused"


def _from_optimizer(optimizer: Any) -> OptimizerSettings:
    """The settings of a torch optimizer: every parameter group's (the most memory any group's setting costs)."""
    import torch

    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        raise SpecError(
            f"fxsplit counts the memory of torch.optim SGD, Adam and AdamW, not {type(optimizer).__name__}: pass "
            "its state as bytes per parameter element (optimizer=8 for two float32 tensors per parameter)"
        )
    groups = optimizer.param_groups or [optimizer.defaults]
    kind = "sgd" if isinstance(optimizer, torch.optim.SGD) else "adam"
    if kind == "adam" and all(group.get("decoupled_weight_decay", False) for group in groups):
        kind = "adamw"
    ways = {_implementation(g.get("foreach"), g.get("fused")) for g in groups}
    if any(g.get("differentiable") for g in groups):
        ways = {"for-loop"}
    return OptimizerSettings(
        kind,
        momentum=any(g.get("momentum", 0) > 0 for g in groups),
        weight_decay=any(g.get("weight_decay", 0) > 0 for g in groups),
        nesterov=any(g.get("nesterov", False) for g in groups),
        amsgrad=any(g.get("amsgrad", False) for g in groups),
        maximize=any(g.get("maximize", False) for g in groups),
        implementation=_most_memory(ways),
        given=f"torch.optim.{type(optimizer).__name__}",
    )


def step_types(device: str, stepped: Iterable[str], per_process: bool) -> set[str]:
    """The device types torch's default step looks at for ``device``'s parameters (:meth:`OptimizerSettings.
    implementation_on`): its own when each stage runs in a process of its own, else those of every device in
    ``stepped`` (one optimizer over the split's parameters)."""
    return {device.partition(":")[0]} if per_process else {d.partition(":")[0] for d in stepped}
