"""Plan a Llama-70B-sized model built on the meta device: how long it takes and how much memory.

Nothing is allocated for the weights (meta tensors); the graph is traced by
torch.export on meta inputs, the activations are profiled on fake tensors,
and the partitioner places ~80 decoder layers. Run it in its own process so
the peak RSS is this planning's alone:

    python benchmarks/plan_llama70b.py [--mode inference|training] [--layers 80] [--seq 2048]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import transformers

from fxsplit import api


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="inference", choices=["inference", "training", "weights"])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--budget", default="40GiB")
    args = parser.parse_args()

    config = transformers.LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=args.layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        dtype="bfloat16",
    )
    start = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    built = time.perf_counter()
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    budgets = {f"cuda:{i}": args.budget for i in range(args.devices)}
    timings: dict[str, float] = {}
    planned = _timed_plan(model, budgets, ids, args.mode, timings)
    done = time.perf_counter()
    plan = planned.plan
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {
        "layers": args.layers,
        "mode": args.mode,
        "batch": args.batch,
        "seq": args.seq,
        "parameters_bytes": params,
        "graph_nodes": len(planned.traced.graph_module.graph.nodes),
        "build_s": round(built - start, 2),
        "plan_s": round(done - built, 2),
        **{k: round(v, 2) for k, v in timings.items()},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "devices_used": sum(1 for d in plan.devices if plan.modules.get(d)),
        "memory": plan.memory,
    }
    print(plan)
    print(json.dumps(result))


def _timed_plan(
    model: torch.nn.Module, budgets: dict[str, str], ids: torch.Tensor, mode: str, timings: dict[str, float]
) -> api.Planned:
    """api.trace_and_plan with the time of each stage recorded (trace, activation profile, partition + simulation)."""
    from fxsplit.memory import charge, fit
    from fxsplit.planning import offload
    from fxsplit.tracing import capture as trace

    def timed(name: str, func):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return func(*a, **k)
            finally:
                timings[name] = timings.get(name, 0.0) + time.perf_counter() - t

        return wrapper

    # patched where the planning modules look them up: api calls trace, the memory model (charge) profiles the
    # activations, and fit_or_offload (planning.offload) runs the partition-and-check loop
    originals = (api.trace, charge.profile_activations, offload.fit_budgets)
    api.trace = timed("trace_s", trace.trace)
    charge.profile_activations = timed("profile_s", charge.profile_activations)
    offload.fit_budgets = timed("partition_and_check_s", fit.fit_budgets)
    try:
        return api.trace_and_plan(model, budgets, (ids,), {"example_kwargs": {"use_cache": False}, "mode": mode})
    finally:
        api.trace, charge.profile_activations, offload.fit_budgets = originals


if __name__ == "__main__":
    main()
