"""Generation with a static key/value cache: fxsplit's split vs the unsplit model vs Accelerate.

One Llama (8 layers, hidden 256, vocabulary 8192, random weights: 38 MiB of
weights, 0.4 MiB of cache) generates ``NEW_TOKENS`` tokens greedily after a
``PROMPT_LEN``-token prompt, with a static cache of ``MAX_CACHE_LEN`` positions
(``generation_config.cache_implementation = "static"``), in each of these ways,
side by side in one process:

* ``wrapper``: Hugging Face's export recipe
  ``TorchExportableModuleWithStaticCache(model, batch_size=1,
  max_cache_len=MAX_CACHE_LEN)``, unsplit, on one device: the prompt in one
  call, then one call per token (:func:`greedy`).
* ``generate``: the unsplit ``model.generate(prompt, max_new_tokens=...,
  do_sample=False)`` (its own static cache of the same length): what
  Hugging Face's generation loop costs on top of the model.
* ``fxsplit-N``: the wrapper split by ``fxsplit.fxsplit(wrapper, budgets,
  example_inputs=(prompt,), example_kwargs={"cache_position": ...},
  dynamic_shapes=<tokens per call>, mode="weights")`` over ``N`` = 2 and 4
  logical devices ``cpu:0..N-1`` of ``1.1 x (weights + cache) / N`` each,
  traced under ``torch.no_grad()``, run by the same :func:`greedy` loop.
  ``fxsplit-2-again``: a second, identical split: the A/A control.
* ``accelerate-N``: ``infer_auto_device_map(model, max_memory={0: b, ...},
  no_split_module_classes=["LlamaDecoderLayer"])`` with the same budgets, then
  ``dispatch_model(..., main_device="cpu:0")``
  (:mod:`benchmarks.accelerate_maps`), running ``model.generate``. With these
  budgets Accelerate puts some modules on ``"disk"`` (it keeps room on device 0
  for the largest layer), so the map is dispatched with an ``offload_dir``, as a
  user with these budgets would have to.
  ``accelerate-N-loop``: the recipe module around that dispatched model, run by
  the same :func:`greedy` loop as fxsplit's split (same loop, same budgets).
* ``accelerate-N-fit`` and ``accelerate-N-fit-loop``: the same with the
  smallest budgets of ``FIT_FACTORS`` x (weights + cache) / N at which
  Accelerate keeps every module on the devices: its runtime without its disk
  offload.

Each repeat runs every variant once, in a fresh random order (seeded); the
tables give medians over repeats, and each ratio is the median of the per-repeat
ratios. tokens/s = new tokens / seconds for the whole generation (prefill
included). Also: where each tool keeps each layer's cache (fxsplit: the plan's
``param_devices`` of the wrapper's ``key_cache_<i>``/``value_cache_<i>``
buffers; Accelerate: a layer's ``StaticLayer`` allocates its tensors on the
device of the layer's keys, i.e. the layer's device, or ``cpu:0`` for a layer
on ``"disk"``), and the tokens of every variant against ``model.generate``.

On logical CPU devices there is one processor and no copy between devices costs
more than a memory copy, so the times measure the overhead of each way of
running the model (generated code, hooks, the generation loop), not the speed of
several GPUs.

    python -m benchmarks.generate [--quick] [--rounds R] [--devices 2,4] [--out benchmarks/] [--threads 1]

Writes ``GENERATE_RESULTS.md`` and ``generate_results.json`` under ``--out``;
exits 1 when a bar fails.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

__all__ = ["generate_bars", "greedy", "main", "run_generate", "write_results"]

LAYERS, HIDDEN, VOCAB = 8, 256, 8192
PROMPT_LEN, NEW_TOKENS = 16, 32
MAX_CACHE_LEN = PROMPT_LEN + NEW_TOKENS  # model.generate's own static cache has this length too
DEVICE_COUNTS = (2, 4)
BUDGET_FACTOR = 1.1
FIT_FACTORS = (1.2, 1.3, 1.5, 2.0, 3.0)
BLOCK_CLASSES = ("LlamaDecoderLayer",)
RESULTS_MD, RESULTS_JSON = "GENERATE_RESULTS.md", "generate_results.json"


def build_model() -> nn.Module:
    """The benchmark's Llama, the same weights every call, set up for a static cache and no early stop."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.eos_token_id = None  # random weights: always NEW_TOKENS tokens
    model.generation_config.pad_token_id = 0
    return model


