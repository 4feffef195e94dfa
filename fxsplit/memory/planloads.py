"""What each op adds to a device's activation memory, for the partitioner: :func:`planning_loads`.

The partitioner charges a contiguous run of ops ``sum(op_extra) + max(op_transient)``; these come from one
simulation of the whole graph on one device (:mod:`fxsplit.memory.lifetimes`). What depends on where the ops
run (copies between devices, the gradients of a weight read on several devices) the exact simulation of the
final plan adds.
"""

from __future__ import annotations

from fxsplit.memory.lifetimes import ActivationProfile, _add, _kept_from, _walk, simulate

__all__ = ["charge_slack", "planning_loads"]


def planning_loads(profile: ActivationProfile) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-op ``(op_extra, op_transient)`` for the partitioner, from a one-device simulation.

    Inference: ``op_transient[i]`` is the bytes live while op ``i`` runs (its
    inputs, its result, everything still waiting for a later reader, its
    internal intermediates); ``op_extra`` is zero. Training: ``op_extra[i]``
    is what op ``i`` is first to save for backward, or returns (both stay
    to the end of the backward), and ``op_transient[i]`` the larger of the
    other bytes live in forward and the gradients live in backward at
    ``i``. A device running ops ``[a, b)`` then needs ``sum(op_extra[a:b])
    + max(op_transient[a:b])`` - an upper bound of its simulated peak, save
    for copies between devices, which the final check adds.
    """
    n = len(profile.op_names)
    walk = _walk(profile, [0] * n, dict.fromkeys(profile.inputs, 0), dict.fromkeys(profile.weights, 0), 0)
    internal = profile.per_op("internal")
    live = [0] * (n + 2)
    grads = [0] * (n + 2)
    extra = [0] * n
    for s in walk.storages:
        stop = min(s.last, n - 1)
        kept = _kept_from(s) if profile.training else None
        if kept is not None:  # saved for backward, or an output held through it: stays to the end
            extra[min(kept, n - 1)] += s.nbytes
            stop = min(stop, kept - 1)
        if stop >= s.alloc:
            _add(live, s.alloc, stop, s.nbytes)
    if profile.training:
        for _, first, last, nbytes in walk.gradients():
            _add(grads, first, min(last, n - 1), nbytes)
        for _, first, last, nbytes in walk.held_gradients():
            _add(grads, first, min(last, n - 1), nbytes)
        for _, first, last, nbytes in walk.contributions(weights=False):  # a weight's depend on where its readers
            _add(grads, first, min(last, n - 1), nbytes)  # run (another process sums its copy's): the check adds them
    backward_internal = profile.per_op("backward_internal")
    transient = []
    running_live = running_grads = 0
    for op in range(n):
        running_live += live[op]
        running_grads += grads[op]
        transient.append(max(running_live + internal[op], running_grads + backward_internal[op]))
    return tuple(extra), tuple(transient)


def charge_slack(profile: ActivationProfile) -> int:
    """How much the partitioner's charge for all ops on one device exceeds their exact simulation there.

    The charge is an upper bound: it holds what an op saves for the whole backward, where the run frees it after
    the backward of the op that saved it. A budget that holds the whole model exactly is short by this under the
    charge; :func:`~fxsplit.memory.fit.fit_budgets` allows it before it gives up, and the exact check of the plan
    keeps every budget.
    """
    n = len(profile.op_names)
    extra, transient = planning_loads(profile)
    exact = simulate(profile, [0] * n, dict.fromkeys(profile.inputs, 0), 0, dict.fromkeys(profile.weights, 0))
    return max(0, sum(extra) + max(transient, default=0) - exact.peak.get(0, 0))
