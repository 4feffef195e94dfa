"""Stage 5, planning: the :class:`Plan`, inert data naming nodes and parameters by strings.

* :mod:`~fxsplit.planning.plan`: :class:`Plan`, :class:`Cut` and :class:`Replica` (no torch needed);
  :mod:`~fxsplit.planning.summary`, the lines ``print(plan)`` ends with.
* :mod:`~fxsplit.planning.build`: a solved partition of a traced graph -> a :class:`Plan`.
* :mod:`~fxsplit.planning.yamlio`: plans to and from YAML; :mod:`~fxsplit.planning.ranges` names runs of modules.
* :mod:`~fxsplit.planning.rules`: what a plan must say about itself to be used.
* :mod:`~fxsplit.planning.fingerprint`: a model's structure as a short hash.
* :mod:`~fxsplit.planning.apply`: use a saved plan: re-trace (:mod:`~fxsplit.planning.retrace`), check, emit
  without solving;
  :mod:`~fxsplit.planning.graphcheck` checks it against the re-traced graph (budgets, storage, cuts, output).
* :mod:`~fxsplit.planning.offload`: plans that store what the devices cannot hold and stream it in.
* :mod:`~fxsplit.planning.devicemap` reads an Accelerate device map and places ops around fixed weights;
  :mod:`~fxsplit.planning.weightmap` makes the plan (``device_map=``, or ``pins=`` read as one).
* :mod:`~fxsplit.planning.replicas`: plans that hold a read-only weight on several devices when that copies less.

Importing this package, or reading a plan with :meth:`Plan.from_yaml`, does not import torch.
"""

from fxsplit.planning.plan import CUT_KINDS, Cut, Plan, Replica

__all__ = ["CUT_KINDS", "Cut", "Plan", "Replica"]
