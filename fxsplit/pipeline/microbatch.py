"""Split a batch into micro-batches, and put the outputs of the micro-batches back together.

Inputs: every tensor with at least one dimension is split along dim 0 into
``chunks`` pieces (``torch.tensor_split``: sizes differ by at most one row);
they must all have the same number of rows. Anything else (numbers, strings,
``None``, 0-dim tensors, and inputs named in ``broadcast``) is given whole to
every micro-batch. Inputs may be nested (tuples, lists, dicts, any pytree).

Outputs, leaf by leaf over the output structure (tuples, dicts, Hugging Face
``ModelOutput`` ...): tensors with a dimension are concatenated along dim 0;
floating 0-dim tensors (a loss computed inside the model) are averaged,
weighted by rows, which equals the full-batch value only when the model
averages over samples (a warning says so). A number that is not a tensor
(``x.shape[0]``, ``loss.item()``) cannot be combined: one that differs between
micro-batches is an error, one that does not comes from the first micro-batch
with a warning (it may still depend on the batch, as a row count does); other
values (strings, ``None``, flags) come from the first micro-batch.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Collection, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from fxsplit.callsite import user_stacklevel
from fxsplit.errors import FxsplitError, FxsplitWarning, SpecError

__all__ = ["argument_names", "first_microbatch", "gather", "on_one_microbatch", "one_microbatch_shapes", "scatter"]


def scatter(
    inputs: Sequence[Any], names: Sequence[str], chunks: int, broadcast: Collection[str] = ()
) -> tuple[list[list[Any]], list[int]]:
    """Split ``inputs`` (named by ``names``) into ``chunks`` micro-batches.

    Returns:
        The micro-batches (each a list like ``inputs``) and the rows of each.

    Raises:
        FxsplitError: no input has a batch dimension, two inputs disagree on
            the number of rows, or there are fewer rows than chunks.

    Example:
        >>> import torch
        >>> parts, rows = scatter([torch.arange(5), 2.0], ["x", "scale"], 2)
        >>> [p[0].tolist() for p in parts], [p[1] for p in parts], rows
        ([[0, 1, 2], [3, 4]], [2.0, 2.0], [3, 2])
    """
    flat = [pytree.tree_flatten_with_path(value) for value in inputs]
    rows: int | None = None
    first = ""
    split: dict[tuple[int, int], Any] = {}
    for position, (paths, _) in enumerate(flat):
        top = names[position]
        for index, (path, leaf) in enumerate(paths):
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or top in broadcast:
                continue
            name = top + pytree.keystr(path)
            if rows is None:
                rows, first = leaf.size(0), name
            elif leaf.size(0) != rows:
                raise FxsplitError(
                    f"input '{name}' has {leaf.size(0)} rows along dim 0 but '{first}' has {rows}; pipelining "
                    f"splits every tensor input along dim 0 into micro-batches; to give every micro-batch the whole "
                    f"of '{top}', pass PipelineConfig(broadcast=({top!r},))"
                )
            split[position, index] = torch.tensor_split(leaf, chunks)
    if rows is None and chunks == 1:
        return [list(inputs)], [0]  # nothing to split, and no need to
    if rows is None:
        raise FxsplitError(
            f"no tensor input has a batch dimension to split into micro-batches (inputs: "
            f"{', '.join(names) or 'none'}); pipelining needs one"
        )
    if rows < chunks:
        raise FxsplitError(
            f"a batch of {rows} rows (in '{first}') cannot be split into {chunks} micro-batches; "
            f"pass at least {chunks} rows or use fewer chunks"
        )
    sizes = [int(piece.size(0)) for piece in next(iter(split.values()))]
    parts = []
    for c in range(chunks):
        part = []
        for position, (paths, spec) in enumerate(flat):
            leaves = [split[position, i][c] if (position, i) in split else leaf for i, (_, leaf) in enumerate(paths)]
            part.append(pytree.tree_unflatten(leaves, spec))
        parts.append(part)
    return parts, sizes


def gather(outputs: Sequence[Any], rows: Sequence[int]) -> Any:
    """Put the outputs of the micro-batches (with ``rows`` rows each) back into one output.

    Example:
        >>> import torch
        >>> out = gather([{"y": torch.ones(2, 1), "loss": torch.tensor(1.0)},
        ...               {"y": torch.zeros(1, 1), "loss": torch.tensor(4.0)}], [2, 1])
        >>> out["y"].tolist(), out["loss"].item()
        ([[1.0], [1.0], [0.0]], 2.0)
    """
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    for _, other in flat[1:]:
        if other != spec:
            raise FxsplitError(
                f"micro-batches returned different output structures ({spec} vs {other}); "
                "pipelining needs the model to return the same structure for every micro-batch"
            )
    total = sum(rows)
    merged: list[Any] = []
    for index, values in enumerate(zip(*(leaves for leaves, _ in flat), strict=True)):
        head = values[0]
        if not isinstance(head, torch.Tensor):
            merged.append(_same_value(index, values))
        elif len(values) == 1:
            merged.append(head)
        elif head.dim() > 0:
            merged.append(torch.cat(values))
        elif head.is_floating_point() or head.is_complex():
            warnings.warn(
                f"output leaf {index} is a 0-dim tensor (a loss computed in the model?); pipelining averages "
                "it over micro-batches weighted by rows, which equals the full-batch value only when the model "
                "averages over samples",
                FxsplitWarning,
                stacklevel=user_stacklevel(),
            )
            merged.append(sum(v * (n / total) for v, n in zip(values, rows, strict=True)))
        else:
            raise FxsplitError(
                f"output leaf {index} is a 0-dim {head.dtype} tensor; pipelining cannot combine it "
                "over micro-batches (return it with a batch dimension)"
            )
    return pytree.tree_unflatten(merged, spec)


def first_microbatch(
    example_inputs: tuple[Any, ...] | None,
    example_kwargs: Mapping[str, Any] | None,
    chunks: int,
    broadcast: Collection[str] = (),
    arg_names: Sequence[str] = (),
) -> tuple[tuple[Any, ...] | None, dict[str, Any] | None]:
    """The first of ``chunks`` micro-batches of the example inputs, to trace with.

    ``torch.export`` fixes shapes when it traces, so a pipelined model is traced
    on one micro-batch; the example batch must split evenly. Inputs named in
    ``broadcast`` are given whole, as the pipeline gives them to every
    micro-batch; ``arg_names``: the names of the positional inputs (the model's
    ``forward`` arguments), which ``broadcast`` names.

    Raises:
        SpecError: the example batch does not split into equal micro-batches.
    """
    if example_inputs is None and not example_kwargs:
        return example_inputs, dict(example_kwargs) if example_kwargs else None
    args = tuple(example_inputs or ())
    kwargs = dict(example_kwargs or {})
    names = [arg_names[i] if i < len(arg_names) else f"example_inputs[{i}]" for i in range(len(args))] + list(kwargs)
    try:
        parts, rows = scatter([*args, *kwargs.values()], names, chunks, broadcast)
    except FxsplitError as error:
        raise SpecError(f"pipeline: {error}") from error
    if len(set(rows)) > 1:
        raise SpecError(
            f"pipeline: the example batch of {sum(rows)} rows does not split evenly into {chunks} micro-batches "
            f"({rows}); the model is traced on one micro-batch, so pass an example batch of a multiple of "
            f"{chunks} rows"
        )
    # Own copies: a slice would keep (and be charged for) the whole example batch's storage.
    first = [v.clone() if isinstance(v, torch.Tensor) else v for v in parts[0]]
    return (
        tuple(first[: len(args)]) if example_inputs is not None else None,
        dict(zip(kwargs, first[len(args) :], strict=True)) if example_kwargs else None,
    )


def argument_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The names of ``model.forward``'s positional arguments, in order, up to a ``*args`` (none if unknown).

    >>> argument_names(torch.nn.Linear(2, 2))
    ('input',)
    """
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    names = []
    for parameter in parameters:
        if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            break
        names.append(parameter.name)
    return tuple(names)


