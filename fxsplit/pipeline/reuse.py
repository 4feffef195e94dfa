"""Run a saved plan as a pipeline in this process: ``fxsplit.apply(model, plan, pipeline=...)``.

The plan says where each op runs; the pipeline config says how the batch is
cut. :func:`in_process_pipeline` reads the config (and says when the plan's
memory counted other micro-batches), and :func:`first_microbatch_of` cuts the
example batch to the first micro-batch, which the model is traced on again,
as ``fxsplit.fxsplit(..., pipeline=...)`` traced it.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch

from fxsplit.callsite import user_stacklevel
from fxsplit.errors import FxsplitWarning, SpecError
from fxsplit.options import PipelineConfig
from fxsplit.pipeline.microbatch import argument_names, first_microbatch
from fxsplit.planning.plan import Plan

__all__ = ["first_microbatch_of", "in_process_pipeline"]


def in_process_pipeline(plan: Plan, value: Any) -> PipelineConfig | None:
    """The pipeline ``apply(..., pipeline=value)`` runs (None: none), warning where the plan counted other chunks.

    Raises:
        SpecError: ``value`` is no pipeline config, or one for stages run one per process.
    """
    if value is None:
        return None
    config = PipelineConfig.coerce(value)
    if config.processes:
        raise SpecError(
            "apply runs a pipeline in this process; for stages run one per process, pass the plan to "
            "fxsplit.pipeline_stages(model, plan, example_inputs=..., chunks=...)"
        )
    planned = plan.timing.get("chunks")
    if planned not in (None, config.chunks):
        warnings.warn(
            FxsplitWarning(
                f"the plan was made for a pipeline of {planned} micro-batches, and its memory rows count that many; "
                f"this one runs {config.chunks}: plan again with pipeline={config.chunks} to have them counted"
            ),
            stacklevel=user_stacklevel(),
        )
    return config


def first_microbatch_of(
    model: torch.nn.Module, example_inputs: Any, options: Mapping[str, Any], config: PipelineConfig
) -> tuple[tuple[Any, ...] | None, dict[str, Any]]:
    """The example inputs and options (``example_kwargs``) cut to the first of ``config.chunks`` micro-batches."""
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    args, kwargs = first_microbatch(
        example_inputs, options.get("example_kwargs"), config.chunks, config.broadcast, argument_names(model)
    )
    return args, {**options, "example_kwargs": kwargs} if kwargs is not None else dict(options)
