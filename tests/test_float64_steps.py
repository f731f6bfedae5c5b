"""The float steps between a converted transformer's quantized layers (LayerNorm, softmax, GELU, a global average
pool) are float64 values rounded once to float32 (runner.float64_steps), in the fake-quant and the LUT model, and
the fp32 model keeps torch's float32 steps; on a GPU, backend=cuda then gives backend=cpp's logits bit for bit."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.float64_steps import (Float64GELU, Float64GlobalAvgPool, Float64LayerNorm, Float64Softmax,
                                  float64_steps)
from runner.layers import approximate
from runner.models import build_model
from runner.quant import QuantConfig
from tests.conftest import compose, has_cpp

FLOAT64 = (Float64LayerNorm, Float64Softmax, Float64GELU, Float64GlobalAvgPool)


# independent float64 references: Python's math (the C library) on each row, not torch's kernels
def _rows(t: torch.Tensor) -> list[list[float]]:
    return t.double().reshape(-1, t.shape[-1]).tolist()


def _layer_norm_ref(x, weight, bias, eps):
    out = []
    for row in _rows(x):
        mean = math.fsum(row) / len(row)
        var = math.fsum((v - mean) ** 2 for v in row) / len(row)
        rstd = 1.0 / math.sqrt(var + eps)
        out.append([(v - mean) * rstd * w + b for v, w, b in zip(row, weight.tolist(), bias.tolist())])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape).float()


def _softmax_ref(x):
    out = []
    for row in _rows(x):
        top = max(row)
        e = [math.exp(v - top) for v in row]
        total = math.fsum(e)
        out.append([v / total for v in e])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape).float()


def _gelu_ref(x):
    flat = [v * 0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x.double().flatten().tolist()]
    return torch.tensor(flat, dtype=torch.float64).reshape(x.shape).float()


def _pool_ref(x):
    maps = x.double().reshape(-1, x.shape[-2] * x.shape[-1]).tolist()
    return torch.tensor([math.fsum(m) / len(m) for m in maps], dtype=torch.float64).reshape(
        *x.shape[:-2], 1, 1).float()


def _reference(module, x):
    if isinstance(module, nn.LayerNorm):
        return _layer_norm_ref(x, module.weight.detach(), module.bias.detach(), module.eps)
    if isinstance(module, nn.Softmax):
        return _softmax_ref(x)
    if isinstance(module, nn.GELU):
        return _gelu_ref(x)
    return _pool_ref(x)


def test_each_step_is_the_float64_value_rounded_once_where_torchs_float32_step_is_not():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 65, 64, generator=gen) * 3 + 1
    ln = nn.LayerNorm(64)
    with torch.no_grad():
        ln.weight.normal_(generator=gen), ln.bias.normal_(generator=gen)
    cases = [(ln, x), (nn.Softmax(dim=-1), x * 4), (nn.GELU(), x), (nn.AdaptiveAvgPool2d(1), x.reshape(16, 4, 65, 64))]
    for module, inp in cases:
        want = _reference(module, inp)
        with torch.no_grad():
            float32 = module(inp)
            got = float64_steps(nn.Sequential(copy.deepcopy(module)))[0](inp)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        assert torch.equal(got, want), type(module).__name__
        # torch's float32 steps (their sums, exp, erf) round differently on some elements: the check has teeth
        assert not torch.equal(float32, want), type(module).__name__


def test_swap_keeps_the_modules_their_settings_and_state():
    model = nn.Sequential(nn.LayerNorm(8, eps=1e-6, bias=False), nn.GELU(approximate="tanh"), nn.Softmax(dim=1),
                          nn.AdaptiveAvgPool2d(1), nn.AdaptiveAvgPool2d(2))
    keys, ids = list(model.state_dict()), [id(m) for m in model]
    float64_steps(model)
    assert [type(m) for m in model] == [Float64LayerNorm, Float64GELU, Float64Softmax, Float64GlobalAvgPool,
                                        nn.AdaptiveAvgPool2d]
    assert list(model.state_dict()) == keys and [id(m) for m in model] == ids
    assert model[0].eps == 1e-6 and model[1].approximate == "tanh" and model[2].dim == 1
    x = torch.randn(3, 8, dtype=torch.float64)  # a float64 input stays float64 (calibration's copies)
    assert model[0](x).dtype == torch.float64
    torch.testing.assert_close(model[1](x.float()), F.gelu(x.float(), approximate="tanh"))


def _vit():
    torch.manual_seed(0)
    cfg = compose("train", ["model=vit", "model.dim=32", "model.depth=2", "model.heads=2", "model.approx_matmuls=true"])
    return build_model(cfg.model, 0.1, 0.3).eval()


def _float_steps(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.LayerNorm, nn.Softmax, nn.GELU))}


def test_converted_vit_computes_its_float_steps_in_float64_in_both_models():
    model, gen = _vit(), torch.Generator().manual_seed(1)
    x = torch.rand(48, 1, 28, 28, generator=gen)
    backend = "cpp" if has_cpp() else "python"
    fq, approx = approximate(model, "exact", x, QuantConfig(calib_batches=1, calib_batch_size=48), backend=backend,
                             matmuls=True)
    steps = _float_steps(model)
    # the fp32 model keeps torch's float32 modules; the explicit attention's softmax is one of them
    assert all(type(m) in (nn.LayerNorm, nn.Softmax, nn.GELU) for m in steps.values())
    assert sum(type(m) is nn.Softmax for m in steps.values()) == 2 and len(steps) == 2 * 4 + 1
    for converted in (fq, approx):
        found = _float_steps(converted)
        assert list(found) == list(steps) and all(isinstance(m, FLOAT64) for m in found.values())
        seen = []
        hooks = [m.register_forward_hook(lambda m, a, o: seen.append((m, a[0], o))) for m in found.values()]
        with torch.no_grad():
            converted(x[:8])
        for h in hooks:
            h.remove()
        assert len(seen) == len(found)
        for module, inp, out in seen:
            assert torch.equal(out, _reference(module, inp))
    with torch.no_grad():
        assert torch.equal(fq(x[:8]), approx(x[:8]))


@pytest.mark.skipif(not has_cpp(), reason="needs the cpp extension")
def test_a_small_torchvision_swin_swaps_every_float_step_and_exact_still_equals_fake_quant():
    from torchvision.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    model = SwinTransformer([4, 4], 16, [2, 2], [2, 2], [4, 4], num_classes=5).eval()
    nn.init.normal_(model.head.weight)
    x = torch.rand(8, 3, 32, 32)
    fq, approx = approximate(model, "exact", x, QuantConfig(calib_batches=1, calib_batch_size=8), backend="cpp",
                             matmuls=True)
    for converted in (fq, approx):
        kinds = {type(m) for m in converted.modules()}
        assert set(FLOAT64) <= kinds
        assert not kinds & {nn.LayerNorm, nn.Softmax, nn.GELU, nn.AdaptiveAvgPool2d}
    with torch.no_grad():
        assert torch.equal(fq(x), approx(x))


@pytest.mark.cuda
@pytest.mark.parametrize("table", ["mul8s_1L2N", "mul8u_2V0"])
def test_cuda_vit_with_the_products_matches_cpp(table):
    """The zoo's ViT with every layer and its attention products in the table: backend=cuda gives backend=cpp's
    logits bit for bit. The unsigned table multiplies the products (sign-magnitude), the exact signed table the
    Linear layers and the patch conv (whose inputs are signed): left in fp32, as with model.approx_layers naming the
    products alone, those would sum in float32 in another order on each device, and no logits could agree."""
    from runner._ext import backend_status
    from runner.quant import quant_layers

    if backend_status().get("cuda") != "available" or not torch.cuda.is_available():
        pytest.skip("needs the CUDA extension and a GPU")
    torch.manual_seed(0)
    model = build_model(compose("train", ["model=vit", "model.approx_matmuls=true"]).model, 0.286, 0.353).eval()
    gen = torch.Generator().manual_seed(1)
    calib, x = torch.rand(256, 1, 28, 28, generator=gen), torch.rand(512, 1, 28, 28, generator=gen)
    qcfg = QuantConfig(calib_batches=1, calib_batch_size=256)
    tables = table if table.startswith("mul8s") else \
        {n: table if n.endswith((".qk", ".av")) else "exact" for n in quant_layers(model)}
    _, cpu = approximate(model, tables, calib, qcfg, backend="cpp", matmuls=True)
    _, gpu = approximate(model, tables, calib, qcfg, backend="cuda", matmuls=True)
    gpu = gpu.to("cuda")
    with torch.no_grad():
        want = torch.cat([cpu(x[i:i + 128]) for i in range(0, len(x), 128)])
        got = torch.cat([gpu(x[i:i + 128].cuda()).cpu() for i in range(0, len(x), 128)])
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item():.3g}"
