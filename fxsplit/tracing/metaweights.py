"""A model whose weights are on ``meta`` (built to be filled from a checkpoint), exported as it runs for real.

torch.export cannot mix ``meta`` weights with real inputs, so such a model was exported with its inputs moved to
``meta`` too. The graph then is the one the model's code takes on ``meta``, which is not always the one it takes
on a real device:

* a tensor the forward makes from Python values (``qkv[..., [-2], :]`` makes an index tensor) is lifted into the
  graph as a constant on ``meta``, with no data, so no split of it can run (Falcon);
* a real buffer (GPT-J's rotary table) meets ``meta`` activations: export fails;
* code that branches on the device type (Mixtral's experts count tokens with ``histc`` in float32 on the CPU,
  in int32 elsewhere) takes the branch for ``meta``.

:func:`fake_weights_on` swaps the model's ``meta`` weights for fake tensors on the inputs' device (a fake holds no
memory) while export runs on fakes of the inputs, and then puts the model's own ``meta`` tensors into the
exported graph module in place of the fakes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

__all__ = ["fake_weights_on", "fakes_left", "inputs_device"]


@contextmanager
def fake_weights_on(
    model: torch.nn.Module, device: torch.device
) -> Iterator[tuple[Any, Callable[[torch.nn.Module], None]]]:
    """Inside the block, ``model``'s ``meta`` parameters and buffers are fakes on ``device``.

    Yields the ``FakeTensorMode`` they belong to (export the model on fakes of the inputs made by it) and
    ``restore(graph_module)``, which gives an exported graph module the model's own tensors back in place of the
    fakes. The model is as it was after the block.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    made: dict[int, torch.Tensor] = {}  # the model's tensor -> its fake (one per tensor, however many names)
    originals: dict[int, torch.Tensor] = {}  # a fake -> the model's tensor
    state: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        if tensor is None or not tensor.is_meta:
            continue
        fake = made.get(id(tensor))
        if fake is None:
            with mode:
                empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
            fake = made[id(tensor)] = (
                torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                if isinstance(tensor, torch.nn.Parameter)
                else empty
            )
            originals[id(fake)] = tensor
        state[name] = fake

    def restore(graph_module: torch.nn.Module) -> None:
        for module in graph_module.modules():
            for table in (module._parameters, module._buffers):
                for key, value in table.items():
                    if value is not None and id(value) in originals and made.get(id(originals[id(value)])) is value:
                        table[key] = originals[id(value)]  # type: ignore[assignment]  # the module's own tensor
        left = fakes_left(graph_module)
        if left:  # what torch.export raises for the model with real weights (it skips the check under a fake mode)
            raise RuntimeError(
                "We found a fake tensor in the exported program constant's list: the forward made a tensor that "
                f"torch.export could not follow (a write through .data, for one): {', '.join(left[:3])}"
            )

    with _reparametrize_module(model, state, tie_weights=True, strict=False):
        yield mode, restore


def fakes_left(graph_module: torch.nn.Module) -> list[str]:
    """The tensors a graph reads (``get_attr``) that are fakes: constants torch.export lifted from what the forward
    made and could not follow. On real weights export refuses such a graph; under a fake mode it keeps them."""
    from torch._subclasses.fake_tensor import FakeTensor

    from fxsplit.attrpath import attr_at

    graph = getattr(graph_module, "graph", None)
    nodes = [node for node in graph.nodes if node.op == "get_attr"] if graph is not None else []
    return [str(node.target) for node in nodes if isinstance(attr_at(graph_module, str(node.target), None), FakeTensor)]


def inputs_device(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device of the inputs, when the model's weights are on ``meta`` and its inputs are real (else None)."""
    import torch.utils._pytree as pytree

    leaves = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    real = [t.device for t in leaves if not t.is_meta]
    if not real or not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return None
    return real[0]
