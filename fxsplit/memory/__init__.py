"""Stage 3, memory: what a device holds (weights, gradients, optimizer state, activations) and its budget.

* :mod:`~fxsplit.memory.model`: :class:`MemoryModel` per mode: what each device of a plan holds.
* :mod:`~fxsplit.memory.memspec`: :class:`MemorySpec`, the mode and optimizer, validated.
* :mod:`~fxsplit.memory.fit`: :func:`fit_budgets`, plan until every device's row fits.
* :mod:`~fxsplit.memory.wording`: the words of memory errors (each component of a row named and advised on).
* :mod:`~fxsplit.memory.activations`: profile a graph's activations once, on fake tensors, with
  :mod:`~fxsplit.memory.allocations` (what each op and each op's backward allocates) and the fixes for what
  fake kernels leave out (:mod:`~fxsplit.memory.rnnworkspace`, :mod:`~fxsplit.memory.losscapacity`); the tensors
  a graph reads by name, and fakes in their place (:mod:`~fxsplit.memory.graphtensors`); the fake weights,
  inputs and kernels it runs on (:mod:`~fxsplit.memory.fakerun`).
* :mod:`~fxsplit.memory.activationprofile`: the profile, plain data.
* :mod:`~fxsplit.memory.charge`: the memory model a traced graph is charged by (warns when activations cannot be).
* :mod:`~fxsplit.memory.lifetimes`: simulate activation memory for any placement (no torch), with
  :mod:`~fxsplit.memory.weightgrads` (where a weight's gradients are summed).
* :mod:`~fxsplit.memory.planloads`: each op's share of it, for the partitioner.
* :mod:`~fxsplit.memory.measure`: measure what a split really allocates (tests, benchmarks).
* :mod:`~fxsplit.memory.autobudget`: budgets from the free memory of the visible GPUs.
"""

from fxsplit.memory.fit import fit_budgets
from fxsplit.memory.model import MemoryModel, MemorySpec

__all__ = ["MemoryModel", "MemorySpec", "fit_budgets"]
