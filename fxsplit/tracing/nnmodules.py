"""The torch.nn modules whose forward returns one tensor (a ``call_module`` of one of them holds a tensor)."""

from __future__ import annotations

import torch

__all__ = ["TENSOR_MODULES"]

TENSOR_MODULES = (
    torch.nn.Linear,
    torch.nn.Bilinear,
    torch.nn.modules.conv._ConvNd,
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.RMSNorm,
    torch.nn.Embedding,
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.Identity,
    torch.nn.Flatten,
    torch.nn.Unflatten,
    torch.nn.ReLU,
    torch.nn.ReLU6,
    torch.nn.GELU,
    torch.nn.SiLU,
    torch.nn.Tanh,
    torch.nn.Sigmoid,
    torch.nn.Softmax,
    torch.nn.LogSoftmax,
    torch.nn.LeakyReLU,
    torch.nn.ELU,
    torch.nn.Mish,
    torch.nn.Hardswish,
    torch.nn.Upsample,
    torch.nn.modules.pooling._AvgPoolNd,
    torch.nn.modules.pooling._AdaptiveAvgPoolNd,
)
