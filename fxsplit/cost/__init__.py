"""Stage 2, cost: a traced graph -> a partition problem (bytes per value, weights counted once).

* :mod:`~fxsplit.cost.build`: :func:`build_problem`, the weights each node reads, pins and together-groups resolved.
* :mod:`~fxsplit.cost.scan`: one pass over the graph's nodes: the ops, their module paths, the tensors each reads.
* :mod:`~fxsplit.cost.walk`: a module tree walked once: its modules by path, its parameters and buffers by name.
* :mod:`~fxsplit.cost.constraints`: pins, together-groups and leaf modules checked against the model.
* :mod:`~fxsplit.cost.compute`: each op's FLOPs and bytes, and its seconds on a device (a roofline).
* :mod:`~fxsplit.cost.profile`: each op's seconds measured on a device (``profile=True``).
* :mod:`~fxsplit.cost.linkprofile`: each link's copy time measured (``profile=True``).
"""

from fxsplit.cost.build import GraphCosts, Weight, build_problem, model_tensors

__all__ = ["GraphCosts", "Weight", "build_problem", "model_tensors"]
