"""How close is the planned activation memory to what the split model really allocates?

For every model, device count and mode, split the model with fxsplit (budgets
tight enough that every device is used), run it on logical CPU devices and
read the allocator's own record per logical device
(:func:`fxsplit.memory.allocmeter.allocated_peaks`: activations, copies between
devices, saved tensors and activation gradients; never parameters, buffers,
inputs or parameter gradients), and compare with the plan's
``activations_peak``. The dispatch-mode meter
(:class:`fxsplit.memory.measure.ActivationMeter`) is shown beside it; it reads
high where autograd sums gradients (it makes torch sum them out of place).

* ``inference``: one forward under ``torch.no_grad()`` (models in eval mode);
* ``training``: forward and backward, each output's gradient made as a loss's
  backward makes it (models in train mode: dropout masks and batch
  statistics included).

The bar: the estimate within +-15% of the measured peak on every device,
and in training never below it by more than 5%. Also plans a Llama-70B-sized
model built on the meta device in a subprocess (time, peak RSS).

    python benchmarks/memory_estimate.py [--quick] [--skip-70b]

writes benchmarks/MEMORY_RESULTS.md and benchmarks/memory_results.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import fxsplit
from fxsplit.memory.allocmeter import allocated_peaks
from fxsplit.memory.measure import measure_forward, measure_training

HERE = Path(__file__).parent


class Residual(nn.Module):
    def __init__(self, width: int = 128, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class UNet(nn.Module):
    """Two levels down, two up, skips concatenated across the whole net; batch norm."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()

        def block(i: int, o: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())

        self.d1, self.d2, self.mid = block(3, c), block(c, 2 * c), block(2 * c, 2 * c)
        self.u2, self.u1 = block(4 * c, c), block(2 * c, c)
        self.out = nn.Conv2d(c, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.d1(x)
        b = self.d2(nn.functional.max_pool2d(a, 2))
        m = self.mid(nn.functional.max_pool2d(b, 2))
        u = self.u2(torch.cat([nn.functional.interpolate(m, scale_factor=2.0), b], dim=1))
        u = self.u1(torch.cat([nn.functional.interpolate(u, scale_factor=2.0), a], dim=1))
        return self.out(u)


def _mlp() -> nn.Module:
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.GELU())])


def _hf(kind: str) -> nn.Module:
    import transformers as t

    if kind == "gpt2":
        return t.GPT2LMHeadModel(
            t.GPT2Config(
                n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=128, bos_token_id=0, eos_token_id=0
            )
        )
    if kind == "bert":
        return t.BertModel(
            t.BertConfig(
                num_hidden_layers=4,
                hidden_size=128,
                num_attention_heads=4,
                intermediate_size=512,
                vocab_size=512,
                max_position_embeddings=128,
            )
        )
    if kind == "llama":
        return t.LlamaForCausalLM(
            t.LlamaConfig(
                num_hidden_layers=4,
                hidden_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=352,
                vocab_size=512,
                max_position_embeddings=128,
            )
        )
    return t.ViTModel(
        t.ViTConfig(
            num_hidden_layers=4,
            hidden_size=128,
            num_attention_heads=4,
            intermediate_size=512,
            image_size=32,
            patch_size=4,
        )
    )


def _checkpointed(kind: str) -> nn.Module:
    """The Hugging Face model with ``gradient_checkpointing_enable`` (each block recomputed in backward)."""
    model = _hf(kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))


# name -> (factory, input, example kwargs, trace)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], dict[str, Any], str]] = {
    "mlp (fx)": (_mlp, lambda: torch.randn(64, 256), {}, "fx"),
    "mlp (export)": (_mlp, lambda: torch.randn(64, 256), {}, "export"),
    "residual": (Residual, lambda: torch.randn(8, 32, 128), {}, "export"),
    "unet (fx)": (UNet, lambda: torch.randn(2, 3, 32, 32), {}, "fx"),
    "unet (export)": (UNet, lambda: torch.randn(2, 3, 32, 32), {}, "export"),
    "gpt2": (lambda: _hf("gpt2"), _ids, {"use_cache": False}, "export"),
    "bert": (lambda: _hf("bert"), _ids, {}, "export"),
    "llama": (lambda: _hf("llama"), _ids, {"use_cache": False}, "export"),
    "gpt2 (checkpointed)": (lambda: _checkpointed("gpt2"), _ids, {"use_cache": False}, "export"),
    "llama (checkpointed)": (lambda: _checkpointed("llama"), _ids, {"use_cache": False}, "export"),
    "vit": (lambda: _hf("vit"), lambda: torch.randn(4, 3, 32, 32), {}, "export"),
}


