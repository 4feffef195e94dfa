"""Shapes for a torch.fx graph: every node's ``meta["val"]``, from running the graph on fake tensors.

torch.export records them itself; a torch.fx graph gets them here, from the example inputs, with the model's
weights replaced by fakes (no memory, no compute, and no in-place update reaches the user's tensors).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxsplit.tracing.example_inputs import first_line, quiet_fake_tensor_log
from fxsplit.tracing.fakeweights import fake_weights, named_tensors
from fxsplit.tracing.gradmode import modes_kept
from fxsplit.tracing.metaweights import inputs_device
from fxsplit.tracing.mixeddtypes import INSIDE, InsideModules, looks_inside

__all__ = ["propagate_shapes"]


def propagate_shapes(
    graph_module: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> str | None:
    """Record ``meta["val"]`` on every node by running on fake tensors; why that failed, or None."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    unknown = sorted(set(kwargs) - {str(n.target) for n in placeholders[len(args) :]})
    if unknown:
        return f"example_kwargs {unknown} are not inputs of the traced graph"
    flat = list(args) + [kwargs[n.target] for n in placeholders[len(args) :] if n.target in kwargs]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    kept = modes_kept()  # the graph may set them (recorded no_grad and autocast blocks)
    kept.__enter__()
    try:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in flat]
        # fake copies of the weights, so in-place updates (BatchNorm's running stats) never reach the user's tensors;
        # weights on meta beside real inputs as fakes on the inputs' device, whose kernels the split runs (a bf16
        # layer norm's statistics are bf16 on the CPU, float32 on meta), as torch.export traces them
        on = inputs_device(graph_module, tuple(args), dict(kwargs))
        state = fake_weights(mode, named_tensors(graph_module), requires_grad=lambda t: t.requires_grad, meta_on=on)
        with quiet_fake_tensor_log(), _reparametrize_module(graph_module, state, tie_weights=True, strict=False):
            _Propagation(graph_module, mode).propagate(*fake)
        for node, given in zip(placeholders, flat, strict=False):  # (it keeps detached copies): an input's gradient
            if isinstance(given, torch.Tensor) and given.requires_grad and given.is_floating_point():
                node.meta["val"].requires_grad_(True)
        for node in placeholders[len(flat) :]:  # an input not given, left at its default (attn_mask=None)
            if "val" not in node.meta and node.args and not isinstance(node.args[0], torch.Tensor):
                node.meta["val"] = node.args[0]
    except Exception as error:  # noqa: BLE001 - shapes are an optimisation; plan without them (and say so)
        for node in graph_module.graph.nodes:
            node.meta.pop("val", None)
            node.meta.pop(INSIDE, None)
        return first_line(error)
    finally:
        kept.__exit__(None, None, None)
    return None


class _Propagation(FakeTensorProp):
    """FakeTensorProp that also looks inside each module the graph calls as one op (a leaf) for ops that take
    floating dtypes their kernels refuse together (:class:`~fxsplit.tracing.mixeddtypes.InsideModules`), and
    keeps them in the node's ``meta[INSIDE]``: the graph shows the module, not its ops."""

    def run_node(self, n: torch.fx.Node) -> Any:
        n.meta.pop(INSIDE, None)
        if n.op != "call_module" or not looks_inside(self.fetch_attr(str(n.target))):
            return super().run_node(n)
        with InsideModules() as inside:
            result = super().run_node(n)
        if inside.found:
            n.meta[INSIDE] = inside.found
        return result
