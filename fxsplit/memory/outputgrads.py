"""The gradients a loss gives a model's outputs, for the simulation (:mod:`fxsplit.memory.lifetimes`).

A loss over the outputs makes each output's gradient as the backward starts. An output's storage then has its
gradient from the start of the backward (it is *seeded*) and what the output's readers send is added into it.
Three cases make more than that one gradient:

* another output is a view of the same storage (``h.view(-1)`` and ``h.t()``): its own gradient, from the loss;
* an output is a part of a bigger value (``h[0]``): its gradient is the part's size until the view's backward
  makes one of all of ``h``; ``h`` is not seeded, so its first gradient may be one another op hands on (a view of
  ``cat``'s);
* a value returned more than once (``(y, y)``): the loss's next gradient is added into the first as the
  backward starts, both held for a moment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Mapping, Sequence

if TYPE_CHECKING:
    from fxsplit.memory.activationprofile import ActivationProfile
    from fxsplit.memory.lifetimes import _Storage

__all__ = ["loss_gradients"]


def loss_gradients(
    profile: ActivationProfile,
    on: Mapping[tuple[str, Hashable], Mapping[int, int | None]],
    home: Mapping[str, Hashable],
    storages: Sequence[_Storage],
    returned_on: Hashable,
) -> tuple[list[tuple[Hashable, int, int, int]], set[int]]:
    """``(seeds, seeded)``: the ``(device, first, last, nbytes)`` spans of the loss's gradients that are tensors of
    their own, and the simulated storages whose gradient is the loss's from the start of the backward.

    Args:
        profile: the model's profile.
        on: ``(value, device) ->`` its simulated storages there (None: a resident weight).
        home: each value's device.
        storages: the simulated storages.
        returned_on: the device the outputs are returned on (copies held there are seeded too).
    """
    end, seeds, seeded, parts = len(profile.op_names), [], set[int](), set[int]()
    position = profile.positions
    for name in dict.fromkeys(profile.outputs):
        info = profile.values[name]
        here = {i for i in on.get((name, home[name]), {}).values() if i is not None}
        if not info.requires_grad or not here:
            continue
        if info.nbytes < min(storages[i].nbytes for i in here) and name in position:  # a part of a bigger value
            seeds.append((storages[min(here)].device, position[name], end, info.nbytes))
            parts.update(here)
            continue
        if here & seeded:  # another output is a view of the same storage
            first = min(here, key=lambda i: storages[i].alloc)
            seeds.append((storages[first].device, storages[first].alloc, end, info.nbytes))
        seeded.update(i for i in here if not storages[i].copied)
    # on the outputs' device, a copy's too; not a value only a part of which is returned
    seeded.update(i for i, s in enumerate(storages) if s.held and (i not in parts or i in seeded))
    for name in profile.repeated_outputs:  # returned more than once
        if profile.values[name].requires_grad:
            seeds.append((returned_on, end, end, profile.values[name].nbytes))
    return seeds, seeded
