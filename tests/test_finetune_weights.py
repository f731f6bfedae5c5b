"""finetune.weight_scale_factor: weight codes grown by 1/factor while retraining, the largest weights clipped,
and a retrained model that computes the same after the clip is made permanent, saved and reloaded."""
import copy

import pytest
import torch

from runner import finetune as ft
from runner.errors import UserError
from runner.finetune import FinetuneConfig, train_epochs
from runner.layers import quantized_layers
from runner.quant import QuantConfig, quantize_weight, true_divide, weight_scale
from tests.conftest import has_cpp, tiny_lenet

pytestmark = pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension (backend=cpp)")


def _amax(w):
    return w.detach().abs().reshape(w.shape[0], -1).amax(dim=1)


def test_factor_scales_the_weight_scale_and_grows_the_codes():
    """With factor f every channel's scale is f * max|w| / 127 (f = 1: exactly the plain rule, computed the old
    way here), the codes of the unclipped weights are 1/f times as large (to rounding), and every weight beyond
    f * max|w| is the end code +-127."""
    _, _, _, _, approx = tiny_lenet(32, multiplier="mul8u_T83")
    for layer in quantized_layers(approx).values():
        w = layer.weight.detach()
        amax = _amax(w)
        plain = torch.where(amax > 0, true_divide(amax, 127), torch.ones_like(amax))
        assert torch.equal(weight_scale(w, "per_channel"), plain)
        assert torch.equal(weight_scale(w, "per_channel", 1.0), plain)
        codes1 = quantize_weight(w, plain).int()
        half = weight_scale(w, "per_channel", 0.5)
        assert torch.equal(half, true_divide(amax * 0.5, 127))
        codes = quantize_weight(w, half).int()
        shape = (-1,) + (1,) * (w.dim() - 1)
        inside = w.abs() <= (0.5 * amax).view(shape)
        assert ((codes - 2 * codes1)[inside].abs() <= 1).all()
        assert (codes[~inside].abs() == 127).all() and (~inside).any()
        assert codes.abs().float().median() > 1.8 * codes1.abs().float().median()


def test_layer_factor_is_what_the_forward_uses_and_the_ste_masks_the_clipped_weights():
    """set_weight_scale_factor changes the scale and the codes the next forward computes with; the STE gradient of
    the weights clipped by the factor is 0, that of the others is not all 0."""
    data, _, _, _, approx = tiny_lenet(32, multiplier="mul8u_T83")
    approx.train()
    for layer in quantized_layers(approx).values():
        layer.set_weight_scale_factor(0.5)
    approx(data.train_x).logsumexp(1).sum().backward()
    for name, layer in quantized_layers(approx).items():
        w = layer.weight.detach()
        assert torch.equal(layer.weight_scale, weight_scale(w, "per_channel", 0.5)), name
        assert torch.equal(layer.weight_codes, quantize_weight(w, layer.weight_scale)), name
        shape = (-1,) + (1,) * (w.dim() - 1)
        clipped = torch.round(w / layer.weight_scale.view(shape)).abs() > 127
        assert clipped.any() and (layer.weight.grad[clipped] == 0).all(), name
        assert (layer.weight.grad[~clipped] != 0).any(), name


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_train_epochs_leaves_weights_the_plain_rule_reproduces(factor):
    """epochs=0 shows what train_epochs does around the steps: factor 1 leaves weights, scales and codes alone
    (today's behaviour); factor 0.5 clamps each channel to +-0.5 max|w| at the end, so the stored weights' plain
    max|w| / 127 is the factor's scale and every weight inside the bound is untouched."""
    data, q, _, _, approx = tiny_lenet(32, multiplier="mul8u_T83")
    model = copy.deepcopy(approx)
    # code_map off: the plain codes are the subject here (the map's own tests: tests/test_code_map.py)
    train_epochs(model, data, FinetuneConfig(epochs=0, weight_scale_factor=factor, learn_scales=False,
                                             code_map=False), q,
                 torch.device("cpu"), 0, "t")
    before, after = quantized_layers(approx), quantized_layers(model)
    for name, layer in after.items():
        w0, w = before[name].weight.detach(), layer.weight.detach()
        assert layer.weight_scale_factor == 1.0
        if factor == 1.0:
            assert torch.equal(w, w0) and torch.equal(layer.weight_scale, before[name].weight_scale)
            assert torch.equal(layer.weight_codes, before[name].weight_codes)
            continue
        bound = _amax(w0) * factor
        assert torch.equal(_amax(w), bound), name
        shape = (-1,) + (1,) * (w.dim() - 1)
        inside = w0.abs() <= bound.view(shape)
        assert torch.equal(w[inside], w0[inside])
        assert (w[~inside].abs() == bound.view(shape).expand_as(w)[~inside]).all()
        assert torch.equal(layer.weight_scale, weight_scale(w0, "per_channel", factor)), name


