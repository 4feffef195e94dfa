"""Helpers the test models call, in a module that defines none of their classes: each binds a function of torch's
or of ``random`` to a name of this module's own, as a model's utility module can (``from random import uniform``).
Patching ``random`` or ``torch.distributed`` does not reach these names; fxsplit looks through the modules the
model's code imports from (:func:`fxsplit.tracing.modelcode.model_namespaces`)."""

from __future__ import annotations

from random import uniform

import torch.distributed as dist
from torch import is_grad_enabled

if dist.is_available():
    from torch.distributed import is_initialized
else:  # pragma: no cover - a torch without torch.distributed

    def is_initialized() -> bool:
        return False


def dropped(layerdrop: float) -> bool:
    """LayerDrop's test, on this module's own name for ``random.uniform``."""
    return uniform(0, 1) < layerdrop


def in_a_job() -> bool:
    return is_initialized()


def grad_on() -> bool:
    return is_grad_enabled()
