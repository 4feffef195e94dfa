"""How to pipeline a split model: :class:`PipelineConfig`, plain data, no torch (read by specs and the CLI).

>>> PipelineConfig.coerce({"chunks": 4, "checkpoint": True})
PipelineConfig(chunks=4, checkpoint='always', batch_stats='warn', broadcast=(), processes=False, return_outputs=True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from fxsplit.errors import SpecError

__all__ = ["BATCH_STATS_MODES", "CHECKPOINT_MODES", "PipelineConfig"]

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
            statistics (BatchNorm in training), which micro-batches change,
            updates a parameter or buffer in place (once per micro-batch),
            draws random numbers (dropout in training: per micro-batch), or
            mixes the rows of the batch (a mean over it, a softmax along it:
            :mod:`fxsplit.pipeline.rowmixing`): ``"warn"``, ``"error"`` or
            ``"allow"``.
        broadcast: names of inputs given whole to every micro-batch instead of
            being split along dim 0 (e.g. a mask shared by all samples).
        processes: True when the stages will run one per process
            (:func:`fxsplit.pipeline_stages`, ``torch.distributed.pipelining``):
            each stage then holds its own copy of every weight it reads, so the
            time estimate charges no copy of a weight per micro-batch and, in
            training, one all-reduce of the tied gradients per step. False (the
            default): fxsplit's own pipeline in one process, which copies a
            weight read on another stage every micro-batch. ``pipeline_stages``
            plans with True; pass it to ``fxsplit.plan`` for a plan you will give
            to ``pipeline_stages`` (e.g. one made with ``profile=True`` on one rank).
        return_outputs: with ``processes``, whether ``schedule.step`` returns the
            outputs (torch's default, True): the last stage then keeps every
            micro-batch's outputs, and their merged copy, which its row counts.
            False when you call ``schedule.step(..., return_outputs=False)``.
    """

    chunks: int
    checkpoint: Union[bool, str] = "never"
    batch_stats: str = "warn"
    broadcast: tuple[str, ...] = field(default_factory=tuple)
    processes: bool = False
    return_outputs: bool = True

    def __post_init__(self) -> None:
        problems = []  # every problem at once, as a spec lists them
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            problems.append(f"chunks must be an int >= 1 (got {self.chunks!r})")
        mode = "always" if self.checkpoint is True else "never" if self.checkpoint is False else self.checkpoint
        if mode not in CHECKPOINT_MODES:
            problems.append(f"checkpoint must be True, False or one of {', '.join(CHECKPOINT_MODES)} (got {mode!r})")
        object.__setattr__(self, "checkpoint", mode)
        if self.batch_stats not in BATCH_STATS_MODES:
            problems.append(f"batch_stats must be one of {', '.join(BATCH_STATS_MODES)} (got {self.batch_stats!r})")
        if isinstance(self.broadcast, str):
            problems.append(f"broadcast must be a tuple of input names (got the string {self.broadcast!r})")
        else:
            object.__setattr__(self, "broadcast", tuple(self.broadcast))
        for name, value in (("processes", self.processes), ("return_outputs", self.return_outputs)):
            if not isinstance(value, bool):
                problems.append(f"{name} must be true or false (got {value!r})")
        if problems:
            raise SpecError("pipeline " + "; ".join(problems))

    @classmethod
    def coerce(cls, value: Any) -> PipelineConfig:
        """A config from a config, a mapping (as in a spec: ``{chunks: 4}``) or an int (chunks)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(chunks=value)
        if isinstance(value, Mapping):
            problems = [
                f"unknown pipeline option(s) {', '.join(map(repr, unknown))}; options are "
                f"{', '.join(cls.__dataclass_fields__)}"
                for unknown in [sorted(set(value) - set(cls.__dataclass_fields__))]
                if unknown
            ]
            if "chunks" not in value:
                problems.append("pipeline needs 'chunks' (the number of micro-batches)")
            known = {k: v for k, v in value.items() if k in cls.__dataclass_fields__}
            try:
                config = cls(**{"chunks": 1, **known})
            except SpecError as error:
                problems.append(str(error))
            if problems:
                raise SpecError("; ".join(problems))
            return config
        raise SpecError(f"pipeline must be a PipelineConfig, a mapping or an int (got {type(value).__name__})")

    def checkpoints(self, micro_batch: int, chunks: int) -> bool:
        """Whether micro-batch ``micro_batch`` of ``chunks`` runs under activation checkpointing."""
        return self.checkpoint == "always" or (self.checkpoint == "except_last" and micro_batch < chunks - 1)
