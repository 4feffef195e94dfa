"""Helpers that generated code calls at run time (kept tiny; no hooks)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

__all__ = ["Prefetched", "ReplicaStore", "arrive", "call_with_weights", "move", "prefetch", "replica", "write_back"]


def move(value: Any, device: str) -> Any:
    """Copy the tensors in ``value`` (nested tuples, lists, dicts) to ``device``; pass anything else through.

    The generated code uses ``tensor.to(device)`` where it knows a value is a
    tensor, and this where it cannot know (graphs traced without example inputs).
    """
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(move(v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(move(v, device) for v in value)
    if isinstance(value, dict):
        return type(value)((k, move(v, device)) for k, v in value.items())
    return value


def refuse_shared_inputs(values: tuple[Any, ...], names: tuple[str, ...], written: tuple[str, ...]) -> None:
    """Raise when an input the split writes in place shares memory with another input (``gm(t, t)``).

    The split copies each input to the devices that read it, so a write to one
    would not reach the other's copies, as it reaches the other in eager
    PyTorch: the result would differ silently. Called first, when a graph
    writes an input in place.
    """
    owners: dict[int, list[str]] = {}
    for name, value in zip(names, values, strict=True):
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                pointer = tensor.untyped_storage().data_ptr()
                if pointer:
                    owners.setdefault(pointer, []).append(name)
    for sharing in owners.values():
        if len(sharing) > 1 and set(sharing) & set(written):
            from fxsplit.errors import FxsplitError

            raise FxsplitError(
                f"inputs {', '.join(map(repr, sharing))} share memory, and the split writes "
                f"{', '.join(repr(n) for n in sharing if n in written)} in place: its copies on other devices "
                "would not see the write as the model does; pass separate tensors (.clone() one)"
            )


def write_back(original: Any, moved: Any) -> None:
    """Write the values of ``moved`` into the caller's ``original`` (an input the model updates in place).

    The split updates its copy of the input on the device that reads it;
    eager PyTorch would have updated the caller's tensor, so the generated
    code calls this after the input's last in-place update. Nested tuples,
    lists and dicts are written leaf by leaf; a tensor that *is* its copy (the
    input was already on that device) is left alone.
    """
    if isinstance(original, torch.Tensor) and isinstance(moved, torch.Tensor):
        if moved is not original:
            original.copy_(moved)
    elif isinstance(original, (tuple, list)) and isinstance(moved, (tuple, list)):
        for item, moved_item in zip(original, moved, strict=True):
            write_back(item, moved_item)
    elif isinstance(original, dict) and isinstance(moved, dict):
        for key, item in original.items():
            write_back(item, moved[key])


def call_with_weights(
    module: torch.nn.Module, weights: Mapping[str, torch.Tensor], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """Call ``module(*args, **kwargs)`` with some of its parameters and buffers replaced by ``weights``.

    The generated code calls this where a module runs on one device while
    some of its weights live on another (a tied weight): ``weights`` holds
    their copies, by name inside ``module``. Same as
    :func:`torch.func.functional_call`, which it calls on plain copies of the
    containers: an fx graph hands its arguments over as immutable containers
    (``torch.fx.Interpreter`` does), and ``functional_call`` may change them.
    """
    return torch.func.functional_call(module, dict(weights), tuple(args), dict(kwargs))


class Prefetched:
    """A weight's copy on its way to a CUDA device on a side stream; :func:`arrive` waits for it."""

    __slots__ = ("event", "tensor")

    def __init__(self, tensor: torch.Tensor, event: torch.cuda.Event) -> None:
        self.tensor = tensor
        self.event = event


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def prefetch(weight: torch.Tensor, device: str) -> torch.Tensor | Prefetched:
    """Start copying an offloaded ``weight`` to ``device``, ahead of the op that reads it.

    The generated code calls this some ops before the weight's reader and
    :func:`arrive` right before it. On a CUDA device the copy runs on a side
    stream (from pinned host memory it overlaps the ops in between); anywhere
    else it is a plain ``.to(device)`` (to a logical CPU device such as
    ``"cpu:0"`` a copy in host memory, freed after the op, as on a real device).
    """
    target = torch.device(device)
    if target.type != "cuda" or weight.device == target:
        return weight.to(target)
    stream = _side_stream(target)
    stream.wait_stream(torch.cuda.current_stream(target))  # the copy may reuse memory freed by earlier ops
    with torch.cuda.stream(stream):
        copy = weight.to(target, non_blocking=weight.is_pinned())
        event = torch.cuda.Event()
        event.record(stream)
    return Prefetched(copy, event)


def arrive(fetched: torch.Tensor | Prefetched) -> torch.Tensor:
    """The prefetched weight, once its copy is done (the current stream waits for it; nothing on CPU)."""
    if not isinstance(fetched, Prefetched):
        return fetched
    current = torch.cuda.current_stream(fetched.tensor.device)
    current.wait_event(fetched.event)
    fetched.tensor.record_stream(current)  # freed for the side stream only after the op that reads it
    return fetched.tensor


class ReplicaStore(torch.nn.Module):
    """The copies of read-only weights that a split holds on more devices than their home (``Plan.replicas``).

    Kept in a plain dictionary, not as buffers: the split's ``state_dict``
    stays the model's (it loads strictly into the original model), and
    ``.to()``, checkpoint loading and parameter listings see only the one
    weight. Each copy remembers the weight it was made from (storage,
    version counter, dtype, shape); when the weight changes (loaded, moved,
    updated in place by an optimizer), the next read makes it again.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[tuple[str, str], tuple[tuple[Any, ...], torch.Tensor]] = {}

    def get(self, name: str, weight: torch.Tensor, device: str) -> torch.Tensor:
        """The copy of ``weight`` (named ``name``) on ``device``, made (again) if it is missing or stale."""
        stamp = (weight.data_ptr(), weight._version, weight.dtype, weight.shape)
        entry = self.held.get((name, device))
        if entry is not None and entry[0] == stamp:
            return entry[1]
        with torch.no_grad():
            copy = weight.detach().to(device, copy=True)
        self.held[(name, device)] = (stamp, copy)
        return copy


class _ReadReplica(torch.autograd.Function):
    """Forward: the replica; backward: its gradient goes to the weight, on the weight's device (and is summed
    there with the gradients of its other readers, as for one tensor)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.home = weight.device
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.home), None


def replica(store: ReplicaStore, name: str, weight: torch.Tensor, device: str) -> torch.Tensor:
    """Weight ``name`` as held on ``device`` (not its home): the device's own copy, no copy per call.

    The generated code calls this where an op reads a replicated weight on a
    device that holds a replica. With autograd recording, the gradient that
    flows into the replica reaches ``weight`` (copied to its device in
    backward), so gradients are those of the unsplit model.
    """
    copy = store.get(name, weight, device)
    if weight.requires_grad and torch.is_grad_enabled():
        return _ReadReplica.apply(weight, copy)
    return copy