def wrap(model: nn.Module) -> nn.Module:
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    return TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)


def prompt_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))


def is_cache(name: str) -> bool:
    return name.startswith(("key_cache_", "value_cache_"))


@torch.no_grad()
def greedy(step: nn.Module, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy decoding on the recipe's module: the prompt in one call, then one token per call."""
    logits = step(prompt, cache_position=torch.arange(prompt.shape[1]))
    tokens: list[int] = []
    for position in range(prompt.shape[1], prompt.shape[1] + new_tokens):
        tokens.append(int(logits[0, -1].argmax()))
        if len(tokens) < new_tokens:
            logits = step(torch.tensor([[tokens[-1]]]), cache_position=torch.tensor([position]))
    return tokens


# ---------------------------------------------------------------- the variants


def _split(devices: int, budget: int, prompt: torch.Tensor) -> tuple[nn.Module, dict[str, Any]]:
    """fxsplit's split of a fresh wrapper, and where its plan puts weights and cache."""
    import fxsplit

    wrapped = wrap(build_model())
    length = torch.export.Dim("length", max=MAX_CACHE_LEN)
    start = time.perf_counter()
    with torch.no_grad():
        split = fxsplit.fxsplit(
            wrapped,
            {f"cpu:{k}": budget for k in range(devices)},
            example_inputs=(prompt,),
            example_kwargs={"cache_position": torch.arange(prompt.shape[1])},
            dynamic_shapes={"input_ids": {1: length}, "cache_position": {0: length}},
            mode="weights",
        )
    seconds = time.perf_counter() - start
    plan = split.meta["fxsplit_plan"]
    cache = {d: 0 for d in plan.devices}
    layers: dict[str, list[int]] = {d: [] for d in plan.devices}
    for name, device in plan.param_devices.items():
        if is_cache(name):
            cache[device] += wrapped.get_buffer(name).nbytes
            layer = int(name.rsplit("_", 1)[1])
            if layer not in layers[device]:
                layers[device].append(layer)
    info = {
        "split_seconds": seconds,
        "devices": list(plan.devices),
        "budget": budget,
        "weight_bytes": [plan.device_bytes.get(d, 0) - cache[d] for d in plan.devices],
        "cache_bytes": [cache[d] for d in plan.devices],
        "cache_layers": [sorted(layers[d]) for d in plan.devices],
        "charged_bytes": [plan.memory.get(d, {}).get("total", plan.device_bytes.get(d, 0)) for d in plan.devices],
        "transfer_bytes_per_call": plan.transfer_bytes,
        "cuts": len(plan.cuts),
    }
    return split, info


def _accelerate(
    devices: int, budget: int, offload_dir: Path, cache_per_layer: int
) -> tuple[nn.Module | None, dict[str, Any]]:
    """Accelerate's documented call with these budgets, dispatched (with an offload_dir when it spills)."""
    from benchmarks.accelerate_maps import accelerate_map, dispatch
    from benchmarks.placements import lookup

    model = build_model()
    device_map = accelerate_map(model, [budget] * devices, BLOCK_CLASSES)
    spilled = sorted(k for k, v in device_map.items() if v in ("disk", "cpu"))
    weights = {str(k): 0 for k in range(devices)} | {"disk": 0, "cpu": 0}
    seen = {id(t): (n, t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    for name, tensor in seen.values():
        weights[str(lookup(device_map, name))] += tensor.nbytes
    cache = {str(k): 0 for k in range(devices)}
    layers: dict[str, list[int]] = {str(k): [] for k in range(devices)}
    for layer in range(LAYERS):  # a StaticLayer allocates where the layer's keys are: its device, or cpu:0
        where = lookup(device_map, f"model.layers.{layer}.self_attn.k_proj.weight")
        key = str(where) if str(where).isdigit() else "0"
        cache[key] += cache_per_layer
        layers[key].append(layer)
    info: dict[str, Any] = {
        "budget": budget,
        "device_map": {k: str(v) for k, v in device_map.items()},
        "spilled": spilled,
        "weight_bytes": [weights[str(k)] for k in range(devices)],
        "offloaded_bytes": weights["disk"] + weights["cpu"],
        "cache_bytes": [cache[str(k)] for k in range(devices)],
        "cache_layers": [layers[str(k)] for k in range(devices)],
    }
    try:
        dispatched = dispatch(model, device_map, offload_dir=str(offload_dir) if spilled else None, main_device="cpu:0")
    except Exception as error:  # noqa: BLE001 - report whatever Accelerate raises
        info["error"] = f"dispatch_model: {type(error).__name__}: {error}"
        return None, info
    return dispatched, info


def _fit_budget(devices: int, total: int) -> tuple[float, int] | None:
    """The smallest factor of FIT_FACTORS (and its budget) at which Accelerate spills nothing."""
    from benchmarks.accelerate_maps import accelerate_map

    model = build_model()
    for factor in FIT_FACTORS:
        budget = int(factor * total / devices)
        device_map = accelerate_map(model, [budget] * devices, BLOCK_CLASSES)
        if not any(v in ("disk", "cpu") for v in device_map.values()):
            return factor, budget
    return None


def _loop_call(model: nn.Module, prompt: torch.Tensor) -> Callable[[], list[int]]:
    """:func:`greedy` on the recipe module around Accelerate's dispatched model (its hooks run inside)."""
    from benchmarks.accelerate_maps import logical_cpu_devices

    wrapped = wrap(model)

    def call() -> list[int]:
        with logical_cpu_devices():
            return greedy(wrapped, prompt, NEW_TOKENS)

    return call


def _generate_call(model: nn.Module, prompt: torch.Tensor, *, accelerate: bool) -> Callable[[], list[int]]:
    from benchmarks.accelerate_maps import logical_cpu_devices

    def call() -> list[int]:
        with torch.no_grad():
            if accelerate:
                with logical_cpu_devices():  # needed to run offloaded modules on logical devices
                    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
            else:
                out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        return out[0, prompt.shape[1] :].tolist()  # type: ignore[no-any-return]

    return call


def _interleaved(variants: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per generation, per round and variant: every variant once a round, in a fresh random order."""
    rng = random.Random(0)
    names = list(variants)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in rng.sample(names, len(names)):
            start = time.perf_counter()
            variants[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def _median(values: Sequence[float]) -> float:
    from benchmarks.measure import median

    return median(values)


def run_generate(*, rounds: int, device_counts: Sequence[int] = DEVICE_COUNTS) -> dict[str, Any]:
    """Build every variant, check its tokens, time them side by side."""
    prompt = prompt_ids()
    reference_model = build_model()
    expected = _generate_call(reference_model, prompt, accelerate=False)()
    probe = wrap(build_model())
    weights = sum(t.nbytes for t in probe.parameters())
    cache_bytes = sum(b.nbytes for n, b in probe.named_buffers() if is_cache(n))
    other_buffers = sum(b.nbytes for n, b in probe.named_buffers() if not is_cache(n))
    total = weights + cache_bytes + other_buffers
    cache_per_layer = cache_bytes // LAYERS

    variants: dict[str, Callable[[], list[int]]] = {}
    wrapper = wrap(build_model())
    variants["wrapper"] = lambda: greedy(wrapper, prompt, NEW_TOKENS)
    variants["generate"] = _generate_call(reference_model, prompt, accelerate=False)
    cases: list[dict[str, Any]] = []
    scratch = Path(tempfile.mkdtemp(prefix="fxsplit-generate-bench-"))
    try:
        for devices in device_counts:
            budget = int(BUDGET_FACTOR * total / devices)
            print(f"[fxsplit-bench] generate: {devices} devices ...", flush=True)
            case: dict[str, Any] = {"n_devices": devices, "budget": budget}
            split, case["fxsplit"] = _split(devices, budget, prompt)
            variants[f"fxsplit-{devices}"] = lambda split=split: greedy(split, prompt, NEW_TOKENS)
            if devices == device_counts[0]:
                again, _ = _split(devices, budget, prompt)
                variants[f"fxsplit-{devices}-again"] = lambda again=again: greedy(again, prompt, NEW_TOKENS)
            dispatched, case["accelerate"] = _accelerate(devices, budget, scratch / f"acc-{devices}", cache_per_layer)
            if dispatched is not None:
                variants[f"accelerate-{devices}"] = _generate_call(dispatched, prompt, accelerate=True)
                variants[f"accelerate-{devices}-loop"] = _loop_call(dispatched, prompt)
            fit = _fit_budget(devices, total)
            if fit is not None:
                factor, fit_budget = fit
                fitted, case["accelerate_fit"] = _accelerate(devices, fit_budget, scratch / "unused", cache_per_layer)
                case["accelerate_fit"]["factor"] = factor
                if fitted is not None:
                    variants[f"accelerate-{devices}-fit"] = _generate_call(fitted, prompt, accelerate=True)
                    variants[f"accelerate-{devices}-fit-loop"] = _loop_call(fitted, prompt)
            cases.append(case)

        tokens = {name: call() for name, call in variants.items()}  # also the warm-up
        print(f"[fxsplit-bench] generate: timing {len(variants)} variants x {rounds} rounds ...", flush=True)
        seconds = _interleaved(variants, rounds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def ratio(a: str, b: str) -> float | None:
        if a not in seconds or b not in seconds:
            return None
        return _median([x / y for x, y in zip(seconds[a], seconds[b], strict=True)])

    timing = {
        name: {
            "median_s": _median(values),
            "tokens_per_s": NEW_TOKENS / _median(values),
            "time_vs_wrapper": ratio(name, "wrapper"),
        }
        for name, values in seconds.items()
    }
    for case in cases:
        n = case["n_devices"]
        case["fxsplit_vs_accelerate_loop"] = ratio(f"fxsplit-{n}", f"accelerate-{n}-loop")
        case["fxsplit_vs_accelerate_generate"] = ratio(f"fxsplit-{n}", f"accelerate-{n}")
        case["fxsplit_vs_accelerate_fit_loop"] = ratio(f"fxsplit-{n}", f"accelerate-{n}-fit-loop")
    first = device_counts[0]
    return {
        "settings": {
            "layers": LAYERS,
            "hidden": HIDDEN,
            "vocab": VOCAB,
            "prompt_len": PROMPT_LEN,
            "new_tokens": NEW_TOKENS,
            "max_cache_len": MAX_CACHE_LEN,
            "budget_factor": BUDGET_FACTOR,
            "rounds": rounds,
        },
        "sizes": {"weights": weights, "cache": cache_bytes, "other_buffers": other_buffers, "total": total},
        "expected_tokens": expected,
        "tokens_match": {name: out == expected for name, out in tokens.items()},
        "seconds": seconds,
        "timing": timing,
        "aa_ratio": ratio(f"fxsplit-{first}-again", f"fxsplit-{first}"),
        "cases": cases,
    }


# ---------------------------------------------------------------- bars and report


def _slower(result: dict[str, Any], key: str, tolerance: float) -> tuple[str, list[str]]:
    """The ratios under ``key`` per device count, and those above 1 + tolerance."""
    cases = [c for c in result["cases"] if c.get(key) is not None]
    value = ", ".join(f"{c['n_devices']} devices {c[key]:.3f}x" for c in cases)
    return value, [f"{c['n_devices']} devices: {c[key]:.3f}" for c in cases if c[key] > 1 + tolerance]


def generate_bars(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pass/fail of the generation bars (``info`` ones never fail)."""
    wrong = [name for name, ok in result["tokens_match"].items() if not ok and not name.startswith("accelerate")]
    acc_wrong = [name for name, ok in result["tokens_match"].items() if not ok and name.startswith("accelerate")]
    tolerance = abs((result["aa_ratio"] or 1.0) - 1.0)
    misplaced = [
        f"{c['n_devices']} devices: layers' caches {c['fxsplit']['cache_layers']}"
        for c in result["cases"]
        if sum(1 for layers in c["fxsplit"]["cache_layers"] if layers) < 2
    ]
    over = [
        f"{c['n_devices']} devices: {c['fxsplit']['charged_bytes']} > {c['budget']}"
        for c in result["cases"]
        if max(c["fxsplit"]["charged_bytes"]) > c["budget"]
    ]
    loop, loop_slower = _slower(result, "fxsplit_vs_accelerate_loop", tolerance)
    generate, generate_slower = _slower(result, "fxsplit_vs_accelerate_generate", tolerance)
    fit, fit_slower = _slower(result, "fxsplit_vs_accelerate_fit_loop", tolerance)
    overhead = {
        f"fxsplit-{c['n_devices']}": result["timing"].get(f"fxsplit-{c['n_devices']}", {}).get("time_vs_wrapper")
        for c in result["cases"]
    }
    return {
        "generate: fxsplit's tokens equal model.generate's (every split)": {"pass": not wrong, "failures": wrong},
        "generate: fxsplit's splits keep each device within its budget, cache included": {
            "pass": not over,
            "failures": over,
        },
        "generate: the layers' caches are spread over the devices (not glued on one)": {
            "pass": not misplaced,
            "failures": misplaced,
        },
        "generate: fxsplit's time <= Accelerate's at the same budgets, same greedy loop (tolerance: A/A distance)": {
            "pass": not loop_slower,
            "value": loop,
            "failures": loop_slower,
        },
        "info: generate: fxsplit's time <= Accelerate's model.generate at the same budgets": {
            "pass": not generate_slower,
            "value": generate,
            "failures": generate_slower,
            "info": True,
        },
        "info: generate: fxsplit's time <= Accelerate's with budgets where it spills nothing, same loop": {
            "pass": not fit_slower,
            "value": fit,
            "failures": fit_slower,
            "info": True,
        },
        "info: generate: fxsplit's time / the unsplit wrapper's": {
            "pass": True,
            "value": ", ".join(f"{k} {v:.3f}x" for k, v in overhead.items() if v is not None)
            + (f" (A/A {result['aa_ratio']:.3f})" if result["aa_ratio"] is not None else ""),
            "info": True,
        },
        "info: generate: Accelerate's tokens equal model.generate's": {
            "pass": not acc_wrong,
            "failures": acc_wrong,
            "info": True,
        },
    }


def _size(nbytes: int) -> str:
    from fxsplit.units import format_size

    return format_size(int(nbytes))


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def variant_note(name: str) -> str:
    """What a variant runs, for the table."""
    if name == "wrapper":
        return "unsplit recipe module, one device, greedy loop"
    if name == "generate":
        return "unsplit `model.generate`, one device"
    parts = name.split("-")
    if parts[0] == "fxsplit":
        return f"fxsplit over {parts[1]} devices, greedy loop" + (" (A/A control)" if "again" in parts else "")
    budgets = "budgets where it spills nothing" if "fit" in parts else "same budgets"
    how = "recipe module, greedy loop" if "loop" in parts else "`model.generate`"
    return f"Accelerate over {parts[1]} devices, {budgets}, {how}"


def timing_table(result: dict[str, Any]) -> str:
    rows = []
    for name, t in result["timing"].items():
        vs = t["time_vs_wrapper"]
        rows.append(
            [
                f"`{name}`",
                variant_note(name),
                f"{1000 * t['median_s']:.0f}",
                f"**{t['tokens_per_s']:.1f}**",
                f"{vs:.3f}" if vs is not None else "-",
                "yes" if result["tokens_match"][name] else "**NO**",
            ]
        )
    header = ["variant", "what", "ms / generation", "tokens/s", "time / wrapper's", "tokens = model.generate"]
    return _table(header, rows)


def placement_table(result: dict[str, Any]) -> str:
    rows = []
    for case in result["cases"]:
        n, fx = case["n_devices"], case["fxsplit"]
        tools: list[tuple[str, dict[str, Any]]] = [("fxsplit", fx), ("Accelerate", case["accelerate"])]
        if "accelerate_fit" in case:
            tools.append((f"Accelerate x{case['accelerate_fit']['factor']}", case["accelerate_fit"]))
        for label, info in tools:
            spill = ""
            if info.get("spilled"):
                spill = f"{', '.join(info['spilled'])} ({_size(info['offloaded_bytes'])})"
            for k in range(n):
                layers = info["cache_layers"][k]
                rows.append(
                    [
                        n,
                        label if k == 0 else "",
                        _size(info["budget"]) if k == 0 else "",
                        f"cpu:{k}",
                        _size(info["weight_bytes"][k]),
                        _size(info["cache_bytes"][k]),
                        ", ".join(str(x) for x in layers) or "-",
                        _size(info["weight_bytes"][k] + info["cache_bytes"][k]),
                        (spill if k == 0 else ""),
                    ]
                )
    header = [
        "N",
        "tool",
        "budget each",
        "device",
        "weights",
        "cache",
        "cache of layers",
        "weights + cache",
        "on disk",
    ]
    return _table(header, rows)


NOTE = """\
Model: `LlamaForCausalLM` with 8 layers, hidden 256 (4 heads, 2 key/value heads), intermediate 688, vocabulary
8192, random weights (seeded), `generation_config.cache_implementation = "static"`, no end-of-sequence token.
Prompt: {prompt_len} random tokens; {new_tokens} new tokens, greedy. Static cache of {max_cache_len} positions
in every variant (`model.generate` sizes its own to prompt + new tokens = the same). Weights {weights}, cache
{cache}, other buffers {other}: total {total}; budgets {factor} x total / N per device. Each repeat runs every
variant once, in a fresh random order; times are medians over {rounds} repeats; *time / wrapper's* is the
median of the per-repeat ratios; tokens/s = new tokens / time of the whole generation (prefill included).
*Greedy loop*: the recipe module called with the prompt in one call, then one call per token: fxsplit's
split, the unsplit module (`wrapper`), and the module around Accelerate's dispatched model (`-loop`).
*`model.generate`*: Hugging Face's own generation loop, unsplit (`generate`) and on Accelerate's dispatched
model (`accelerate-N`, what an Accelerate user runs). Same loop and same budgets, `fxsplit-N` against
`accelerate-N-loop`, is the bar. Accelerate's `max_memory` counts weights only: the cache it allocates
during `generate` comes on top of the budget; fxsplit's budget holds the cache. On logical CPU devices (one
processor, copies between devices are memory copies) these times measure the overhead of each way of running
the model, not the speed of several GPUs; and there Accelerate's hooks copy every module's inputs on every
call (`tensor.to("cpu:k")` always copies on a logical device, where on a GPU it is a no-op for a tensor
already there; see `benchmarks/accelerate_maps.py`), so its times include copies it would not make on GPUs.
Its modules on "disk" are read from its offload folder's memory-mapped files (in the page cache here)."""


def headline_lines(result: dict[str, Any]) -> list[str]:
    t = result["timing"]
    parts = [f"unsplit wrapper {t['wrapper']['tokens_per_s']:.1f} tokens/s"]
    parts.append(f"unsplit `model.generate` {t['generate']['tokens_per_s']:.1f}")
    for case in result["cases"]:
        n = case["n_devices"]
        if f"fxsplit-{n}" in t:
            parts.append(f"fxsplit over {n} devices {t[f'fxsplit-{n}']['tokens_per_s']:.1f}")
        if f"accelerate-{n}" in t:
            spilled = ", modules on disk" if case["accelerate"]["spilled"] else ""
            parts.append(
                f"Accelerate over {n} at the same budgets{spilled}: {t[f'accelerate-{n}-loop']['tokens_per_s']:.1f} "
                f"(greedy loop), {t[f'accelerate-{n}']['tokens_per_s']:.1f} (`model.generate`)"
            )
        if f"accelerate-{n}-fit" in t:
            factor = case["accelerate_fit"]["factor"]
            parts.append(
                f"Accelerate over {n} with x{factor} budgets (nothing on disk): "
                f"{t[f'accelerate-{n}-fit-loop']['tokens_per_s']:.1f} (greedy loop), "
                f"{t[f'accelerate-{n}-fit']['tokens_per_s']:.1f} (`model.generate`)"
            )
    aa = result["aa_ratio"]
    return [
        "- Tokens per second (median): " + "; ".join(parts) + "." + (f" A/A control {aa:.3f}." if aa else ""),
        "- Cache per device: "
        + "; ".join(
            f"{c['n_devices']} devices: fxsplit "
            + ", ".join(_size(b) for b in c["fxsplit"]["cache_bytes"])
            + ", Accelerate "
            + ", ".join(_size(b) for b in c["accelerate"]["cache_bytes"])
            for c in result["cases"]
        )
        + ".",
    ]


def markdown(result: dict[str, Any], context: dict[str, Any]) -> str:
    from benchmarks.report import _at_commit, _bars_md
    from benchmarks.run import _caveat

    m = context["machine"]
    s, sizes = result["settings"], result["sizes"]
    note = NOTE.format(
        prompt_len=s["prompt_len"],
        new_tokens=s["new_tokens"],
        max_cache_len=s["max_cache_len"],
        weights=_size(sizes["weights"]),
        cache=_size(sizes["cache"]),
        other=_size(sizes["other_buffers"]),
        total=_size(sizes["total"]),
        factor=s["budget_factor"],
        rounds=s["rounds"],
    )
    parts = [
        "# Generation with a static KV cache: fxsplit vs the unsplit model vs Accelerate\n\n"
        f"Written by `{context['command']}` {_at_commit(context.get('commit'))}on {context['started']} "
        f"in {context['duration_s']:.0f} s" + (" (**--quick**: fewer repeats)" if context.get("quick") else "") + ". "
        "Numbers: medians; ratios measured side by side in the same process.",
        _table(["machine", ""], [[k, v] for k, v in m.items()]),
        f"1-minute load average at the start and the end: "
        f"{', '.join(f'{x:.2f}' for x in context['load_samples'])} ({m['cores']} cores). "
        + _caveat(context["load_samples"], m["torch_threads"], m["cores"] or 1),
        "## Headlines\n\n" + "\n".join(headline_lines(result)),
        "## Bars\n\n" + _bars_md(generate_bars(result)),
        "## Tokens per second\n\n" + note + "\n\n" + timing_table(result),
        "## Weights and cache per device\n\n"
        "fxsplit: the plan (`device_bytes`, and `param_devices` of the wrapper's `key_cache_<i>`/`value_cache_<i>`"
        " buffers). Accelerate: its device map; each layer's cache is where that layer runs (a layer on disk runs"
        " on `cpu:0`).\n\n" + placement_table(result),
    ]
    return "\n\n".join(parts) + "\n"


def write_results(result: dict[str, Any], context: dict[str, Any], out: Path) -> list[Path]:
    """Write GENERATE_RESULTS.md and generate_results.json under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / RESULTS_MD, out / RESULTS_JSON
    js.write_text(json.dumps({**context, "generate": {**result, "bars": generate_bars(result)}}, indent=1) + "\n")
    md.write_text(markdown(result, context))
    return [md, js]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer timing repeats")
    parser.add_argument("--rounds", type=int, default=None, help="timing repeats (default 7, --quick 3)")
    parser.add_argument("--devices", default=",".join(str(n) for n in DEVICE_COUNTS), help="device counts")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from benchmarks.measure import run_alone
    from benchmarks.run import exit_code, verdicts

    rounds = args.rounds or (3 if args.quick else 7)
    command = " ".join(["python -m benchmarks.generate", *(argv if argv is not None else sys.argv[1:])])
    result, context = run_alone(
        command,
        args.threads,
        args.quick,
        lambda: run_generate(rounds=rounds, device_counts=[int(n) for n in args.devices.split(",") if n]),
    )
    written = write_results(result, context, args.out)
    bars = generate_bars(result)
    lines, failed = verdicts(bars)
    print(timing_table(result))
    print("\n".join(lines))
    print("[fxsplit-bench] wrote " + ", ".join(str(p) for p in written))
    if failed:
        print(f"[fxsplit-bench] {len(failed)} bar(s) failed: {'; '.join(failed)}", flush=True)
    return exit_code(bars)


if __name__ == "__main__":
    sys.exit(main())
