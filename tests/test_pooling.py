"""runner.pooling: converted models' 2x2 max-pool as two elementwise maxima, equal to max_pool2d."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.pooling import PairMaxPool2d


@pytest.mark.parametrize("shape", [(7, 6, 24, 24), (3, 16, 8, 8), (2, 3, 9, 7), (4, 5, 5), (2, 3, 1, 6), (0, 2, 4, 4)])
def test_pair_max_pool_equals_max_pool2d(shape):
    """Converted models pool 2x2 windows by two elementwise maxima: the values of max_pool2d on any shape (odd
    sides drop their last row or column), NaN and Inf where they fall; grad mode and other geometries run
    max_pool2d itself."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen)
    if x.numel():
        flat = x.view(-1)
        flat[torch.randint(0, flat.numel(), (3,), generator=gen)] = torch.tensor([float("nan"), float("inf"), -1e30])
    pool = nn.MaxPool2d(2)
    pool.__class__ = PairMaxPool2d
    with torch.no_grad():
        got = pool(x) if min(shape[-2:]) >= 2 else None
        if got is not None:
            want = F.max_pool2d(x, 2)
            assert got.shape == want.shape and torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
    others = (nn.MaxPool2d(3), nn.MaxPool2d(2, stride=1), nn.MaxPool2d(2, padding=1), nn.MaxPool2d(2, ceil_mode=True))
    for other in others:
        if min(shape[-2:]) < 3 or not x.numel():
            continue
        other.__class__ = PairMaxPool2d
        with torch.no_grad():
            assert torch.equal(other(x).nan_to_num(), F.max_pool2d(x, other.kernel_size, other.stride, other.padding,
                                                                   ceil_mode=other.ceil_mode).nan_to_num())
    ties = torch.ones(1, 1, 2, 2, requires_grad=True)
    pool(ties).sum().backward()  # max_pool2d's gradient: all of it to one maximum of the window
    assert ties.grad.flatten().tolist() == [1.0, 0.0, 0.0, 0.0]
