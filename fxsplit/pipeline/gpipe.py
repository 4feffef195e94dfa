"""Micro-batch pipelining in one process: GPipe's fill-drain schedule over the stages of a split.

``fxsplit.fxsplit(model, budgets, example_inputs=..., pipeline=PipelineConfig(chunks=4))``
returns a :class:`Pipeline` instead of a plain split module. It cuts the
batch into ``chunks`` micro-batches and runs the stages (the plan's devices,
in order) on a clock: at tick ``t`` stage ``s`` runs micro-batch ``t - s``, so
while stage 1 works on micro-batch ``i``, stage 0 already works on ``i + 1``.
The backward pass is autograd's own over the graph the forward built (on
GPUs, autograd runs one thread per device, so backward overlaps as well).

On CUDA devices each stage computes on its device's stream and values move
between GPUs on copy streams (:mod:`fxsplit.pipeline.streams`); host-side, kernels are
queued asynchronously, so stages on different GPUs overlap. On ``cpu:N``
devices the same schedule runs as a plain ordered loop: the results are the
same, but all devices share the CPU cores, so there is no speed-up there.

Results equal the unsplit model's up to float rounding (micro-batches change
the order of sums: about 1e-6 relative in float32), except for ops that use
batch statistics (BatchNorm in training: each micro-batch is normalised with
its own statistics, and running statistics are updated once per
micro-batch; ``PipelineConfig.batch_stats`` says whether that warns or
raises, as it does for any other parameter or buffer the forward updates in
place), for random ops (dropout draws per micro-batch, in another order;
said or refused as ``batch_stats`` says), and for ops that mix the rows of a
batch (a mean over the batch dimension sees one micro-batch's rows):
:mod:`fxsplit.pipeline.rowmixing` finds those from the graph's shapes, and
``batch_stats`` governs them too.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence, cast

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

from fxsplit.callsite import user_stacklevel
from fxsplit.codegen.splitbase import refuse_move
from fxsplit.errors import FxsplitError, FxsplitWarning
from fxsplit.options import PipelineConfig
from fxsplit.pipeline.batchstats import batch_stat_ops, drawing, labelled, random_candidates, state_written
from fxsplit.pipeline.microbatch import gather, scatter
from fxsplit.pipeline.rowmixing import row_mixing
from fxsplit.pipeline.stages import StageSplit, split_stages
from fxsplit.pipeline.streams import CudaCopies
from fxsplit.planning.plan import Plan
from fxsplit.tracing.modereads import check_modes
from fxsplit.tracing.modulehooks import carry_root_hooks

__all__ = ["Pipeline", "PipelineConfig", "clock_cycles", "pipelined"]


def clock_cycles(chunks: int, stages: int) -> list[list[tuple[int, int]]]:
    """GPipe's fill-drain schedule: per tick, the ``(micro_batch, stage)`` pairs that run.

    Example:
        >>> clock_cycles(3, 2)
        [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    """
    return [[(t - s, s) for s in range(stages) if 0 <= t - s < chunks] for t in range(chunks + stages - 1)]


class Pipeline(torch.nn.Module):
    """A split model that runs micro-batches through its stages in a pipeline.

    Call it like the model. ``meta["fxsplit_plan"]`` is the plan; ``stages[i]``
    is stage ``i``'s ``GraphModule`` (``stages[i].code`` is its generated
    forward: the ``.to(device)`` copies into its device, then its ops), and
    ``stage_specs[i]`` says which values it takes and returns. ``code`` is
    every stage's code, one after the other; ``split`` is the same model
    without pipelining (shares the weights). The weights are the model's own,
    on their planned devices, each in exactly one stage: a weight that another
    stage reads (a tied one) is sent to it as a stage input, and autograd sums
    its gradients. Save and load weights through the model (``model.state_dict()``);
    this module's own keys are prefixed by ``stages.<i>.``.
    """

    def __init__(self, split: torch.fx.GraphModule, stages: StageSplit, config: PipelineConfig) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(stages.modules)
        self.stage_specs = stages.specs
        self.config = config
        self.meta: dict[str, Any] = {"fxsplit_plan": split.meta["fxsplit_plan"]}
        self._layout = stages
        object.__setattr__(self, "_split", split)  # not a submodule: its weights are the stages'
        self._cuda = CudaCopies() if any(s.device.startswith("cuda") for s in stages.specs) else None
        self._traced_rows = _traced_rows(split, stages, config)
        allowed = config.batch_stats == "allow"
        self._row_mixing = "" if allowed else mixing_message(split, config.chunks, config.broadcast)
        self._random = [  # found once; which draw depends on the modules' mode at each call
            (module, random_candidates(module)) for module in stages.modules
        ]

    @property
    def split(self) -> torch.fx.GraphModule:
        """The split model without pipelining (the same weights; traced on one micro-batch)."""
        return cast(torch.fx.GraphModule, self.__dict__["_split"])

    @property
    def code(self) -> str:
        """The generated code of every stage, each under a comment naming its device and values."""
        parts = []
        for spec, module in zip(self.stage_specs, self._layout.modules, strict=True):
            parts.append(
                f"# stage {spec.index} on {spec.device}: takes ({', '.join(spec.inputs)}), "
                f"returns ({', '.join(spec.outputs)})" + module.code
            )
        return "\n".join(parts)

    def train(self, mode: bool = True) -> Pipeline:
        self.split.train(mode)  # raises where torch.export fixed the mode
        return super().train(mode)

    def to(self, *args: Any, **kwargs: Any) -> Pipeline:  # (moving a weight off its stage's device raises)
        refuse_move(self, torch._C._nn._parse_to(*args, **kwargs)[0], "this pipeline")
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> Pipeline:
        refuse_move(
            self, torch.device("cuda", device) if isinstance(device, int) else device or "cuda", "this pipeline"
        )
        return super().cuda(device)

    def cpu(self) -> Pipeline:
        refuse_move(self, "cpu", "this pipeline")
        return super().cpu()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        check_modes(getattr(self.split, "mode_read", None), "this pipeline")
        self._check_batch_stats()
        flat = self._layout.bind(args, kwargs)
        parts, rows = scatter(flat, self._layout.input_targets, self.config.chunks, self.config.broadcast)
        self._check_rows(rows)
        envs = [dict(zip(self._layout.input_names, part, strict=True)) for part in parts]
        for tick in clock_cycles(len(envs), len(self.stages)):
            for micro_batch, stage in tick:
                self._run(stage, micro_batch, envs)
        return gather([self._layout.restore(env) for env in envs], rows)

    def _run(self, stage: int, micro_batch: int, envs: list[dict[str, Any]]) -> None:
        spec, env = self.stage_specs[stage], envs[micro_batch]
        inputs = [env[name] for name in spec.inputs]
        if self._cuda is not None:
            inputs = self._cuda.copy_in(inputs, spec.device)
        module = self.stages[stage]
        try:
            if torch.is_grad_enabled() and self.config.checkpoints(micro_batch, len(envs)):
                outputs = checkpoint(module, *inputs, use_reentrant=False)
            else:
                outputs = module(*inputs)
        except Exception as error:
            note = getattr(error, "add_note", None)  # Python 3.11 on
            if note is not None:
                note(
                    f"fxsplit: raised by stage {stage} ({spec.device}) on micro-batch {micro_batch} of {len(envs)}, "
                    "which holds its share of the batch's rows; if the model needs the whole batch (a reshape to a "
                    "fixed batch size, a row index beyond a micro-batch), it cannot be pipelined: use chunks=1"
                )
            raise
        env.update(zip(spec.outputs, outputs, strict=True))
        for name in self._layout.release[stage]:
            env.pop(name, None)

    def _check_batch_stats(self) -> None:
        if self.config.batch_stats == "allow" or self.config.chunks == 1:
            return
        found = [name for module in self._layout.modules for name in batch_stat_ops(module)]
        messages = []
        if found:
            messages.append(
                f"ops {', '.join(found[:3])}{' ...' if len(found) > 3 else ''} normalise with batch statistics "
                f"(BatchNorm in training); with {self.config.chunks} micro-batches each is normalised with its "
                "own statistics and running statistics are updated once per micro-batch, so results differ from "
                "the unsplit model; call .eval(), use chunks=1, or pass PipelineConfig(batch_stats='allow')"
            )
        written = state_written(self.meta["fxsplit_plan"])
        if written:
            messages.append(
                f"the forward updates {', '.join(map(repr, written[:3]))}{' ...' if len(written) > 3 else ''} in "
                f"place; with {self.config.chunks} micro-batches that runs once per micro-batch, each seeing its "
                "rows only, so the state (and what is computed from it) differs from the unsplit model's; use "
                "chunks=1, or pass PipelineConfig(batch_stats='allow') where that is what you want"
            )
        if self._row_mixing:
            messages.append(self._row_mixing)
        drawn = [label for module, found in self._random for label in labelled(module, drawing(found))]
        if drawn:
            messages.append(random_message(drawn, self.config.chunks))
        for message in messages:
            if self.config.batch_stats == "error":
                raise FxsplitError(message)
            warnings.warn(FxsplitWarning(message), stacklevel=user_stacklevel())

    def _check_rows(self, rows: list[int]) -> None:
        expected = self._traced_rows
        if expected is not None and any(r != expected for r in rows):
            raise FxsplitError(
                f"this pipeline was traced by torch.export on micro-batches of {expected} rows, which fixed the "
                f"shapes; a batch of {sum(rows)} rows makes micro-batches of {rows}; pass batches of "
                f"{expected * self.config.chunks} rows (chunks x {expected}), or split again with "
                "dynamic_shapes='batch' or trace='fx'"
            )


def mixing_message(
    graph_module: torch.fx.GraphModule,
    chunks: int,
    whole: Sequence[str] = (),
    allow: str = "pass PipelineConfig(batch_stats='allow')",
) -> str:
    """What :func:`~fxsplit.pipeline.rowmixing.row_mixing` finds in ``graph_module`` (``whole``: inputs every
    micro-batch gets whole), said for a pipeline of ``chunks`` micro-batches ("" when nothing, or one chunk);
    ``allow``: how to accept it."""
    if chunks == 1:
        return ""
    found = row_mixing(graph_module, whole=whole)
    if not found:
        return ""
    listed = "; ".join(str(f) for f in found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
    return (
        f"ops that mix the rows of the batch: {listed}; with {chunks} micro-batches each sees its own rows only, "
        "so results differ from the unsplit model; compute them outside the model (on the joined outputs), use "
        f"chunks=1, or {allow} where that is what you want"
    )


def random_message(drawn: Sequence[str], chunks: int, allow: str = "pass PipelineConfig(batch_stats='allow')") -> str:
    """What to say of ops that draw random numbers (:func:`~fxsplit.pipeline.batchstats.random_ops`, each
    :func:`~fxsplit.pipeline.batchstats.labelled`) in a pipeline of ``chunks`` micro-batches; ``allow``: how to
    accept it."""
    named = ", ".join(drawn[:3]) + (f" and {len(drawn) - 3} more" if len(drawn) > 3 else "")
    return (
        f"ops {named} draw random numbers (dropout in training); with {chunks} micro-batches they draw them per "
        "micro-batch, in the pipeline's order, so the numbers (and the outputs and gradients) can differ from the "
        "unsplit model's with the same seed (two such ops, or one on a GPU), though drawn from the same "
        f"distribution; call .eval() to compare, use chunks=1, or {allow} where that is what you want"
    )


def _traced_rows(split: torch.fx.GraphModule, stages: StageSplit, config: PipelineConfig) -> int | None:
    plan: Plan = split.meta["fxsplit_plan"]
    if plan.trace != "export" or plan.dynamic_shapes in ("batch", "all"):
        return None  # fx graphs, and export graphs whose batch may vary, take micro-batches of any size
    by_name = {n.name: n for n in split.graph.nodes}
    for name, target in zip(stages.input_names, stages.input_targets, strict=True):
        value = by_name[name].meta.get("val")
        if isinstance(value, torch.Tensor) and value.dim() > 0 and target not in config.broadcast:
            return int(value.shape[0])
    return None


def pipelined(split: torch.fx.GraphModule, config: PipelineConfig) -> Pipeline:
    """Wrap a module made by ``fxsplit.fxsplit`` as a :class:`Pipeline` (they share the weights).

    Raises:
        FxsplitError: the plan cannot be run as a sequence of stages.
    """
    plan: Plan = split.meta["fxsplit_plan"]
    made = Pipeline(split, split_stages(split, plan, relay=False), config)
    carry_root_hooks(made, split, "fx")  # the model's own hooks the split carries: the pipeline runs them
    return made
