"""Generation with a static key/value cache, split over two devices: each layer's cache stays on its device.

1. A tiny Llama (random weights, no download) whose ``generation_config`` asks
   for a static cache: one tensor per layer for the keys and one for the values,
   allocated once for ``max_cache_len`` tokens and written in place
   (``index_copy_``) at each call's ``cache_position``.
2. Hugging Face's own export recipe,
   ``TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=48)``,
   holds that cache and takes ``(input_ids, cache_position)``; it returns the logits.
3. ``fxsplit.fxsplit`` splits it over two devices of 1.1 x (weights + cache) / 2
   each (``mode="weights"``: a budget holds parameters, buffers and the cache),
   under ``torch.no_grad()`` as Hugging Face's own ``torch.export`` of it runs:
   the cache is then traced as the wrapper's buffers ``key_cache_<layer>`` and
   ``value_cache_<layer>``, and the plan puts each on its layer's device.
   ``dynamic_shapes`` keeps the number of tokens per call variable, so a
   prompt of any length up to the cache goes in one call.
4. Greedy decoding calls the split step after step: the prompt at positions
   ``0..n-1``, then each new token at the next position. The cache lives in the
   split between calls; starting again at position 0 starts a new sequence.
5. The tokens are compared with ``model.generate(do_sample=False)`` on the
   unsplit model.

Runs on logical CPU devices ``cpu:0``/``cpu:1``; on GPUs write ``cuda:0``/``cuda:1``.

    python examples/generate.py
"""

from __future__ import annotations

import torch
import transformers
from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

import fxsplit

MAX_CACHE_LEN, NEW_TOKENS = 48, 32


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=352,
        vocab_size=512,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.eos_token_id = None  # random weights: always generate NEW_TOKENS
    return model


def greedy(step: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """The prompt in one call, then one token per call at the next cache position."""
    logits = step(prompt, cache_position=torch.arange(prompt.shape[1]))
    tokens = []
    for position in range(prompt.shape[1], prompt.shape[1] + new_tokens):
        tokens.append(int(logits[0, -1].argmax()))
        if len(tokens) < new_tokens:
            logits = step(torch.tensor([[tokens[-1]]]), cache_position=torch.tensor([position]))
    return tokens


def main() -> None:
    model = tiny_llama()
    prompt = torch.tensor([[5, 17, 42, 7, 300, 11, 9, 128]])
    expected = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt.shape[1] :].tolist()

    wrapped = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    total = sum(t.nbytes for t in [*wrapped.parameters(), *wrapped.buffers()])  # weights + cache
    length = torch.export.Dim("length", max=MAX_CACHE_LEN)  # tokens per call: a whole prompt, or one
    with torch.no_grad():  # as Hugging Face's own export does: the cache is traced as the wrapper's buffers
        split = fxsplit.fxsplit(
            wrapped,
            {"cpu:0": int(1.1 * total / 2), "cpu:1": int(1.1 * total / 2)},
            example_inputs=(prompt,),
            example_kwargs={"cache_position": torch.arange(prompt.shape[1])},
            dynamic_shapes={"input_ids": {1: length}, "cache_position": {0: length}},
            mode="weights",
        )
    plan = split.meta["fxsplit_plan"]
    print(plan)
    cache: dict[str, list[str]] = {}  # device -> its cache buffers, as the recipe registers them
    for name, device in plan.param_devices.items():
        if name.startswith(("key_cache_", "value_cache_")):
            cache.setdefault(device, []).append(name)
    for device, names in cache.items():
        nbytes = sum(wrapped.get_buffer(name).nbytes for name in names)
        shape = list(wrapped.get_buffer(names[0]).shape)  # [batch, key/value heads, max_cache_len, head size]
        print(f"{device}: {fxsplit.format_size(nbytes)} of cache, {len(names)} x {shape}: {', '.join(names)}")

    with torch.no_grad():  # as model.generate: no autograd graph kept through the cache from call to call
        tokens = greedy(split, prompt, NEW_TOKENS)
    print("generated:", tokens)
    assert tokens == expected, (tokens, expected)
    print("same tokens as model.generate")


if __name__ == "__main__":
    main()
