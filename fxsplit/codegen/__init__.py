"""Stage 6, codegen: traced graph + plan -> a ``GraphModule`` with its weights on their devices.

* :mod:`~fxsplit.codegen.emitter`: :func:`emit` and :func:`move_weights`.
* :mod:`~fxsplit.codegen.meta`: what the emitted nodes carry in ``node.meta`` (device; :class:`CopyRecord`).
* :mod:`~fxsplit.codegen.nested`: hard-coded devices in ops and their subgraphs pointed at the op's device.
* :mod:`~fxsplit.codegen.fastattr`: attribute lookups at dictionary speed for the modules built.
* :mod:`~fxsplit.codegen.readable`: a readable view of the generated code.

The helpers the generated code calls at run time are in :mod:`fxsplit.runtime` (their module path is part
of the generated code's names).
"""

from fxsplit.codegen.emitter import emit, move_weights
from fxsplit.codegen.meta import COPY_META, DEVICE_META, CopyRecord

__all__ = ["COPY_META", "DEVICE_META", "CopyRecord", "emit", "move_weights"]
