"""Calling Hugging Face Accelerate the ways its users do, on logical devices.

Accelerate names devices in ``max_memory`` and device maps as ints (``0`` is
``cuda:0``, or the first accelerator), ``"mps"``, ``"cpu"`` and ``"disk"``; it
rejects any other key (``accelerate.utils.modeling.get_max_memory``). With no
GPU, int keys still work: ``get_max_memory`` only logs that device ``k`` is not
available. So the benchmarks give Accelerate ``max_memory = {0: b0, 1: b1,
...}`` (the budgets, in bytes, for devices ``cpu:0``, ``cpu:1``, ...) and read
int ``k`` in the result as ``cpu:k``. No ``"cpu"`` or ``"disk"`` key is given,
but ``infer_auto_device_map`` always appends ``"disk"``, and it keeps room for
the largest layer on device 0 (to swap in offloaded layers), so it spills
to ``"disk"`` when the budgets are tight.

Three ways of calling it:

* ``accelerate``: ``infer_auto_device_map(model, max_memory,
  no_split_module_classes=[<block classes>])`` (``model._no_split_modules`` for
  Hugging Face models), the documented call;
* ``accelerate-plain``: ``infer_auto_device_map(model, max_memory)``;
* ``hf-auto`` (Hugging Face models): what ``from_pretrained(...,
  device_map="auto", max_memory=...)`` computes in transformers 5.x
  (``transformers.integrations.accelerate._get_device_map``: balanced
  ``max_memory`` then transformers' copy of ``infer_auto_device_map``).

With offload (:func:`offload_map`, used by :mod:`benchmarks.offload`), ``max_memory``
also names ``"cpu"``: host memory for offloaded weights; what fits neither goes
to ``"disk"``.

To run a device map, :func:`dispatch` calls ``dispatch_model`` with each int
``k`` replaced by ``"cpu:k"`` and ``main_device="cpu:0"`` (left unset,
Accelerate picks an arbitrary element of a set). One shim is needed
(:func:`logical_cpu_devices`): Accelerate moves weights with
``set_module_tensor_to_device(module, name, "cpu:k")``, which on a GPU
leaves a weight already on the device alone, but on logical devices
``tensor.to("cpu:k")`` always copies and ``torch.device("cpu:k") !=
tensor.device`` (``cpu``), so it turns the parameter into a plain tensor copy
and fails at the next hook that touches it (and on tied weights). While
dispatching (and while running offloaded layers: a forward of a model with
offloaded modules must run inside :func:`logical_cpu_devices`), the shim hands
that function ``"cpu"`` instead of ``"cpu:k"``, where it acts as it would on a
GPU that already holds the weight; so a weight offloaded to ``"cpu"`` is used
in place where a GPU would copy it (one read from ``"disk"`` is still read
into new memory). The hooks themselves are unchanged: on every
call they send the module's inputs with ``tensor.to("cpu:k")``, which on
logical devices always copies (on a GPU it is a no-op when the tensor is
already there); :mod:`benchmarks.runtime_overhead` reports a hooks-only
variant for that reason.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from torch import nn

__all__ = [
    "VARIANTS",
    "accelerate_map",
    "dispatch",
    "hf_auto_map",
    "logical_cpu_devices",
    "offload_map",
    "plain_map",
    "variants_for",
]


def _quiet() -> None:
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    logging.getLogger("accelerate.utils.modeling").setLevel(logging.ERROR)
    logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)


def _max_memory(budgets: Sequence[int]) -> dict[int | str, int | str]:
    return {k: int(b) for k, b in enumerate(budgets)}


def accelerate_map(model: nn.Module, budgets: Sequence[int], block_classes: Sequence[str]) -> dict[str, Any]:
    """``infer_auto_device_map`` with the model's block classes as ``no_split_module_classes``."""
    from accelerate import infer_auto_device_map

    _quiet()
    return dict(
        infer_auto_device_map(model, max_memory=_max_memory(budgets), no_split_module_classes=list(block_classes))
    )


def plain_map(model: nn.Module, budgets: Sequence[int], block_classes: Sequence[str]) -> dict[str, Any]:
    """``infer_auto_device_map`` with only ``max_memory``."""
    from accelerate import infer_auto_device_map

    _quiet()
    return dict(infer_auto_device_map(model, max_memory=_max_memory(budgets)))


def hf_auto_map(model: nn.Module, budgets: Sequence[int], block_classes: Sequence[str]) -> dict[str, Any]:
    """The device map ``from_pretrained(device_map="auto", max_memory=...)`` computes."""
    from transformers.integrations.accelerate import _get_device_map

    _quiet()
    return dict(_get_device_map(model, "auto", _max_memory(budgets), None))  # type: ignore[arg-type]


def offload_map(model: nn.Module, budgets: Sequence[int], host: int, block_classes: Sequence[str]) -> dict[str, Any]:
    """The documented call with offload: ``max_memory`` names the devices and ``"cpu"`` (``host`` bytes for
    weights offloaded to host memory); what fits neither goes to ``"disk"``, which has no budget."""
    from accelerate import infer_auto_device_map

    _quiet()
    memory: dict[int | str, int | str] = {**_max_memory(budgets), "cpu": int(host)}
    return dict(infer_auto_device_map(model, max_memory=memory, no_split_module_classes=list(block_classes)))


VARIANTS: dict[str, Callable[[nn.Module, Sequence[int], Sequence[str]], dict[str, Any]]] = {
    "accelerate": accelerate_map,
    "accelerate-plain": plain_map,
    "hf-auto": hf_auto_map,
}


def variants_for(family: str) -> list[str]:
    """Accelerate variants that apply to a model family (``hf-auto`` needs a transformers model)."""
    return [v for v in VARIANTS if v != "hf-auto" or family == "hf"]


def dispatch(
    model: nn.Module,
    device_map: dict[str, Any],
    *,
    offload_dir: str | None = None,
    force_hooks: bool = False,
    main_device: str | None = None,
) -> nn.Module:
    """``dispatch_model`` on logical CPU devices: int ``k`` becomes ``"cpu:k"``; modifies ``model``.

    ``main_device``: where modules mapped to ``"cpu"``/``"disk"`` run (default: ``"cpu:0"`` if the map
    uses it, else the first device in the map, as ``dispatch_model`` picks).
    """
    from accelerate import dispatch_model

    _quiet()
    named = {k: (f"cpu:{v}" if isinstance(v, int) else v) for k, v in device_map.items()}
    main = next((v for v in named.values() if v not in ("cpu", "disk")), "cpu")
    main = main_device or ("cpu:0" if any(v == "cpu:0" for v in named.values()) else main)
    with logical_cpu_devices():
        return dispatch_model(model, named, main_device=main, offload_dir=offload_dir, force_hooks=force_hooks)


@contextmanager
def logical_cpu_devices() -> Iterator[None]:
    """Let Accelerate place weights on ``cpu:k`` as it would on a GPU that already holds them."""
    import accelerate.hooks as hooks

    original = hooks.set_module_tensor_to_device

    def place(module: nn.Module, name: str, device: Any, *args: Any, **kwargs: Any) -> Any:
        if str(device).startswith("cpu:"):
            device = "cpu"
        return original(module, name, device, *args, **kwargs)

    hooks.set_module_tensor_to_device = place
    try:
        yield
    finally:
        hooks.set_module_tensor_to_device = original
