"""Checkpoints onto a plan: read safetensors and ``torch.save`` files straight onto the planned devices.

* :mod:`~fxsplit.checkpoint.formats`: find the files, read headers, map data.
* :mod:`~fxsplit.checkpoint.match`: check a checkpoint against the tensors to fill.
* :mod:`~fxsplit.checkpoint.renamed`: a Hugging Face checkpoint under the model's names (transformers' conversions).
* :mod:`~fxsplit.checkpoint.load`: read each tensor onto its device, then commit.
* :mod:`~fxsplit.checkpoint.unsaved`: what a transformers model's checkpoints may lack or hold besides (its lists).
* :mod:`~fxsplit.checkpoint.initmissing`: with ``strict=False``, the tensors a checkpoint lacks made on their devices
  and initialized as the model initializes them.
* :mod:`~fxsplit.checkpoint.empty`: build a model with its parameters on meta.
* :mod:`~fxsplit.checkpoint.progress`: the progress bar while loading.
* :mod:`~fxsplit.checkpoint.write`: write tensors to a safetensors file and map them back (disk offload).
* :mod:`~fxsplit.checkpoint.cast`: cast a model to the plan's dtype before tracing, when a checkpoint fills it.
* :mod:`~fxsplit.checkpoint.unloaded`: a split with weights still on meta refuses calls, saying how to load them.

See docs/CHECKPOINTS.md.
"""

from fxsplit.checkpoint.empty import empty_weights
from fxsplit.checkpoint.load import load_checkpoint, prepare, remember_non_persistent

__all__ = ["empty_weights", "load_checkpoint", "prepare", "remember_non_persistent"]
