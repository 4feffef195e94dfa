"""Short names for runs of modules (fxsplit.planning.ranges): ``layers.0`` ... ``layers.11`` -> ``layers.0-11``."""

from __future__ import annotations

import pytest

from fxsplit.planning.ranges import module_block, summarize_modules


@pytest.mark.parametrize(
    ("path", "block"),
    [
        ("", "<root>"),
        ("lm_head", "lm_head"),
        ("model.embed_tokens", "model.embed_tokens"),
        ("model.embed_tokens.x", "model.embed_tokens"),  # no number: the first two parts
        ("encoder.layers.3.mlp.fc1", "encoder.layers.3"),  # up to the first number
        ("layers.3.blocks.7", "layers.3"),
        ("0.weight", "0"),  # nn.Sequential at the root
        ("a.b.c.12", "a.b.c.12"),
        ("model.layers.\u00b2.mlp", "model.layers"),  # a superscript two is not a block index
        ("model.layers.\u0663.mlp", "model.layers"),  # nor an Arabic-Indic three
    ],
)
def test_module_block(path: str, block: str) -> None:
    assert module_block(path) == block


@pytest.mark.parametrize(
    ("paths", "summary"),
    [
        ([], []),
        ([""], ["<root>"]),
        (["layers.0.attn", "layers.0.mlp", "layers.1.attn"], ["layers.0-1"]),
        (["layers.4"], ["layers.4"]),  # a run of one keeps its plain name
        (["layers.0", "layers.1", "layers.3", "layers.4"], ["layers.0-1", "layers.3-4"]),  # a gap ends a run
        (["layers.2", "layers.1", "layers.0"], ["layers.2", "layers.1", "layers.0"]),  # only ascending runs merge
        (["enc.layers.0", "enc.layers.1", "dec.layers.2", "dec.layers.3"], ["enc.layers.0-1", "dec.layers.2-3"]),
        (["layers.0", "norm", "layers.1"], ["layers.0", "norm", "layers.1"]),  # not consecutive in the list
        (["layers.0", "layers.0", "layers.1", "layers.0"], ["layers.0-1", "layers.0"]),  # repeats fold, returns don't
        (["9", "10", "11"], ["9-11"]),  # numbers compare as numbers
        (["h.\u00b2.a", "h.\u00b3.a"], ["h.\u00b2", "h.\u00b3"]),  # superscripts are names, not a run
        (["embed", "layers.0.a", "layers.1.b", "head.proj"], ["embed", "layers.0-1", "head.proj"]),
    ],
)
def test_summarize_modules(paths: list[str], summary: list[str]) -> None:
    assert summarize_modules(paths) == summary


def test_summarize_accepts_any_iterable() -> None:
    assert summarize_modules(f"blocks.{i}.ffn" for i in range(48)) == ["blocks.0-47"]
