"""Custom autograd Functions met while tracing: their backward is not in the graph.

A ``torch.autograd.Function`` subclass defines its own backward (a gradient
reversal layer returns ``-grad``; a straight-through estimator passes the
gradient of ``round`` through unchanged). Neither tracer keeps the Function:
torch.fx and torch.export both record the ops of its ``forward``, so the split
computes the model's values but, in backward, the gradients of those ops
(``-grad`` becomes ``grad``, the estimator's gradient becomes zero).

:func:`recording_functions` notes each such call made while tracing (torch's
own Functions aside: activation checkpointing is :mod:`fxsplit.tracing.checkpoints`),
and :func:`custom_backward_message` says what that means: a training plan is
refused, any other plan warns that the split must not be trained.

>>> import torch
>>> class Flip(torch.autograd.Function):
...     @staticmethod
...     def forward(ctx, x):
...         return x.clone()
...     @staticmethod
...     def backward(ctx, grad):
...         return -grad
>>> with recording_functions() as met:
...     _ = Flip.apply(torch.ones(2))
>>> met
['Flip']
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from torch.autograd.function import Function

__all__ = ["custom_backward_message", "recording_functions"]


@contextmanager
def recording_functions() -> Iterator[list[str]]:
    """Inside the block, each call of a ``torch.autograd.Function`` defined outside torch is recorded (its
    qualified name, in call order); the call itself runs as before."""
    met: list[str] = []
    original = Function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not cls.__module__.startswith("torch."):
            met.append(cls.__qualname__)
        return original.__func__(cls, *args, **kwargs)

    Function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield met
    finally:
        Function.apply = original  # type: ignore[method-assign]


def custom_backward_message(met: Sequence[str], training: bool) -> str:
    """Why a split of a model that calls the custom Functions ``met`` (non-empty) cannot train, and what to do."""
    unique = list(dict.fromkeys(met))
    shown = ", ".join(map(repr, unique[:4])) + (f" and {len(unique) - 4} more" if len(unique) > 4 else "")
    what = (
        f"the model calls custom autograd Functions ({shown}) whose backward the traced graph cannot keep: it holds "
        "the ops of their forward, so the split's outputs are the model's but its gradients would not be"
    )
    fix = (
        "trace with trace='fx' and declare the module that calls each one a leaf (leaf_modules=[...]): a leaf runs "
        "as written, its Function's backward included"
    )
    if training:
        return f"{what}; fxsplit refuses to plan it for training. To train it, {fix}"
    return f"{what}: do not train this split. To train, {fix}, and plan with mode='training'"
