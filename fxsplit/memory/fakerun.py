"""How :mod:`fxsplit.memory.activations` runs a graph on fake tensors: the weights and inputs it runs on, and the
kernels it stands in for so that the profile holds what a real device's kernels hold (fused attention; the
composite path of ``nn.MultiheadAttention``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx

from fxsplit.memory.graphtensors import graph_tensors
from fxsplit.tracing.fakeweights import fake_weights as _fakes_of

__all__ = ["SDPA", "fake_input", "fake_weights", "fused_attention", "inputs_device", "slow_path"]


def fake_weights(
    graph_module: torch.fx.GraphModule, mode: Any, training: bool, meta_on: torch.device | None = None
) -> dict[str, torch.Tensor]:
    def trained(tensor: torch.Tensor) -> bool:
        return training and isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad

    return _fakes_of(mode, graph_tensors(graph_module), trained, meta_on)


def inputs_device(placeholders: list[torch.fx.Node]) -> torch.device | None:
    """The device of the graph's tensor inputs when it is not ``meta``: where the model's ``meta`` weights were
    when it was exported (:mod:`fxsplit.tracing.metaweights`), so their fakes go there too."""
    devices = [v.device for n in placeholders if isinstance(v := n.meta["val"], torch.Tensor)]
    return next((d for d in devices if d.type != "meta"), None)


def fake_input(value: Any, mode: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if getattr(value, "fake_mode", None) is mode:
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


SDPA = torch.nn.functional.scaled_dot_product_attention


def fused_attention(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``scaled_dot_product_attention`` on meta tensors as a fused kernel would run it; None if it cannot.

    On ``meta`` torch takes the math path, which materialises the attention
    matrix (and saves it for backward) where every real device's fused
    kernel keeps only the output and a log-sum-exp per row; plan for the
    latter.
    """
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args, strict=False)) | kwargs
    query = bound.get("query")
    if not isinstance(query, torch.Tensor) or query.device.type != "meta" or bound.get("enable_gqa"):
        return None
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        query,
        bound["key"],
        bound["value"],
        float(bound.get("dropout_p", 0.0)),
        bool(bound.get("is_causal", False)),
        attn_mask=bound.get("attn_mask"),
        scale=bound.get("scale"),
    )
    return out[0]


@contextlib.contextmanager
def slow_path() -> Iterator[None]:
    """``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` run their composite path: the fused fast path's
    fake kernel returns only its result, while the real kernel holds the projections and scores it computes."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
