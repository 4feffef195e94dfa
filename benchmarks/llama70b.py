"""Plan a Llama-70B-sized model on the ``meta`` device over 8 devices; print one JSON line.

Run in a fresh process (``python -m benchmarks.llama70b``) so that its peak
resident memory is its own: ``VmHWM`` of ``/proc/self/status`` (the peak RSS of
this process image). ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is reported
too, but Linux carries it across ``fork`` + ``exec``, so in a child of a large
process it starts at the parent's size.
The config is Llama-2/3-70B's shape (80 layers, hidden 8192, MLP 28672, 64
heads, 8 KV heads, vocabulary 128256) in bfloat16: 70.6 G parameters, 131 GiB,
planned over 8 devices of 20 GiB each. Tracing uses ``torch.export`` on meta
inputs of 1 x 1024 tokens; nothing is allocated.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

__all__ = ["main"]

BUDGET = "20GiB"


def _maxrss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _rss_gib() -> float:
    """Peak RSS of this process image (VmHWM), falling back to ru_maxrss off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return _maxrss_gib()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    from benchmarks.accelerate_maps import accelerate_map
    from benchmarks.placements import from_device_map, score
    from fxsplit.cost.build import build_problem
    from fxsplit.options import Budgets
    from fxsplit.partition.solve import partition
    from fxsplit.planning.build import make_plan
    from fxsplit.tracing.capture import trace

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=args.layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.zeros(1, args.tokens, dtype=torch.long, device="meta")
    rss_before = _rss_gib()

    start = time.perf_counter()
    traced = trace(model, example_inputs=(ids,))
    traced_at = time.perf_counter()
    device_budgets = Budgets.parse({f"cpu:{k}": BUDGET for k in range(8)})
    devices = list(device_budgets.devices)
    costs = build_problem(traced.graph_module, model, device_index={d: k for k, d in enumerate(devices)})
    costed_at = time.perf_counter()
    solution = partition(costs.problem, device_budgets.caps(), device_names=devices)
    plan = make_plan(
        costs,
        traced.graph_module,
        solution,
        device_budgets,
        output_device=None,
        trace=traced.method,
        objective="min_transfer",
    )
    planned_at = time.perf_counter()
    rss_peak = _rss_gib()

    budgets = device_budgets.caps()
    acc_start = time.perf_counter()
    device_map = accelerate_map(model, budgets, model._no_split_modules)
    acc_time = time.perf_counter() - acc_start
    acc = score(costs, from_device_map(costs, device_map, len(budgets)), budgets)
    print(
        json.dumps(
            {
                "layers": args.layers,
                "parameters": sum(p.numel() for p in model.parameters()),
                "weight_bytes": sum(w.nbytes for w in [*costs.weights, *costs.unused]),
                "graph_nodes": len(traced.graph_module.graph.nodes),
                "ops": costs.problem.num_ops,
                "budget_bytes": budgets[0],
                "trace_s": traced_at - start,
                "plan_s": planned_at - traced_at,
                "cost_model_s": costed_at - traced_at,
                "trace_plan_s": planned_at - start,
                "rss_before_gib": rss_before,
                "peak_rss_gib": rss_peak,
                "ru_maxrss_gib": _maxrss_gib(),
                "fxsplit_bytes_between": plan.transfer_bytes,
                "fxsplit_device_bytes": [plan.device_bytes[d] for d in devices],
                "accelerate_map_s": acc_time,
                "accelerate_bytes_between": acc.bytes_between,
                "accelerate_offload_bytes": acc.offload_bytes,
                "accelerate_spilled_bytes": acc.spilled_bytes,
                "accelerate_empty_devices": acc.empty_devices,
                "accelerate_device_bytes": list(acc.device_bytes),
            }
        )
    )


if __name__ == "__main__":
    main()
