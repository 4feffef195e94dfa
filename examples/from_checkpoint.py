"""Big-model recipe on a tiny Llama: build on meta -> plan -> load the checkpoint onto the devices -> run.

1. ``save_pretrained`` writes a sharded checkpoint (several ``model-*.safetensors``
   and ``model.safetensors.index.json``), as a model from the Hub comes.
2. The model is rebuilt from the directory's ``config.json`` inside
   ``fxsplit.empty_weights()``: parameters on ``meta`` (no memory), buffers such
   as the rotary embedding's ``inv_freq`` computed as usual.
3. ``fxsplit.fxsplit(..., checkpoint=directory)`` traces and plans it over two
   devices, then reads each tensor from the memory-mapped files straight onto
   the device the plan chose.
4. The split's logits are compared with the model ``from_pretrained`` loads.

Runs on logical CPU devices ``cpu:0``/``cpu:1``; on GPUs write ``cuda:0``/``cuda:1``.
No download: the checkpoint is written here, with random weights.

    python examples/from_checkpoint.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers

import fxsplit


def save_tiny_llama(directory: Path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=176,
        vocab_size=1024,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="300KB")


def main() -> None:
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        save_tiny_llama(directory)
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
        print(f"checkpoint: {len(shards)} shards + model.safetensors.index.json")

        config = transformers.AutoConfig.from_pretrained(directory)
        with fxsplit.empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(config).eval()

        ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
        split = fxsplit.fxsplit(
            model,
            {"cpu:0": "700KiB", "cpu:1": "700KiB"},
            example_inputs=(ids,),
            example_kwargs={"use_cache": False},
            mode="weights",
            checkpoint=directory,
        )
        plan = split.meta["fxsplit_plan"]
        for device in plan.devices:
            print(
                f"{device}: {fxsplit.format_size(plan.device_bytes[device])} of weights, "
                f"modules {', '.join(plan.modules.get(device, ())[:3])}, ..."
            )

        reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        torch.testing.assert_close(split(ids).logits, reference(ids, use_cache=False).logits)
        print("the split loaded from the checkpoint gives the same logits as from_pretrained")


if __name__ == "__main__":
    main()
