"""Fake weights made the cheap way (:mod:`fxsplit.tracing.fakeweights`) are what ``from_tensor`` makes: shape,
strides, dtype, device, requires_grad, and what tensors share."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from fxsplit.tracing.fakeweights import fake_weights


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())


def test_plain_weights_get_fakes_like_their_tensors() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).to(torch.float64)
    model[0].bias.requires_grad_(False)
    named = [*model.named_parameters(), *model.named_buffers()]
    fakes = fake_weights(FakeTensorMode(), named, requires_grad=lambda t: t.requires_grad)
    assert list(fakes) == [name for name, _ in named]
    for name, tensor in named:
        fake = fakes[name]
        assert isinstance(fake, FakeTensor), name
        assert (fake.shape, fake.stride(), fake.dtype, fake.device) == (
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
            tensor.device,
        )
        assert fake.requires_grad == tensor.requires_grad, name
    assert fakes["1.num_batches_tracked"].dtype == torch.int64


def test_a_tied_tensor_is_one_fake_and_tensors_over_one_storage_still_share_it() -> None:
    base = torch.randn(6, 4)
    named = [
        ("a", base),
        ("a_again", base),  # one tensor, two names
        ("alias", base.detach()),  # another tensor object over the same storage
        ("rows", base[2:]),  # a view
        ("transposed", torch.randn(4, 6).t()),  # not contiguous
    ]
    fakes = fake_weights(FakeTensorMode(), named, requires_grad=lambda t: False)
    assert fakes["a"] is fakes["a_again"]
    assert _same_storage(fakes["a"], fakes["alias"])
    assert _same_storage(fakes["a"], fakes["rows"])
    assert fakes["rows"].storage_offset() == 8 and fakes["rows"].shape == (4, 4)
    assert fakes["transposed"].stride() == (1, 6)
    assert not _same_storage(fakes["a"], fakes["transposed"])


def test_weights_on_meta_and_parameters_that_require_grad() -> None:
    with torch.device("meta"):
        layer = torch.nn.Linear(1 << 14, 1 << 14)  # 1 GiB of weights, never allocated
    named = list(layer.named_parameters())
    fakes = fake_weights(FakeTensorMode(), named, requires_grad=lambda t: isinstance(t, torch.nn.Parameter))
    assert fakes["weight"].device.type == "meta" and fakes["weight"].shape == (1 << 14, 1 << 14)
    assert fakes["weight"].requires_grad and fakes["bias"].requires_grad
    assert not _same_storage(fakes["weight"], fakes["bias"])
