"""Example inputs: can the model run them? Told apart from what a tracer cannot follow.

When ``torch.export`` fails on the example inputs, or fake shape propagation of
an fx graph does, the reason may be the inputs (a wrong width, a list where a
tensor goes, a keyword ``forward()`` does not take) or the tracer. fxsplit then
binds the inputs to ``forward``'s signature and runs the model once on fake
copies of the inputs and of its weights (no real compute, no memory for the
weights; the model's tensors are swapped for the fakes during the call and put
back after it). A complaint that comes from torch's shape and type checks, or
a ``TypeError``/``ValueError``/``IndexError``/``AssertionError``/``KeyError``
from the model's own code, means the model cannot run these inputs:
:class:`~fxsplit.errors.ExampleInputError`. Anything else (data-dependent
Python, an op fake tensors do not support, ``.numpy()``) says nothing about
the inputs, and the caller goes on.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import traceback
from typing import Any, Iterator, Mapping

import torch
from torch.utils._pytree import tree_map_only

from fxsplit.errors import ExampleInputError

__all__ = [
    "check_example_inputs",
    "describe_value",
    "first_line",
    "outputs_on_fakes",
    "quiet_fake_tensor_log",
    "user_frame",
]

_SHAPE_CHECKS = (
    "/torch/_meta_registrations.py",
    "/torch/_prims_common/",
    "/torch/_prims/",
    "/torch/_refs/",
    "/torch/_decomp/",
    "/torch/_subclasses/fake_impls.py",
)
"""Where torch checks the shapes of an op's inputs when it runs on fake tensors."""

_MODEL_COMPLAINTS = (TypeError, ValueError, IndexError, AssertionError, KeyError)
"""Errors that, raised by the model's code or argument parsing, are about the values it was given."""


def check_example_inputs(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    tracer_error: BaseException | None = None,
) -> None:
    """Raise if ``model(*args, **kwargs)`` cannot run; return if it runs or the run tells nothing about the inputs.

    ``tracer_error``: why the tracer (``torch.export``) failed on the same inputs. A fake run that stops on a
    shape or type check the tracer did not stop on (its error is something else, such as an output type it
    cannot flatten) is a limit of plain fake tensors, not of the inputs: a meta kernel stricter than the real
    one (``grouped_mm`` asks for bfloat16 on fakes, runs float32 on the CPU). The caller then reports the
    tracer's error, which is the real one.

    Raises:
        ExampleInputError: ``forward`` does not take these inputs, or refuses
            their shapes or types; names each input and the model's complaint.
    """
    signature = _signature(model)
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as unbound:
            raise ExampleInputError(
                _message(f"forward{_unannotated(signature)} does not take them: {unbound}", "", signature, args, kwargs)
            ) from None
    failure = _run_on_fakes(model, args, kwargs)
    if failure is not None and _rejects_inputs(failure) and _same_failure(failure, tracer_error):
        raise ExampleInputError(_message(first_line(failure), user_frame(failure), signature, args, kwargs)) from None


def _same_failure(failure: Exception, tracer_error: BaseException | None) -> bool:
    """Whether the tracer (if any) failed as the fake run did: on the inputs, or with the same complaint."""
    if tracer_error is None or _rejects_inputs(tracer_error):
        return True
    return first_line(tracer_error) == first_line(failure)


