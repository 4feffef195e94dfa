"""Stage 4, partition (pure; no torch): problem + budgets -> a device per op.

* :mod:`~fxsplit.partition.problem`: :class:`PartitionProblem`, the problem as plain data.
* :mod:`~fxsplit.partition.solve`: :func:`partition`, which checks its arguments and runs the strategies.
* :mod:`~fxsplit.partition.strategies`: the strategies, each ``strategy(search, best)``, and the default list.
* :mod:`~fxsplit.partition.result`: :class:`Partition`, :func:`transfer_bytes` and the rules a placement keeps.
* :mod:`~fxsplit.partition.context`: arrays derived once from the problem, shared by the programmes.
* :mod:`~fxsplit.partition.contiguous`: contiguous placements by dynamic programming.
* :mod:`~fxsplit.partition.ring`: placements where the first device also runs the last ops.
* :mod:`~fxsplit.partition.refine`: single-op moves that lower the bytes copied, and packing.
* :mod:`~fxsplit.partition.mincut`: exchanges between two devices along a minimum cut.
* :mod:`~fxsplit.partition.exact`: branch and bound on small graphs.
* :mod:`~fxsplit.partition.coarse`: whole module runs placed in any order, by branch and bound on the coarsened graph.
* :mod:`~fxsplit.partition.colocate`: ops that write one tensor in place brought onto one device.
* :mod:`~fxsplit.partition.streaming`: which weights of a device to stream when they do not all fit.
* :mod:`~fxsplit.partition.infeasible`: the error that says why nothing fits.
"""

from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.result import Partition, transfer_bytes
from fxsplit.partition.solve import partition
from fxsplit.partition.strategies import DEFAULT_STRATEGIES, Search, Strategy

__all__ = [
    "DEFAULT_STRATEGIES",
    "Partition",
    "PartitionProblem",
    "Search",
    "Strategy",
    "Value",
    "partition",
    "transfer_bytes",
]
