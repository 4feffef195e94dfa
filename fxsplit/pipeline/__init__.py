"""Stage 7, pipeline: run a split's stages over micro-batches, in one process or one process per stage.

* :mod:`~fxsplit.pipeline.stages`: cut a split into per-device stages.
* :mod:`~fxsplit.pipeline.microbatch`: split a batch into micro-batches and gather the outputs.
* :mod:`~fxsplit.pipeline.gpipe`: :class:`Pipeline`, GPipe's fill-drain schedule in one process.
* :mod:`~fxsplit.pipeline.streams`: copies between CUDA devices on side streams.
* :mod:`~fxsplit.pipeline.batchstats`: ops that depend on the whole batch (BatchNorm in training).
* :mod:`~fxsplit.pipeline.rowmixing`: ops that mix the rows of a batch (a mean over it), found from shapes.
* :mod:`~fxsplit.pipeline.reuse`: a saved plan run as a pipeline (``fxsplit.apply(..., pipeline=...)``).
* :mod:`~fxsplit.pipeline.distributed`: per-stage modules for ``torch.distributed.pipelining`` (it plans
  when given budgets, through :mod:`fxsplit.api`, so this package does not import it).

The option's value, :class:`~fxsplit.options.PipelineConfig`, is plain data in :mod:`fxsplit.options`.
"""

from fxsplit.options import PipelineConfig
from fxsplit.pipeline.gpipe import Pipeline

__all__ = ["Pipeline", "PipelineConfig"]
