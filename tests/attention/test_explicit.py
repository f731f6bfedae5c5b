"""The rewrites of runner.attention compute what the modules they replace compute, and conversion sees every
multiply of a transformer: each Linear, the products as layers when asked, functional weight reads routed."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.attention import Attention, MatMul, explicit_attention, use_matmuls
from runner.errors import UserError
from runner.layers import approximate, quantized_layers
from runner.quant import QuantConfig, calibrate, quant_layers

torchvision = pytest.importorskip("torchvision")


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim", [None, 12])
def test_multihead_attention_rewrite_computes_the_same(batch_first, kdim):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, kdim=kdim, vdim=kdim, dropout=0.1).eval()
    ex = Attention(copy.deepcopy(mha))
    q, k = torch.randn(3, 5, 16), torch.randn(3, 7, kdim or 16)
    if not batch_first:
        q, k = q.transpose(0, 1), k.transpose(0, 1)
    mask = torch.rand(5, 7) > 0.7
    mask[:, 0] = False
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, -2:] = True
    for kw in ({}, {"attn_mask": mask}, {"key_padding_mask": padding, "average_attn_weights": False},
               {"attn_mask": mask.float() * -1e4, "need_weights": False}):
        want, got = mha(q, k, k, **kw), ex(q, k, k, **kw)
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
        assert (got[1] is None) == (want[1] is None)
        if want[1] is not None:
            torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
    # unbatched input
    torch.testing.assert_close(ex(q[0] if batch_first else q[:, 0], k[0] if batch_first else k[:, 0],
                                  k[0] if batch_first else k[:, 0])[0],
                               mha(q[0] if batch_first else q[:, 0], k[0] if batch_first else k[:, 0],
                                   k[0] if batch_first else k[:, 0])[0], atol=1e-6, rtol=1e-5)


def test_multihead_attention_with_bias_kv_is_refused_by_name():
    model = nn.Sequential(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(UserError, match="0: .*add_bias_kv"):
        explicit_attention(model)


@pytest.mark.parametrize("factory", ["swin_t", "swin_v2_t"])
def test_swin_window_attention_rewrite_computes_the_same(factory):
    from torchvision.models.swin_transformer import ShiftedWindowAttention, ShiftedWindowAttentionV2

    torch.manual_seed(0)
    cls = ShiftedWindowAttention if factory == "swin_t" else ShiftedWindowAttentionV2
    for shift in ([0, 0], [2, 2]):
        attn = cls(16, [4, 4], shift, 2).eval()
        if factory == "swin_v2_t":  # a trained key bias, which V2 never uses
            nn.init.normal_(attn.qkv.bias)
        x = torch.randn(2, 7, 9, 16)  # padded to whole windows
        want = attn(x)
        ex = explicit_attention(nn.Sequential(copy.deepcopy(attn)))[0]
        assert isinstance(ex.qk, MatMul) and isinstance(ex.av, MatMul)
        torch.testing.assert_close(ex(x), want, atol=1e-5, rtol=1e-5)


class FunctionalReader(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3, bias=False)

    def forward(self, x):
        return F.linear(F.relu(F.linear(x, self.fc.weight, self.fc.bias)), self.out.weight)


def test_functional_weight_reads_are_routed_through_their_layer():
    torch.manual_seed(0)
    model, x = FunctionalReader().eval(), torch.randn(64, 6)
    with pytest.raises(UserError, match=r"never saw the input of layer\(s\) \['fc', 'out'\]"):
        calibrate(model, x, QuantConfig(calib_batches=1))
    fq, approx = approximate(model, "exact", x, backend="python")
    assert set(quantized_layers(approx)) == {"fc", "out"}
    with torch.no_grad():
        want, got_fq, got = model(x), fq(x), approx(x)
        # the same as converting a module that calls its layers
        plain = nn.Sequential(copy.deepcopy(model.fc), nn.ReLU(), copy.deepcopy(model.out)).eval()
        plain_fq, _ = approximate(plain, "exact", x, backend="python")
        assert torch.equal(got_fq, plain_fq(x))
    assert torch.equal(got, got_fq)
    assert (got - want).abs().max() < 0.05


def _tiny_vit():
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=16, mlp_dim=32, num_classes=5).eval()
    nn.init.normal_(model.heads.head.weight)  # torchvision starts the head at zero: logits would all be 0
    return model


def test_torchvision_vit_converts_every_linear_and_the_products():
    model, x = _tiny_vit(), torch.rand(8, 3, 16, 16)
    with torch.no_grad():
        fp32 = model(x[:2])
    for matmuls in (False, True):
        fq, approx = approximate(model, "exact", x, backend="python", matmuls=matmuls)
        names = list(quantized_layers(approx))
        blocks = [f"encoder.layers.encoder_layer_{i}" for i in range(2)]
        want = ["conv_proj"] + [f"{b}.{layer}" for b in blocks for layer in
                                ("self_attention.q_proj", "self_attention.k_proj", "self_attention.v_proj",
                                 "self_attention.out_proj") + (("self_attention.qk", "self_attention.av")
                                                               if matmuls else ()) + ("mlp.0", "mlp.3")]
        assert sorted(names) == sorted(want + ["heads.head"])
        assert not any(type(m) is nn.Linear for m in approx.modules())
        with torch.no_grad():
            got_fq, got = fq(x[:2]), approx(x[:2])
        assert torch.equal(got, got_fq)
        assert 0 < (got - fp32).abs().max() < 0.1 * fp32.abs().max()


def test_products_are_layers_only_when_asked():
    model = explicit_attention(_tiny_vit())
    assert not any(n.endswith((".qk", ".av")) for n in quant_layers(model))
    assert sum(n.endswith((".qk", ".av")) for n in quant_layers(use_matmuls(model, True))) == 4


def test_products_through_an_unsigned_table_are_sign_magnitude_and_exact():
    model, x = _tiny_vit(), torch.rand(8, 3, 16, 16)
    products = ["*.qk", "*.av"]
    fq, approx = approximate(model, "exact_unsigned", x, backend="python", matmuls=True, layers=products)
    av = approx.get_submodule("encoder.layers.encoder_layer_0.self_attention.av")
    assert not av.signed and not av.x_signed and av.y_signed
    with torch.no_grad():
        assert torch.equal(fq(x[:2]), approx(x[:2]))
    # a table that is not exact changes the products' results
    _, drum = approximate(model, "drum4_u", x, backend="python", matmuls=True, layers=products)
    with torch.no_grad():
        assert not torch.equal(drum(x[:2]), approx(x[:2]))


@pytest.mark.slow
@pytest.mark.parametrize("factory", ["vit_b_16", "swin_t"])
def test_torchvision_transformers_at_224(factory):
    torch.manual_seed(0)
    model = getattr(torchvision.models, factory)().eval()
    head = model.heads.head if factory == "vit_b_16" else model.head
    nn.init.normal_(head.weight, std=0.02)
    x = torch.rand(2, 3, 224, 224)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    from tests.attention.test_vit import _has_cpp_lut_bmm

    for matmuls in (False, True) if _has_cpp_lut_bmm() else (False,):  # the products need the cpp lut_bmm kernel
        fq, approx = approximate(model, "exact", x, backend="cpp", matmuls=matmuls,
                                 quant=QuantConfig(calib_batch_size=2, calib_batches=1))
        assert not any(type(m) in (nn.Linear, nn.MultiheadAttention) for m in approx.modules())
        names = set(quantized_layers(approx))
        assert all(n in names for n in linears if "self_attention.out_proj" not in n)
        assert any(n.endswith(".qk") for n in names) == matmuls
        with torch.no_grad():
            assert torch.equal(fq(x), approx(x))


def test_models_without_swin_never_import_torchvision():
    """torchvision's import costs every command a second or more on a small CPU: only a model holding its Swin
    classes (which has imported them) makes the rewrite look for them."""
    import subprocess
    import sys

    code = ("import sys, runner.layers\nfrom omegaconf import OmegaConf\nfrom runner.models import build_model\n"
            "build_model(OmegaConf.create({'_target_': 'runner.models.vit.ViT', 'name': 'vit'}))\n"
            "print('torchvision' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