def _signature(model: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or an odd callable: nothing to bind against
        return None


def _unannotated(signature: inspect.Signature) -> inspect.Signature:
    """The signature as a caller reads it: ``(x, mask=None)``."""
    plain = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return signature.replace(parameters=plain, return_annotation=inspect.Signature.empty)


def _run_on_fakes(model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Exception | None:
    """Run the model on fake copies of the inputs and weights; the exception it raised, or None."""
    return outputs_on_fakes(model, args, kwargs)[1]


def outputs_on_fakes(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, no_grad: bool = True
) -> tuple[Any, Exception | None]:
    """Run the model on fake copies of the inputs and weights (under ``torch.no_grad()``, or with ``no_grad``
    False the caller's grad mode): what it returned (fake tensors) and None, or None and the exception it raised."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        fake_args, fake_kwargs = tree_map_only(torch.Tensor, mode.from_tensor, (tuple(args), dict(kwargs)))
        tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        state: dict[str, torch.Tensor] = {name: mode.from_tensor(t) for name, t in tensors if t is not None}
        with (
            quiet_fake_tensor_log(),
            torch.no_grad() if no_grad else contextlib.nullcontext(),
            _reparametrize_module(model, state, tie_weights=True, strict=False),
            mode,
        ):
            return model(*fake_args, **fake_kwargs), None
    except Exception as error:  # noqa: BLE001 - a model can raise anything; the caller sorts it
        return None, error


def _rejects_inputs(error: BaseException) -> bool:
    """Whether ``error`` is the model (or torch's checks) refusing the values given, not a limit of fake tensors."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedFakeTensorException,
        UnsupportedOperatorException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    limits = (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedFakeTensorException,
        UnsupportedOperatorException,
        GuardOnDataDependentSymNode,
        NotImplementedError,
    )
    if isinstance(error, limits):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    innermost = frames[-1] if frames else None
    raised_in = innermost.filename.replace("\\", "/") if innermost is not None else ""
    if any(part in raised_in for part in _SHAPE_CHECKS) or (innermost is not None and innermost.name == "_check_with"):
        return True
    internal = any(part in raised_in for part in ("/torch/_subclasses/", "/torch/fx/", "/torch/_dynamo/"))
    return isinstance(error, _MODEL_COMPLAINTS) and not internal


def describe_value(value: Any, depth: int = 0) -> str:
    """A short description of an input, for messages.

    >>> describe_value(torch.zeros(512, 64))
    'float32[512, 64]'
    >>> describe_value([torch.zeros(3, dtype=torch.int64), {"scale": 2.0}])
    "a list of 2: [int64[3], a dict of 1: {'scale': 2.0}]"
    """
    if isinstance(value, torch.Tensor):
        where = f" on {value.device}" if value.device.type not in ("cpu",) else ""
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}{where}"
    if isinstance(value, (list, tuple, dict)) and depth < 2:
        kind = "a list" if isinstance(value, list) else "a tuple" if isinstance(value, tuple) else "a dict"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        shown = [
            (f"{k!r}: " if isinstance(value, dict) else "") + describe_value(v, depth + 1)
            for _, (k, v) in zip(range(3), items, strict=False)
        ]
        more = ", ..." if len(value) > 3 else ""
        brackets = "{}" if isinstance(value, dict) else "[]"
        return f"{kind} of {len(value)}: {brackets[0]}{', '.join(shown)}{more}{brackets[1]}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _labels(signature: inspect.Signature | None, count: int) -> list[str]:
    """``x (example_inputs[0])`` for each positional input, with forward's parameter name where known."""
    positional = [
        p.name
        for p in (signature.parameters.values() if signature is not None else ())
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return [
        f"{positional[i]} (example_inputs[{i}])" if i < len(positional) else f"example_inputs[{i}]"
        for i in range(count)
    ]


def _message(
    complaint: str, where: str, signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> str:
    given = [f"{label} = {describe_value(v)}" for label, v in zip(_labels(signature, len(args)), args, strict=True)]
    given += [f"{name} (example_kwargs[{name!r}]) = {describe_value(v)}" for name, v in kwargs.items()]
    containers = sorted({type(v).__name__ for v in args if isinstance(v, (list, dict))})
    hint = ""
    if containers:
        hint = (
            f"\n  a {' or '.join(containers)} given as example_inputs (or inside its tuple) reaches forward() as "
            "one input: only a tuple is spread over forward()'s positional inputs (example_inputs=(x, y)); "
            "keyword inputs go in example_kwargs={...}"
        )
    return (
        f"the model cannot run on the example inputs: {complaint}"
        + (f"\n  at {where}" if where else "")
        + "\n  example inputs: "
        + ("; ".join(given) or "none")
        + hint
        + "\n  fix: pass example inputs like a real call of the model (same widths, dtypes and argument names): "
        "fxsplit sizes activations and cuts from them"
    )


def first_line(error: BaseException) -> str:
    """``"RuntimeError: <the first line of its message>"``."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def user_frame(error: BaseException) -> str:
    """The innermost frame of the traceback that is not inside torch, as 'file:line: code' (not code made at run
    time, ``<string>`` or an fx graph's ``<eval_with_key>``: it has no lines to show)."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        made = frame.filename.startswith("<")
        if not made and "/torch/" not in frame.filename and "/fxsplit/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}: {frame.line}"
    return ""


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """Keep torch from logging tracebacks and graphs for ops that fail on fake tensors (fxsplit reports the error).

    Loggers given a level of their own (``TORCH_LOGS=dynamic``, for one) are left as they are.
    """
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    quieted = [logger for logger in loggers if logger.level == logging.NOTSET]
    for logger in quieted:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger in quieted:
            logger.setLevel(logging.NOTSET)


_NOISY_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")