def on_one_microbatch(message: str, chunks: int) -> str:
    """``message`` (tracing failed on the traced example inputs) said of a pipeline's first micro-batch."""
    return (
        f"with pipeline chunks={chunks} the model is traced on one micro-batch (the first 1/{chunks} of the example "
        f"batch's rows), and {message}\n  if the model needs more rows than one micro-batch holds (it indexes a row "
        "of the batch, or reshapes it by a fixed batch size), it mixes the rows of the batch, which micro-batches "
        "cannot split: use chunks=1, or an example batch of chunks x the rows it needs"
    )


def one_microbatch_shapes(traced: Any, whole: tuple[Any, Any], chunks: int) -> Any:
    """``traced`` (a torch.fx trace of one micro-batch, whose shapes could not be found on it), with its
    ``shapes_missing`` said of the micro-batch; when its graph runs on the whole example batch ``whole``
    (``(positional, keyword)``), raise instead: the model needs more rows than a micro-batch holds, and
    the pipeline would fail at its first run (torch.export refuses such a model when it traces).

    Raises:
        TraceError: the graph runs on the whole example batch and not on one micro-batch of it.
    """
    from fxsplit.errors import TraceError
    from fxsplit.tracing.fxshapes import propagate_shapes

    args, kwargs = whole
    if traced.method == "fx" and (args is not None or kwargs):
        if propagate_shapes(traced.graph_module, tuple(args or ()), dict(kwargs or {})) is None:
            missing = str(traced.shapes_missing).rstrip(".")
            raise TraceError(on_one_microbatch(f"{missing}, where the whole example batch runs", chunks))
    said = on_one_microbatch(traced.shapes_missing, chunks).replace("\n  ", "; ")
    return dataclasses.replace(traced, shapes_missing=said)


def _same_value(index: int, values: Sequence[Any]) -> Any:
    """The value of a non-tensor output leaf, the same in every micro-batch; raise or warn where it may not be
    the whole batch's."""
    head = values[0]
    if len(values) == 1 or not isinstance(head, (int, float, complex)) or isinstance(head, bool):
        return head
    if any(v != head for v in values[1:]):
        raise FxsplitError(
            f"output leaf {index} is a number that is not a tensor and differs between micro-batches "
            f"({', '.join(map(repr, values[:4]))}{', ...' if len(values) > 4 else ''}); pipelining cannot combine it "
            "into the whole batch's value: return it as a tensor (with a batch dimension to concatenate, or 0-dim "
            "to average), or compute it outside the model"
        )
    warnings.warn(
        f"output leaf {index} is a number that is not a tensor ({head!r} in every micro-batch); pipelining returns "
        "the first micro-batch's value, which is not the whole batch's if it depends on the batch (a row count)",
        FxsplitWarning,
        stacklevel=user_stacklevel(),
    )
    return head
