"""The workspace an RNN kernel keeps for backward, which torch's fake kernels leave out.

On fake (or meta) tensors ``aten.mkldnn_rnn_layer`` (the CPU's oneDNN LSTM) returns an empty workspace, and
``aten._cudnn_rnn`` / ``aten.miopen_rnn`` an empty reserve (torch's meta kernels say "TODO: Query
cudnnGetRNNTrainingReserveSize"). The real kernels, in training, return one several times the layer's output
and autograd saves it until the backward: an LSTM planned without it needs up to seven times the activations
the plan charged (an 8-unit LSTM over 5 steps: 4,408 B planned, 30,648 B measured).

:func:`with_workspace` gives the op's outputs with a workspace of the size the kernel really makes:

* oneDNN's, found by running the kernel once on zeros of the same shapes and dtypes on the CPU (cached per
  shape); a sequence whose input is larger than :data:`PROBE_BYTES` is probed on its first steps and the size
  scaled up by the steps (the workspace grows with them; its fixed part makes this an over-estimate);
* cuDNN's and MIOpen's, estimated at :data:`BYTES_PER_STEP_UNIT` per step, sample and hidden unit of each layer
  and direction, in float32 (what oneDNN keeps on large layers, rounded up): no size query is exposed to Python.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

__all__ = ["BYTES_PER_STEP_UNIT", "PROBE_BYTES", "RNN_OPS", "with_workspace"]

PROBE_BYTES = 16 << 20
"""Largest input a probe runs on: longer sequences are probed on their first steps."""
BYTES_PER_STEP_UNIT = 16
"""cuDNN / MIOpen reserve per step, sample and hidden unit of a layer and direction, in float32 (an estimate)."""

_MKLDNN = torch.ops.aten.mkldnn_rnn_layer.default
_CUDNN = torch.ops.aten._cudnn_rnn.default
_MIOPEN = torch.ops.aten.miopen_rnn.default
RNN_OPS = frozenset({_MKLDNN, _CUDNN, _MIOPEN})
"""The ops whose fake kernels return an empty workspace (their fourth output)."""
_ARGS = {  # where each op takes the arguments the sizes depend on
    _MKLDNN: {"batch_first": 14},
    _CUDNN: {"train": 12, "hidden_size": 7, "num_layers": 9, "bidirectional": 13, "batch_sizes": 14},
    _MIOPEN: {"train": 10, "hidden_size": 6, "num_layers": 7, "bidirectional": 11, "batch_sizes": 12},
}


def with_workspace(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """``out`` of ``func(*args)`` (an op of :data:`RNN_OPS`, on fake tensors) with its workspace as large as the
    real kernel's; ``out`` unchanged when it is not empty or the kernel makes none (oneDNN's: with autograd off;
    cuDNN's and MIOpen's: with the ``train`` flag off)."""
    workspace = out[3]
    # oneDNN keeps one whenever autograd records (whatever the layer's train flag); cuDNN and MIOpen by the flag
    train = torch.is_grad_enabled() if func is _MKLDNN else bool(args[_ARGS[func]["train"]])
    if not train or workspace.numel():
        return out
    nbytes = _mkldnn_bytes(_signature(args)) if func is _MKLDNN else _reserve_bytes(func, args)
    made = torch.empty(nbytes, dtype=torch.uint8, device=workspace.device)
    return (*out[:3], made, *out[4:])


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with each tensor as its (shape, dtype), hashable."""
    return tuple(
        ("tensor", tuple(a.shape), a.dtype)
        if isinstance(a, torch.Tensor)
        else tuple(a)
        if isinstance(a, (list, tuple))
        else a
        for a in args
    )


@functools.lru_cache(maxsize=256)
def _mkldnn_bytes(signature: tuple[Any, ...]) -> int:
    """Bytes of the workspace ``mkldnn_rnn_layer`` returns for arguments of this signature (probed on the CPU)."""
    (_, shape, dtype), batch_first = signature[0], bool(signature[_ARGS[_MKLDNN]["batch_first"]])
    steps_at = 1 if batch_first else 0
    steps = shape[steps_at]
    per_step = math.prod(shape) * dtype.itemsize // max(steps, 1)
    probe_steps = max(1, min(steps, PROBE_BYTES // max(per_step, 1)))
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.enable_grad():  # real tensors on the CPU (no grad mode: no workspace)
        real: list[Any] = []
        for position, arg in enumerate(signature):
            if isinstance(arg, tuple) and arg and arg[0] == "tensor":
                size = list(arg[1])
                if position == 0:
                    size[steps_at] = probe_steps
                real.append(torch.zeros(size, dtype=arg[2]))
            elif position == 8:  # batch_sizes: an int list
                real.append(list(arg))
            else:
                real.append(arg)
        workspace = _MKLDNN(*real)[3]
    nbytes = 0 if workspace is None else workspace.numel() * workspace.element_size()
    return math.ceil(nbytes * steps / probe_steps) if probe_steps < steps else nbytes


def _reserve_bytes(func: Any, args: tuple[Any, ...]) -> int:
    """An estimate of a cuDNN or MIOpen reserve: see :data:`BYTES_PER_STEP_UNIT`."""
    at = _ARGS[func]
    input_, batch_sizes = args[0], args[at["batch_sizes"]]
    if len(batch_sizes):  # packed: one row per sample and step
        samples_steps = int(input_.shape[0])
    else:
        samples_steps = int(input_.shape[0]) * int(input_.shape[1])
    units = int(args[at["hidden_size"]]) * int(args[at["num_layers"]]) * (2 if args[at["bidirectional"]] else 1)
    return math.ceil(BYTES_PER_STEP_UNIT * input_.dtype.itemsize / 4 * samples_steps * units)
