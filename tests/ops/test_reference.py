"""The python reference (the oracle) against a naive loop and against exact integer arithmetic."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from runner import reference

from .conftest import codes, exact_lut, random_lut, weights


def product(lut, a, w, signed):
    if signed:
        return int(lut[a + 128, w + 128])
    p = int(lut[a, abs(w)])
    return -p if w < 0 else p if w > 0 else 0  # sign(w) * lut[a][|w|]


def wrap32(v):
    return (v + 2**31) % 2**32 - 2**31


def naive_linear(a, w, lut):
    signed = a.dtype == torch.int8
    al, wl = a.tolist(), w.tolist()
    return torch.tensor([[wrap32(sum(product(lut, x, y, signed) for x, y in zip(row, wr))) for wr in wl]
                         for row in al], dtype=torch.int32).reshape(a.shape[0], w.shape[0])


def naive_conv(a, w, lut, stride, padding, dilation, groups):
    signed = a.dtype == torch.int8
    B, C, H, W = a.shape
    N, Cg, kh, kw = w.shape
    Ho = (H + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    Wo = (W + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    al, wl = a.tolist(), w.tolist()
    out = torch.zeros((B, N, Ho, Wo), dtype=torch.int32)
    ng = N // groups
    for b, n, oh, ow in itertools.product(range(B), range(N), range(Ho), range(Wo)):
        g = n // ng
        s = 0
        for c, i, j in itertools.product(range(Cg), range(kh), range(kw)):
            ih = oh * stride[0] - padding[0] + i * dilation[0]
            iw = ow * stride[1] - padding[1] + j * dilation[1]
            x = al[b][g * Cg + c][ih][iw] if 0 <= ih < H and 0 <= iw < W else 0  # padding = code 0
            s += product(lut, x, wl[n][c][i][j], signed)
        out[b, n, oh, ow] = wrap32(s)
    return out


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 7, 5), (6, 13, 2)])
def test_reference_linear_matches_naive(gen, signed, m, k, n):
    lut = random_lut(gen)
    a, w = codes(gen, (m, k), signed), weights(gen, (n, k))
    w.view(-1)[0] = 0  # signed: lut[a + 128][128] as is; unsigned: sign(0) = 0 despite lut[a][0]
    assert torch.equal(reference.reference_lut_linear(a, w, lut), naive_linear(a, w, lut))


CONV_CASES = [  # (B, C, H, W), (N, kh, kw), stride, padding, dilation, groups
    ((1, 1, 5, 6), (2, 3, 3), (1, 1), (0, 0), (1, 1), 1),
    ((2, 2, 6, 5), (4, 2, 3), (2, 1), (1, 2), (1, 1), 2),
    ((1, 3, 7, 7), (3, 3, 2), (1, 2), (2, 1), (2, 1), 3),
    ((1, 4, 6, 6), (2, 2, 2), (3, 3), (1, 1), (2, 2), 1),
]


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[f"case{i}" for i in range(len(CONV_CASES))])
def test_reference_conv_matches_naive(gen, signed, case):
    ashape, (n, kh, kw), stride, padding, dilation, groups = case
    lut = random_lut(gen)
    a = codes(gen, ashape, signed)
    w = weights(gen, (n, ashape[1] // groups, kh, kw))
    ref = reference.reference_lut_conv2d(a, w, lut, stride, padding, dilation, groups)
    assert torch.equal(ref, naive_conv(a, w, lut, stride, padding, dilation, groups))


def test_reference_wraps_like_int32(gen):
    lut = torch.full((256, 256), 2**31 - 1, dtype=torch.int32)
    a, w = codes(gen, (2, 5), True), weights(gen, (3, 5))
    assert torch.equal(reference.reference_lut_linear(a, w, lut), naive_linear(a, w, lut))


def test_reference_chunks_agree(gen, monkeypatch):
    """Chunking (which bounds memory at batch 10,000) must not change any sum."""
    lut = random_lut(gen)
    a, w = codes(gen, (37, 3, 9, 9), False), weights(gen, (4, 3, 3, 3))
    whole = reference.reference_lut_conv2d(a, w, lut, 1, 1)
    monkeypatch.setattr(reference, "_REF_CHUNK_BYTES", 1000)
    assert torch.equal(reference.reference_lut_conv2d(a, w, lut, 1, 1), whole)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_reference_exact_lut_is_integer_matmul(gen, signed):
    a, w = codes(gen, (50, 40), signed), weights(gen, (7, 40))
    out = reference.reference_lut_linear(a, w, exact_lut(signed))
    assert torch.equal(out.to(torch.int64), a.to(torch.int64) @ w.to(torch.int64).t())


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[f"case{i}" for i in range(len(CONV_CASES))])
def test_reference_exact_lut_is_conv(gen, signed, case):
    ashape, (n, kh, kw), stride, padding, dilation, groups = case
    a = codes(gen, ashape, signed)
    w = weights(gen, (n, ashape[1] // groups, kh, kw))
    out = reference.reference_lut_conv2d(a, w, exact_lut(signed), stride, padding, dilation, groups)
    # float64 holds these sums (< 2^53) exactly; zero padding is code 0 in both encodings.
    want = F.conv2d(a.double(), w.double(), None, stride, padding, dilation, groups)
    assert torch.equal(out.double(), want)
