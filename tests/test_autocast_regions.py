"""``torch.autocast`` regions inside ``forward`` are kept in a torch.fx split (fxsplit/tracing/gradmode.py).

torch.fx ran ``with torch.autocast(...)`` once while tracing and kept nothing of it: a region that turns
autocast on computed in float32 in the split, and one that turns it off (float32 code under the caller's
autocast) computed in bfloat16, silently. torch.export keeps regions itself (``wrap_with_autocast``); a split of
its graph called under another autocast than it was traced under now says so instead of torch's
"Tensor dtype mismatch".
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxsplit
from fxsplit.errors import FxsplitError
from fxsplit.tracing.gradmode import AUTOCAST_FUNCTIONS

BUDGETS = {"cpu:0": 3000, "cpu:1": 3000}
X = torch.randn(4, 16)


class Block(nn.Module):
    def __init__(self, region: str) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.region = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.region == "off":  # float32 code, whatever the caller's autocast
            with torch.autocast("cpu", enabled=False):
                h = self.b(h.float())
        elif self.region == "on":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.b(h).float()
        else:
            h = self.decorated(h)
        return h.relu()

    @torch.autocast("cpu", dtype=torch.bfloat16)
    def decorated(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(h).float()


def model(region: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(region), Block(region), nn.Linear(16, 4))


def _run(m: nn.Module, outer: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = X.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=outer):
        out = m(x)
    out.float().sum().backward()
    return out.detach(), [x.grad]


@pytest.mark.parametrize("outer", [False, True], ids=["no autocast", "under autocast"])
@pytest.mark.parametrize("region", ["off", "on", "decorator"])
def test_an_fx_split_keeps_the_autocast_regions_of_forward(region: str, outer: bool) -> None:
    eager = model(region)
    expected, expected_grads = _run(eager, outer)
    m = model(region)
    split = fxsplit.fxsplit(m, BUDGETS, example_inputs=(X,), trace="fx", mode="weights")
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2
    kept = [n for n in split.graph.nodes if n.op == "call_function" and n.target in AUTOCAST_FUNCTIONS]
    assert len(kept) == 4  # a region per block: enter and exit
    got, grads = _run(split, outer)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(grads, expected_grads, rtol=0, atol=0)
    for p, q in zip(m.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert not torch.is_autocast_enabled("cpu")


def test_an_op_that_raises_inside_a_region_leaves_the_callers_autocast_as_it_was() -> None:
    split = fxsplit.fxsplit(model("on"), BUDGETS, example_inputs=(X,), trace="fx", mode="weights")
    for outer in (False, True):
        with torch.autocast("cpu", dtype=torch.float16, enabled=outer):
            with pytest.raises(RuntimeError):
                split(torch.randn(4, 7))  # the region's Linear refuses it
            assert torch.is_autocast_enabled("cpu") == outer
            assert torch.get_autocast_dtype("cpu") == torch.float16
    assert not torch.is_autocast_enabled("cpu")
    torch.testing.assert_close(split(X), model("on")(X), rtol=0, atol=0)


def test_a_pipeline_keeps_each_region_in_one_stage() -> None:
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model("off")
        expected = torch.cat([reference(rows) for rows in x.chunk(2)])  # per micro-batch, as the stages run
    config = fxsplit.PipelineConfig(chunks=2)
    pipeline = fxsplit.fxsplit(model("off"), BUDGETS, example_inputs=(x,), trace="fx", mode="weights", pipeline=config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(pipeline(x), expected, rtol=0, atol=0)


def test_an_export_split_called_under_another_autocast_says_so() -> None:
    split = fxsplit.fxsplit(model("off"), BUDGETS, example_inputs=(X,), trace="export", mode="weights")
    torch.testing.assert_close(split(X), model("off")(X), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(FxsplitError, match=r"another torch.autocast than it was traced under \(autocast now: on"):
            split(X)


class MakesTensors(nn.Module):
    """Makes a tensor of torch's default dtype in forward (``torch.full``): export keeps the traced dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * torch.full((16,), 1 / 3).to(x.dtype)


def test_an_export_split_called_under_another_default_dtype_says_so_not_autocast() -> None:
    """Before, the message blamed autocast (off), when torch's default dtype had changed since the split."""
    torch.manual_seed(0)
    x = torch.randn(4, 16, dtype=torch.float64)
    model = MakesTensors().eval()
    split = fxsplit.fxsplit(model, BUDGETS, example_inputs=(x,), trace="export", mode="weights")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(FxsplitError, match=r"default dtype is float64 now and was float32 when the model was"):
            split(x)
    finally:
        torch.set_default_dtype(default)
    torch.testing.assert_close(split(x), model(x), rtol=0, atol=0)
    assert copy.deepcopy(split).traced_default_dtype == torch.float32


def _llama_step(m: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits under bf16 autocast, and every parameter's gradient after a backward of their sum."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(ids, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    logits.float().sum().backward()
    return logits.detach(), {name: p.grad for name, p in m.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_an_export_split_under_autocast_trains_as_torch_export_s_own_graph(attention: str) -> None:
    """Under bf16 autocast a torch.export split computes what torch.export's own module does, to the bit. With
    transformers' SDPA attention that is not the eager model's to the bit: traced, transformers passes
    ``scaled_dot_product_attention`` an explicit causal mask, in eager ``is_causal=True``, and under bf16 their
    gradients differ by rounding (up to 0.14 on values of 41 here, within a bf16 step); with ``attn_implementation=
    "eager"`` the split's gradients are the eager model's (docs/GUARANTEES.md, "To the bit?")."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        attn_implementation=attention,
    )
    llama = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 100, (2, 8))
    eager, exported = copy.deepcopy(llama), torch.export.export(copy.deepcopy(llama), (ids,), {"use_cache": False})
    need = 8 * sum(p.nbytes for p in llama.parameters())
    split = fxsplit.fxsplit(
        llama,
        {"cpu:0": need * 2 // 5, "cpu:1": need * 2 // 5},
        example_inputs=(ids,),
        example_kwargs={"use_cache": False},
        trace="export",
        mode="training",
    )
    assert len(set(split.meta["fxsplit_plan"].param_devices.values())) == 2
    logits, grads = _llama_step(split, ids)
    reference = _llama_step(exported.module(), ids) if attention == "sdpa" else _llama_step(eager, ids)
    torch.testing.assert_close(logits, reference[0], rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[1][name], rtol=0, atol=0, msg=name)
    if attention == "sdpa":  # (and the eager model's differ, by rounding)
        _, own = _llama_step(eager, ids)
        assert any(not torch.equal(grad, own[name]) for name, grad in grads.items())
