"""The ops whose result shares its input's storage, as fxsplit follows writes back to the tensor they change.

A write through a view changes its base: :func:`fxsplit.tracing.graphinfo.alias_root`
follows these back, so the writer runs where the base lives and readers elsewhere get
copies made after the write. ATen ops (torch.export graphs) say so in their schemas;
these tables cover the methods, functions and attributes of fx graphs. Ops that
return the tensor itself only when there is nothing to convert (``contiguous``,
``.to(dtype)``) are taken as views: a copy taken for a view only narrows where the
writer may go, while a view taken for a copy would miss the write.
"""

from __future__ import annotations

import operator

import torch

__all__ = ["VIEW_ATTRS", "VIEW_FUNCTIONS", "VIEW_METHODS"]

VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "transpose",
        "permute",
        "squeeze",
        "unsqueeze",
        "expand",
        "expand_as",
        "narrow",
        "select",
        "t",
        "flatten",
        "unflatten",
        "as_strided",
        "split",
        "chunk",
        "unbind",
        "detach",
        "movedim",
        "swapaxes",
        "diagonal",
        "unfold",
        "__getitem__",
        "T",
        "mT",
        "ravel",
        "view_as_real",
        "broadcast_to",
        "tensor_split",
        "split_with_sizes",
        "hsplit",
        "vsplit",
        "dsplit",
        # the tensor itself when there is nothing to convert (see above)
        "contiguous",
        "to",
        "type",
        "type_as",
        "float",
        "double",
        "half",
        "bfloat16",
        "cpu",
        "cuda",
        "requires_grad_",
    }
)
VIEW_FUNCTIONS = {
    torch.reshape,
    torch.transpose,
    torch.permute,
    torch.squeeze,
    torch.unsqueeze,
    torch.flatten,
    torch.narrow,
    torch.select,
    torch.split,
    torch.chunk,
    torch.unbind,
    torch.movedim,
    torch.t,
    torch.detach,
    operator.getitem,
    torch.ravel,
    torch.diagonal,
    torch.swapaxes,
    torch.swapdims,
    torch.broadcast_to,
    torch.as_strided,
    torch.atleast_1d,
    torch.atleast_2d,
    torch.atleast_3d,
    torch.tensor_split,
    torch.hsplit,
    torch.vsplit,
    torch.dsplit,
    torch.view_as_real,
    torch.view_as_complex,
}
VIEW_ATTRS = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
