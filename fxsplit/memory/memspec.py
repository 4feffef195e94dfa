"""The memory mode and optimizer a plan is charged for, validated: :class:`MemorySpec`.

``optimizer`` (training only): a name or the optimizer's settings (:mod:`fxsplit.optimizer`: its state and
what its step makes), or an int, the bytes of state per parameter *element* (``8`` for Adam on float32
weights, ``2`` for an 8-bit Adam).

>>> spec = MemorySpec.coerce("training", "adam")
>>> spec.optimizer_bytes(nbytes=4000, numel=1000), spec.optimizer_bytes(4000, 1000) == 2 * 4000
(8000, True)
>>> MemorySpec.coerce("training", 2).optimizer_bytes(4000, 1000)
2000
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from fxsplit.errors import SpecError
from fxsplit.optimizer import OptimizerSettings
from fxsplit.options import MODES

__all__ = ["MemorySpec"]


@dataclass(frozen=True)
class MemorySpec:
    """The memory mode and optimizer, validated.

    Attributes:
        mode: ``"inference"``, ``"training"`` or ``"weights"``.
        optimizer: a name from :data:`OPTIMIZERS` or bytes per parameter
            element; None outside training.
    """

    mode: str = "inference"
    optimizer: str | int | None = None
    settings: OptimizerSettings | None = None  # given as settings (a mapping or a torch optimizer); else by name

    @classmethod
    def coerce(cls, mode: str = "inference", optimizer: Any = None) -> MemorySpec:
        """Validate ``mode`` and ``optimizer`` (:mod:`fxsplit.optimizer`); training defaults to ``"adam"``.

        Raises:
            SpecError: an unknown mode or optimizer, or an optimizer outside training.
        """
        if mode not in MODES:
            raise SpecError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
        if optimizer is not None and mode != "training":
            shown = optimizer if isinstance(optimizer, (str, int, Mapping)) else type(optimizer).__name__
            raise SpecError(
                f"optimizer={shown!r} only counts with mode='training' (got mode={mode!r}); "
                "pass mode='training' or drop the optimizer"
            )
        if isinstance(optimizer, bool) or (isinstance(optimizer, int) and optimizer < 0):
            raise SpecError(f"optimizer bytes per parameter element must be an int >= 0 (got {optimizer!r})")
        if mode == "training" and optimizer is None:
            optimizer = "adam"
        if optimizer is None or isinstance(optimizer, int):
            return cls(mode, optimizer)
        settings = OptimizerSettings.coerce(optimizer)
        return cls(mode, settings.name, None if isinstance(optimizer, str) else settings)

    @property
    def training(self) -> bool:
        return self.mode == "training"

    @property
    def counts_activations(self) -> bool:
        return self.mode != "weights"

    def step_bytes(self, trainable: int, sizes: Sequence[int] = (), device_types: Iterable[str] = ("cuda",)) -> int:
        """Temporaries of ``optimizer.step()`` on a device whose trainable parameters take ``trainable`` bytes,
        ``sizes`` each, when the optimizer's parameters are on devices of ``device_types`` (what torch's default
        step depends on): :meth:`OptimizerSettings.step_bytes`; none for an optimizer given as bytes per
        element."""
        if not self.training or not isinstance(self.optimizer, str):
            return 0
        settings = self.optimizer_settings
        return settings.step_bytes(settings.implementation_on(device_types), trainable=trainable, sizes=sizes)

    @property
    def optimizer_settings(self) -> OptimizerSettings:
        """The optimizer's settings: as given, or those its name stands for."""
        assert isinstance(self.optimizer, str)
        return self.settings or OptimizerSettings.coerce(self.optimizer)

    def optimizer_bytes(self, nbytes: int, numel: int) -> int:
        """Optimizer state of one trainable parameter of ``nbytes`` bytes and ``numel`` elements."""
        if not self.training or self.optimizer is None:
            return 0
        if isinstance(self.optimizer, str):
            return self.optimizer_settings.state_tensors * nbytes
        return self.optimizer * numel

    def describe(self) -> str:
        if not self.training:
            return f"mode={self.mode!r}"
        return f"mode='training', optimizer={self.settings.given if self.settings else repr(self.optimizer)}"

    def holds(self) -> str:
        """What a device's budget must hold under this mode, in words."""
        if self.mode == "weights":
            return "its parameters and buffers"
        if not self.training:
            return "its parameters, buffers and activations"
        return "its parameters, buffers, gradients, optimizer state and activations"
