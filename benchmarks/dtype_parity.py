"""A split at bf16 (or fp16) from a checkpoint against transformers' ``from_pretrained(dtype=...)``.

For every causal LM type transformers names (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), or those given: a small
config (the sizes in ``SMALL``, where the config has them; models still over 3M parameters are skipped), random
weights saved with ``save_pretrained``, then

* ``from_pretrained(dir, dtype=torch.bfloat16)`` (or ``--dtype float16``): the reference logits, and the dtype
  of each tensor it holds;
* the model built again under ``fxsplit.empty_weights()`` and split over ``cpu:0``/``cpu:1`` (each 0.6 of its
  parameters and buffers at the dtype, ``mode="weights"``) with ``checkpoint=dir, dtype="bfloat16"`` (or fp16).

A row passes when the split's logits equal the reference's bit for bit and every tensor the two share a name for
has the reference's dtype as loaded. A model whose config or forward does not work at these sizes (a config validator, a
reference that fails) is listed as not run: that is this script's small configs, not fxsplit.

    python -m benchmarks.dtype_parity [--dtype bfloat16] [--out benchmarks/DTYPE_PARITY.md] [kinds ...]

Exits 1 when a run row fails (logits or dtypes differ, or fxsplit raised on a model the reference ran).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import fxsplit

__all__ = ["MAX_PARAMETERS", "SMALL", "main", "one", "report", "small_config"]

SMALL = {
    **dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2),
    **dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts=8),
    **dict(num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64),
    **dict(n_group=1, topk_group=1, moe_num_experts=8, moe_k=2, num_local_experts=8, pad_token_id=0),
    **dict(shared_expert_intermediate_size=32, n_embd=64, n_layer=2, n_head=4, n_positions=64, d_model=64),
    **dict(ffn_dim=96, num_layers=2, num_heads=4, d_ff=96, d_kv=16, rotary_dim=8, partial_rotary_factor=0.5),
    **dict(hidden_dim=96),
}
MAX_PARAMETERS = 3_000_000


def small_config(kind: str) -> Any:
    """``kind``'s default config with the sizes of :data:`SMALL` it has."""
    import transformers

    config = transformers.AutoConfig.for_model(kind)
    for key, value in SMALL.items():
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except Exception:  # noqa: BLE001 - a config that checks each value: leave that one
                pass
    layers = getattr(config, "layer_types", None)
    if isinstance(layers, list) and len(layers) > config.num_hidden_layers:
        config.layer_types = layers[: config.num_hidden_layers]
    return config


def one(kind: str, dtype: str = "bfloat16") -> dict[str, Any]:
    """One model type: ``status`` (``pass``, ``fail``, ``skipped``, ``not run``) and what was seen."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    try:
        config = small_config(kind)
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMETERS:
            return {"kind": kind, "status": "skipped", "why": f"{size:,} parameters at these sizes"}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
        with tempfile.TemporaryDirectory() as directory:
            model.save_pretrained(directory)
            reference = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
            theirs = {n: t.dtype for n, t in [*reference.named_parameters(), *reference.named_buffers()]}
            with torch.no_grad():  # (after its dtypes: CTRL's forward reassigns its table at the logits' dtype)
                want = reference(input_ids=ids, use_cache=False).logits
            with fxsplit.empty_weights():
                empty = AutoModelForCausalLM.from_config(config).eval()
            held = [*empty.parameters(), *empty.buffers()]
            budget = int(0.6 * sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in held))
            split = _split(empty, budget, ids, directory, dtype)
    except Exception as error:  # noqa: BLE001 - this script's config, or the reference: not run
        return {"kind": kind, "status": "not run", "why": f"{type(error).__name__}: {_first(error)}"}
    if isinstance(split, Exception):
        return {"kind": kind, "status": "fail", "why": f"fxsplit raised {type(split).__name__}: {_first(split)}"}
    with torch.no_grad():
        got = split(ids, use_cache=False)["logits"]
    ours = {n: t.dtype for n, t in [*split.named_parameters(), *split.named_buffers()]}
    differ = sorted(n for n in ours if n in theirs and ours[n] != theirs[n])
    floats = sorted({str(d).removeprefix("torch.") for d in theirs.values() if d.is_floating_point})
    row = {
        "kind": kind,
        "devices": len(set(split.meta["fxsplit_plan"].param_devices.values())),
        "max_abs_diff": (got.float() - want.float()).abs().max().item(),
        "dtypes_differ": differ,
        "float_dtypes": floats,
        "seconds": round(time.perf_counter() - start, 1),
    }
    row["status"] = "pass" if row["max_abs_diff"] == 0 and not differ else "fail"
    return row


def _split(empty: Any, budget: int, ids: torch.Tensor, directory: str, dtype: str) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fxsplit.fxsplit(
                empty, {"cpu:0": budget, "cpu:1": budget}, example_inputs=(ids,), mode="weights",
                example_kwargs={"use_cache": False}, checkpoint=directory, dtype=dtype,
            )  # fmt: skip
    except Exception as error:  # noqa: BLE001 - reported as the row's failure
        return error


def _first(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:160] if lines else ""


def report(rows: list[dict[str, Any]], dtype: str = "bfloat16") -> str:
    """The results file: the counts, then one line per model type."""
    counts = {status: sum(r["status"] == status for r in rows) for status in ("pass", "fail", "skipped", "not run")}
    lines = [
        f"# {dtype} from a checkpoint: fxsplit against from_pretrained(dtype=torch.{dtype})",
        "",
        "`python -m benchmarks.dtype_parity` (see its docstring). Pass: the split's logits equal the reference's",
        "bit for bit, and every tensor has the reference's dtype as loaded.",
        "",
        ", ".join(f"{status}: {n}" for status, n in counts.items()),
        "",
        "| model type | result | devices | max abs diff | float dtypes held | seconds / why |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] in ("pass", "fail") and "max_abs_diff" in r:
            shown = f"{r['max_abs_diff']:.3g}" + (
                f"; dtypes differ: {', '.join(r['dtypes_differ'][:3])}" if r["dtypes_differ"] else ""
            )
            floats = ", ".join(r["float_dtypes"])
            lines.append(f"| {r['kind']} | {r['status']} | {r['devices']} | {shown} | {floats} | {r['seconds']} |")
        else:
            lines.append(f"| {r['kind']} | {r['status']} | | | | {r['why'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", help="model types (default: every causal LM type transformers names)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--out", default=None, help="default: benchmarks/DTYPE_PARITY.md (bf16), DTYPE_PARITY_FP16.md")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = []
    for kind in args.kinds or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        rows.append(one(kind, args.dtype))
        print(rows[-1], flush=True)
    out = args.out or f"benchmarks/DTYPE_PARITY{'' if args.dtype == 'bfloat16' else '_FP16'}.md"
    Path(out).write_text(report(rows, args.dtype))
    failed = [r["kind"] for r in rows if r["status"] == "fail"]
    print(f"wrote {out}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
