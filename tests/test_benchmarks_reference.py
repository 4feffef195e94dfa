"""The block-level reference of the benchmarks: its DP equals brute force; placements are scored like fxsplit."""

from __future__ import annotations

import random

import pytest
import torch

import fxsplit
from benchmarks.models import MLP, top_level_blocks
from benchmarks.placements import Placement, from_device_map, from_plan, lookup, score
from benchmarks.reference import block_optimum, block_problem, brute_force, op_blocks
from fxsplit.cost.build import build_problem
from fxsplit.partition.problem import PartitionProblem, Value
from fxsplit.partition.solve import transfer_bytes
from fxsplit.tracing.capture import trace


def _random_problem(rng: random.Random) -> tuple[PartitionProblem, list[int]]:
    n_ops = rng.randint(2, 14)
    n_blocks = rng.randint(1, min(7, n_ops))
    # Mostly increasing block ids, with some interleaving (glue code, shared modules).
    op_block = sorted(rng.randrange(n_blocks) for _ in range(n_ops))
    for _ in range(rng.randint(0, 2)):
        i, j = rng.randrange(n_ops), rng.randrange(n_ops)
        op_block[i], op_block[j] = op_block[j], op_block[i]
    values = []
    for op in range(n_ops):
        values.append(Value(f"w{op}", rng.choice([0, 3, 50]), op, (op,), weight=rng.randint(0, 40)))
        readers = sorted({r for r in (rng.randint(op + 1, n_ops) for _ in range(rng.randint(1, 3))) if r < n_ops})
        if readers:
            values.append(Value(f"a{op}", rng.randint(1, 30), op, tuple(readers)))
    shared = sorted(rng.sample(range(n_ops), min(n_ops, 3)))
    values.append(Value("tied", 25, shared[0], tuple(shared), weight=rng.randint(0, 30)))
    together = ((0, 1),) if rng.random() < 0.2 and n_ops > 1 else ()
    problem = PartitionProblem(tuple(f"op{i}" for i in range(n_ops)), tuple(values), together=together)
    return problem, op_block


@pytest.mark.parametrize("seed", range(300))
def test_block_dp_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    problem, op_block = _random_problem(rng)
    bp = block_problem(problem, op_block)
    n_devices = rng.randint(1, 4)
    total = sum(bp.weights)
    budgets = [int(total / n_devices * rng.uniform(0.7, 2.0)) + 1 for _ in range(n_devices)]
    dp, brute = block_optimum(bp, budgets), brute_force(bp, budgets)
    assert (dp is None) == (brute is None)
    if dp is not None and brute is not None:
        assert dp.transfer_bytes == brute.transfer_bytes
        assert dp.transfer_bytes == transfer_bytes(problem, dp.op_devices)
        assert all(w <= b for w, b in zip(dp.device_weights, budgets, strict=True))
        assert list(dp.block_devices) == sorted(dp.block_devices)


def test_block_reference_on_a_traced_model_and_scores_match_fxsplit() -> None:
    model = MLP(dim=16, depth=6).eval()
    x = torch.randn(4, 16)
    traced = trace(model, example_inputs=(x,))
    costs = build_problem(traced.graph_module, model, device_index={})
    blocks = top_level_blocks(model, ("MLPBlock",))
    assert blocks == [f"blocks.{i}" for i in range(6)]
    bp = block_problem(costs.problem, op_blocks(costs.ops, blocks))
    total = sum(w.nbytes for w in costs.weights)
    budgets = [int(0.4 * total)] * 3
    dp, brute = block_optimum(bp, budgets), brute_force(bp, budgets)
    assert dp is not None and brute is not None and dp.transfer_bytes == brute.transfer_bytes
    assert dp.transfer_bytes == 2 * 4 * 16 * 4  # two activations of 4x16 float32 cross

    # The reference scores parameter bytes only: plan with the same memory model.
    plan = fxsplit.plan(model, {f"cpu:{k}": b for k, b in enumerate(budgets)}, example_inputs=(x,), mode="weights")
    mine = score(costs, from_plan(costs, plan), budgets)
    assert mine.bytes_between == plan.transfer_bytes <= dp.transfer_bytes
    assert mine.offload_bytes == 0 and mine.spilled_bytes == 0
    assert list(mine.device_bytes) == [plan.device_bytes[f"cpu:{k}"] for k in range(3)]


def test_device_map_placement_follows_accelerate_rules() -> None:
    model = MLP(dim=16, depth=4).eval()
    x = torch.randn(4, 16)
    traced = trace(model, example_inputs=(x,))
    costs = build_problem(traced.graph_module, model, device_index={})
    device_map = {"blocks.0": 0, "blocks.1": 1, "blocks.2": 1, "blocks.3": "disk"}
    placement = from_device_map(costs, device_map, 2)
    result = score(costs, placement, [10**6, 10**6])
    block_bytes = 16 * 16 * 4 + 16 * 4
    assert result.spilled_bytes == block_bytes
    assert result.offload_bytes == block_bytes  # streamed to the main device each forward
    # Activations: 0 -> 1 after block 0, 1 -> 0 (main device runs the offloaded block 3).
    assert result.bytes_between == 2 * 4 * 16 * 4
    assert result.empty_devices == 0
    assert lookup({"": 3, "a": 1}, "a.b") == 1 and lookup({"": 3}, "x") == 3
    assert isinstance(placement, Placement)