def _retrain_and_reload(backend: str, device: torch.device, path):
    """(outputs of the retrained model while the factor is still in force, the same model's outputs after
    train_epochs returns, and those of a fresh converted model that loaded its checkpoint, saved to `path`)."""
    data, q, _, _, approx = tiny_lenet(64, backend=backend, multiplier="mul8u_T83")
    model = copy.deepcopy(approx)
    real, seen = ft.set_weight_scale_factor, {}

    def spy(m, factor):
        if factor == 1.0:  # the end of training: outputs with the factor's scales, before the clamp
            training = m.training
            with torch.no_grad():
                seen["trained"] = m.eval()(data.test_x.to(device)).cpu()
                seen["codes"] = {n: l.weight_codes.cpu().clone() for n, l in quantized_layers(m).items()}
            m.train(training)
        real(m, factor)

    ft.set_weight_scale_factor = spy
    try:
        fcfg = FinetuneConfig(epochs=2, batch_size=16, weight_scale_factor=0.5)
        train_epochs(model, data, fcfg, q, device, 0, "t")
    finally:
        ft.set_weight_scale_factor = real
    with torch.no_grad():
        final = model.eval()(data.test_x.to(device)).cpu()
    ft._save(path, model, {})  # what finetune.obtain writes and reads
    fresh = copy.deepcopy(approx)
    ft._load(path, fresh)
    with torch.no_grad():
        reloaded = fresh.eval().to(device)(data.test_x.to(device)).cpu()
    codes = {n: l.weight_codes.cpu() for n, l in quantized_layers(fresh).items()}
    return seen, final, reloaded, codes


@pytest.mark.parametrize("backend", ["cpp", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_retrained_checkpoint_reloads_to_the_same_outputs(backend, tmp_path):
    """The model retrained with factor 0.5 gives bit-identical outputs with the factor in force, after the clamp
    that ends training, and reloaded from its state dict into a freshly converted model (plain weight rule),
    with the same weight codes. Retraining moved the weights (the test could fail)."""
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    seen, final, reloaded, codes = _retrain_and_reload(backend, device, tmp_path / "retrained.pt")
    assert torch.equal(seen["trained"], final) and torch.equal(final, reloaded)
    for name, c in codes.items():
        assert torch.equal(c, seen["codes"][name]), name
    assert any((c.int().abs() == 127).sum() > c.shape[0] for c in codes.values())  # clipped weights at the end code


def test_factor_is_in_the_checkpoint_identity_and_the_row_and_validated():
    q = QuantConfig()
    a, b = (ft.identity({}, {}, [], q, FinetuneConfig(weight_scale_factor=f)) for f in (1.0, 0.5))
    assert a != b and b["finetune"]["weight_scale_factor"] == 0.5
    cols = ft.row_columns(FinetuneConfig(weight_scale_factor=0.35), {"epoch_s": 1.0}, "x.pt")
    assert cols["finetune_weight_scale_factor"] == 0.35
    assert FinetuneConfig.from_cfg({"weight_scale_factor": 0.5}).weight_scale_factor == 0.5
    for bad in (0, 1.5, -0.5, "big"):
        with pytest.raises(UserError, match="weight_scale_factor"):
            FinetuneConfig(weight_scale_factor=bad)
