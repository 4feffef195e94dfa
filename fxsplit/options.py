"""The choices of fxsplit's options, and the ``pipeline`` option's value: plain data, no torch.

The stages that act on an option, the spec reader and the command line all take its choices from
here, so they agree, and reading a spec or ``fxsplit --help`` loads no stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from fxsplit.errors import SpecError

__all__ = [
    "BATCH_STATS_MODES",
    "CHECKPOINT_MODES",
    "DYNAMIC_SHAPES",
    "MODES",
    "OBJECTIVES",
    "OPTIMIZERS",
    "TRACE_MODES",
    "PipelineConfig",
]

TRACE_MODES = ("auto", "fx", "export")  # trace: torch.export with a torch.fx fallback, or one of them
OBJECTIVES = ("min_transfer", "balanced")  # objective: fewest bytes copied, or the most even devices
MODES = ("inference", "training", "weights")  # mode: what the budgets hold
OPTIMIZERS = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}  # optimizer: state tensors per parameter
DYNAMIC_SHAPES = ("batch", "all")  # dynamic_shapes shorthands: which input sizes an export split keeps variable
CHECKPOINT_MODES = ("never", "except_last", "always")
BATCH_STATS_MODES = ("warn", "error", "allow")


@dataclass(frozen=True)
class PipelineConfig:
    """How to pipeline a split model.

    Attributes:
        chunks: micro-batches per batch (1: no pipelining, stages one after another).
        checkpoint: activation checkpointing per stage and micro-batch
            (``torch.utils.checkpoint``, ``use_reentrant=False``): ``"never"``
            (or False), ``"always"`` (or True), or ``"except_last"`` (not the
            last micro-batch, whose backward comes right after its forward).
            Saves activation memory, costs a second forward in backward.
        batch_stats: what to do when the model normalises with batch
            statistics (BatchNorm in training), which micro-batches change:
            ``"warn"``, ``"error"`` or ``"allow"``.
        broadcast: names of inputs given whole to every micro-batch instead of
            being split along dim 0 (e.g. a mask shared by all samples).
    """

    chunks: int
    checkpoint: Union[bool, str] = "never"
    batch_stats: str = "warn"
    broadcast: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise SpecError(f"pipeline chunks must be an int >= 1 (got {self.chunks!r})")
        mode = "always" if self.checkpoint is True else "never" if self.checkpoint is False else self.checkpoint
        if mode not in CHECKPOINT_MODES:
            raise SpecError(
                f"pipeline checkpoint must be True, False or one of {', '.join(CHECKPOINT_MODES)} "
                f"(got {self.checkpoint!r})"
            )
        object.__setattr__(self, "checkpoint", mode)
        if self.batch_stats not in BATCH_STATS_MODES:
            raise SpecError(
                f"pipeline batch_stats must be one of {', '.join(BATCH_STATS_MODES)} (got {self.batch_stats!r})"
            )
        if isinstance(self.broadcast, str):
            raise SpecError(f"pipeline broadcast must be a tuple of input names (got the string {self.broadcast!r})")
        object.__setattr__(self, "broadcast", tuple(self.broadcast))

    @classmethod
    def coerce(cls, value: Any) -> PipelineConfig:
        """A config from a config, a mapping (as in a spec: ``{chunks: 4}``) or an int (chunks)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(chunks=value)
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise SpecError(
                    f"unknown pipeline option(s) {', '.join(map(repr, unknown))}; options are "
                    f"{', '.join(cls.__dataclass_fields__)}"
                )
            if "chunks" not in value:
                raise SpecError("pipeline needs 'chunks' (the number of micro-batches)")
            return cls(**value)
        raise SpecError(f"pipeline must be a PipelineConfig, a mapping or an int (got {type(value).__name__})")

    def checkpoints(self, micro_batch: int, chunks: int) -> bool:
        """Whether micro-batch ``micro_batch`` of ``chunks`` runs under activation checkpointing."""
        return self.checkpoint == "always" or (self.checkpoint == "except_last" and micro_batch < chunks - 1)