def run_case(name: str, n: int, mode: str) -> list[dict[str, Any]]:
    """Split ``name`` over ``n`` devices for ``mode`` and compare estimate and measurement per device."""
    factory, make_input, kwargs, trace = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    model.train(mode == "training")
    x = make_input()
    options = {"example_kwargs": kwargs or None, "trace": trace, "mode": mode}
    alone = fxsplit.plan(model, {"cpu:0": "8GiB"}, example_inputs=(x,), **options).memory["cpu:0"]
    for slack in (1.15, 1.3, 1.5, 1.8, 2.2, 3.0):
        each = int(slack * alone["total"] / n) + alone["activations_peak"] // 2
        try:
            split = fxsplit.fxsplit(model, {f"cpu:{i}": each for i in range(n)}, example_inputs=(x,), **options)
        except fxsplit.BudgetError:
            continue
        break
    else:
        raise RuntimeError(f"{name}: no budget up to 3x fits {n} devices")
    plan = split.meta["fxsplit_plan"]
    if mode == "training":
        for parameter in split.parameters():
            parameter.grad = None
        measured = allocated_peaks(split, x, backward=True)
        for parameter in split.parameters():
            parameter.grad = None
        dispatched = measure_training(split, x)
    else:
        with torch.no_grad():
            measured = allocated_peaks(split, x)
            dispatched = measure_forward(split, x)
    rows = []
    for device in plan.devices:
        if not plan.modules.get(device) and device != plan.output_device:
            continue
        estimate = plan.memory[device]["activations_peak"]
        real = measured.get(device, 0)
        rows.append(
            {
                "model": name,
                "devices": n,
                "mode": mode,
                "device": device,
                "measured": real,
                "dispatch_meter": dispatched.get(device, 0),
                "estimated": estimate,
                "ratio": round(estimate / real, 4) if real else None,
                "budget": plan.budgets[device],
                "planned_total": plan.memory[device]["total"],
                "weights_and_state": plan.memory[device]["total"] - estimate,
            }
        )
    return rows


def passes(row: dict[str, Any]) -> bool:
    ratio = row["ratio"]
    if ratio is None:
        return row["estimated"] == 0
    low = 0.95 if row["mode"] == "training" else 0.85
    return low <= ratio <= 1.15


def plan_70b() -> list[dict[str, Any]]:
    """Plan a Llama-70B-sized meta model in a subprocess per mode; its time and peak RSS."""
    found = []
    # training: weights, gradients, Adam's two states and its foreach step's temporaries (one per trainable
    # byte on CUDA) come to about 42 GiB a device over 16, so 20 devices
    for mode, devices in (("inference", 8), ("training", 20)):
        command = [sys.executable, str(HERE / "plan_llama70b.py"), "--mode", mode, "--devices", str(devices)]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - start
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result.pop("memory")
        result["devices"] = devices
        result["subprocess_wall_s"] = round(wall, 1)
        found.append(result)
    return found


def write(rows: list[dict[str, Any]], big: list[dict[str, Any]], seconds: float) -> None:
    (HERE / "memory_results.json").write_text(json.dumps({"rows": rows, "llama70b": big}, indent=1) + "\n")
    lines = [
        "# Planned vs measured activation memory",
        "",
        "Written by `python benchmarks/memory_estimate.py` "
        f"(torch {torch.__version__}, {platform.machine()}, {seconds:.0f} s). "
        "Each model is split with budgets that need every device; *measured* is the peak of live bytes per "
        "logical device in the allocator's own record (`fxsplit.memory.allocmeter.allocated_peaks`: activations, "
        "copies, saved tensors, activation gradients; not parameters, buffers, inputs or parameter gradients) over "
        "one forward (`inference`, eval mode, no_grad) or one forward and backward (`training`, train mode, each "
        "output's gradient made as a loss's backward makes it); *dispatch meter* is what "
        "`fxsplit.memory.measure.ActivationMeter` reads (high where autograd sums gradients: under a dispatch "
        "mode torch sums them out of place); *estimated* is `plan.memory[device]['activations_peak']`, and the "
        "ratio is estimated / measured. Bar: ratio in [0.85, 1.15], and >= 0.95 in training.",
        "",
        "| model | devices | mode | device | measured B | dispatch meter B | estimated B | ratio | bar |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(
            f"| {r['model']} | {r['devices']} | {r['mode']} | {r['device']} | {r['measured']} | "
            f"{r['dispatch_meter']} | {r['estimated']} | {ratio} | {'ok' if passes(r) else 'MISS'} |"
        )
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    lines += [
        "",
        f"{len(rows)} device rows; ratio min {min(ratios):.3f}, max {max(ratios):.3f}; "
        f"{sum(1 for r in rows if not passes(r))} outside the bar.",
        "",
    ]
    if big:
        lines += [
            "## Planning a Llama-70B-sized model on the meta device",
            "",
            "`python benchmarks/plan_llama70b.py --mode MODE --devices N` in a subprocess (80 layers, hidden "
            "8192, bf16, batch 1 x 2048 tokens, 40 GiB per device; no weights allocated).",
            "",
            "| mode | devices | graph nodes | trace s | activation profile s | partition + check s | "
            "total plan s | peak RSS MiB | devices used |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for b in big:
            lines.append(
                f"| {b['mode']} | {b['devices']} | {b['graph_nodes']} | {b['trace_s']} | {b['profile_s']} | "
                f"{b['partition_and_check_s']} | {b['plan_s']} | {b['peak_rss_mib']} | {b['devices_used']} |"
            )
        lines.append("")
    (HERE / "MEMORY_RESULTS.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 devices and a few models only")
    parser.add_argument("--skip-70b", action="store_true", help="do not plan the Llama-70B-sized model")
    args = parser.parse_args()
    start = time.perf_counter()
    names = ["mlp (fx)", "residual", "gpt2"] if args.quick else list(MODELS)
    rows: list[dict[str, Any]] = []
    for name in names:
        for n in (2,) if args.quick else (2, 4):
            for mode in ("inference", "training"):
                found = run_case(name, n, mode)
                rows.extend(found)
                print(name, n, mode, [(r["device"], r["ratio"]) for r in found], flush=True)
    big = [] if args.skip_70b else plan_70b()
    write(rows, big, time.perf_counter() - start)
    print(f"{sum(1 for r in rows if not passes(r))} of {len(rows)} rows outside the bar")


if __name__ == "__main__":
    main()
