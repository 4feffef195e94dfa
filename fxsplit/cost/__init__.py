"""Stage 2, cost: a traced graph -> a partition problem (bytes per value, weights counted once).

* :mod:`~fxsplit.cost.build`: :func:`build_problem`, the weights each node reads, pins and together-groups resolved.
* :mod:`~fxsplit.cost.constraints`: pins, together-groups and leaf modules checked against the model.
"""

from fxsplit.cost.build import GraphCosts, Weight, build_problem, model_tensors

__all__ = ["GraphCosts", "Weight", "build_problem", "model_tensors"]
