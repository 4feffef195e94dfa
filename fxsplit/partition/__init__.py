"""Stage 4, partition (pure; no torch): problem + budgets -> a device per op.

* :mod:`~fxsplit.partition.problem`: :class:`PartitionProblem`, the problem as plain data.
* :mod:`~fxsplit.partition.solve`: :func:`partition`, contiguous placements by dynamic programming, then improved.
* :mod:`~fxsplit.partition.ring`: placements where the first device also runs the last ops.
* :mod:`~fxsplit.partition.refine`: single-op moves that lower the bytes copied.
* :mod:`~fxsplit.partition.mincut`: exchanges between two devices along a minimum cut.
"""

from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.solve import Partition, partition, transfer_bytes

__all__ = ["Partition", "PartitionProblem", "Value", "partition", "transfer_bytes"]
