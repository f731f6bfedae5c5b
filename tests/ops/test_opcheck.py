"""torch.library.opcheck: schema, fake (meta) kernels and dispatcher registrations agree."""
import pytest
import torch

from .conftest import backend_params, codes, cpp_only, random_lut, weights


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_opcheck_linear(gen, backend, device, signed):
    lut = random_lut(gen).to(device)
    for algo in ("auto", "direct", "expanded", *cpp_only(backend, "tiled")):
        a, w = codes(gen, (9, 17), signed).to(device), weights(gen, (5, 17)).to(device)
        torch.library.opcheck(torch.ops.approx.lut_linear.default, (a, w, lut, algo))


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_opcheck_conv(gen, backend, device, signed):
    lut = random_lut(gen).to(device)
    for algo in ("auto", "direct", "expanded", *cpp_only(backend, "tiled")):
        a = codes(gen, (2, 4, 7, 8), signed).to(device)
        w = weights(gen, (6, 2, 3, 2)).to(device)
        torch.library.opcheck(torch.ops.approx.lut_conv2d.default,
                              (a, w, lut, [2, 1], [1, 0], [1, 2], 2, algo))
