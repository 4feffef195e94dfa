"""Offload on a tiny Llama: devices that hold a third of the weights, the rest streamed from host and disk.

1. ``save_pretrained`` writes a sharded safetensors checkpoint (random weights, no download).
2. The model is rebuilt from its ``config.json`` inside ``fxsplit.empty_weights()``.
3. ``fxsplit.fxsplit(..., offload={...}, checkpoint=directory)`` plans it over two
   devices whose budgets hold about a third of the weights: each device keeps
   what fits, the rest is stored in host memory and on disk (memory-mapped
   straight from the checkpoint's own files) and the generated code copies each
   stored weight to its device right before the op that reads it, the next one
   prefetched while the op before runs.
4. The split's logits are compared with those of the model ``from_pretrained`` loads.

Runs on logical CPU devices ``cpu:0``/``cpu:1``; on GPUs write ``cuda:0``/``cuda:1``.

    python examples/offload.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers
from from_checkpoint import save_tiny_llama  # the same tiny Llama, written the same way

import fxsplit


def main() -> None:
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        save_tiny_llama(directory / "checkpoint")
        config = transformers.AutoConfig.from_pretrained(directory / "checkpoint")
        with fxsplit.empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(config).eval()

        ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
        split = fxsplit.fxsplit(
            model,
            {"cpu:0": "400KiB", "cpu:1": "400KiB"},
            example_inputs=(ids,),
            example_kwargs={"use_cache": False},
            offload={"host": "600KiB", "disk": "4MiB", "dir": directory / "offload"},
            checkpoint=directory / "checkpoint",
        )
        plan = split.meta["fxsplit_plan"]
        print(plan)
        code = split.code
        first = code.index("fxsplit_runtime_prefetch")
        print("...", *code[first:].splitlines()[:3], "...", sep="\n")

        reference = transformers.AutoModelForCausalLM.from_pretrained(directory / "checkpoint").eval()
        torch.testing.assert_close(split(ids).logits, reference(ids, use_cache=False).logits)
        print("logits equal to from_pretrained's, with", fxsplit.format_size(plan.stream_bytes), "streamed per forward")


if __name__ == "__main__":
    main()
