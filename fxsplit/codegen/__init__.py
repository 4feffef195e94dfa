"""Stage 6, codegen: traced graph + plan -> a ``GraphModule`` with its weights on their devices.

* :mod:`~fxsplit.codegen.emitter`: :func:`emit`, the graph of the split.
* :mod:`~fxsplit.codegen.weights`: :func:`move_weights`, the weights onto their planned devices.
* :mod:`~fxsplit.codegen.splitmodule`: the class a split is built as (export and grad-mode splits).
* :mod:`~fxsplit.codegen.meta`: what the emitted nodes carry in ``node.meta`` (device; :class:`CopyRecord`).
* :mod:`~fxsplit.codegen.nested`: hard-coded devices in ops and their subgraphs pointed at the op's device.
* :mod:`~fxsplit.codegen.fastattr`: attribute lookups at dictionary speed for the modules built.
* :mod:`~fxsplit.codegen.tiednames`, :mod:`~fxsplit.codegen.unreadstate`: the split's ``state_dict()`` is the
  model's (every name of a tied tensor; the tensors no op reads).
* :mod:`~fxsplit.codegen.readable`: a readable view of the generated code.

The helpers the generated code calls at run time are in :mod:`fxsplit.runtime` (their module path is part
of the generated code's names).
"""

from fxsplit.codegen.emitter import emit
from fxsplit.codegen.meta import COPY_META, DEVICE_META, CopyRecord
from fxsplit.codegen.weights import move_weights

__all__ = ["COPY_META", "CopyRecord", "DEVICE_META", "emit", "move_weights"]
