import pytest
import torch

from runner.quant import (QuantConfig, act_qrange, act_scale_from_amax, calibrate, fake_quant_act,
                          fake_quant_weight, quantize_act, quantize_weight, weight_scale)


@pytest.mark.parametrize("signed", [True, False])
def test_activation_codes_are_fake_quant_integers(signed):
    torch.manual_seed(0)
    x = torch.randn(4096) * 3 if signed else torch.rand(4096) * 5
    scale = act_scale_from_amax(x.abs().max(), signed)
    codes = quantize_act(x, scale, signed)
    assert codes.dtype == (torch.int8 if signed else torch.uint8)
    lo, hi = act_qrange(signed)
    assert codes.int().min() >= lo and codes.int().max() <= hi
    # bit for bit: codes * scale is exactly what fake-quant produces
    assert torch.equal(codes.float() * scale, fake_quant_act(x, scale, signed))
    assert codes.int().abs().max() == (127 if signed else 255)  # the range is used in full


@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
def test_weight_codes_symmetric(granularity):
    torch.manual_seed(0)
    w = torch.randn(16, 6, 5, 5) * torch.linspace(0.1, 2, 16).view(-1, 1, 1, 1)
    s = weight_scale(w, granularity)
    assert s.shape == (16,)
    if granularity == "per_tensor":
        assert torch.all(s == s[0])
    else:
        assert not torch.all(s == s[0])
    codes = quantize_weight(w, s)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127 and codes.min() >= -127
    assert torch.equal(codes.float() * s.view(-1, 1, 1, 1), fake_quant_weight(w, s))
    # per-channel: every channel reaches 127 in magnitude
    if granularity == "per_channel":
        assert torch.all(codes.reshape(16, -1).abs().amax(1) == 127)


def test_zero_weight_channel_gets_scale_one():
    w = torch.zeros(3, 4)
    w[0] = 1.0
    s = weight_scale(w, "per_channel")
    assert s[1] == 1.0 and torch.equal(quantize_weight(w, s)[1], torch.zeros(4, dtype=torch.int8))


@pytest.mark.parametrize("mode", ["minmax", "percentile"])
def test_calibration_deterministic(trained_lenet, mnist5k, mode):
    from runner.models import fold_input_normalization

    model = fold_input_normalization(trained_lenet[0])
    q = QuantConfig(activation=mode, calib_batches=2, calib_batch_size=128)
    a = calibrate(model, mnist5k.train_x, q, seed=3)
    b = calibrate(model, mnist5k.train_x, q, seed=3)
    assert a == b and set(a) == {"conv1", "conv2", "fc1", "fc2", "fc3"}
    assert a["conv1"].min >= 0 and a["conv1"].amax_unsigned <= 1.0  # raw pixels after folding
    assert a["fc1"].min >= 0  # ReLU output
    if mode == "percentile":
        mm = calibrate(model, mnist5k.train_x, QuantConfig(calib_batches=2, calib_batch_size=128), seed=3)
        assert a["fc1"].amax_unsigned <= mm["fc1"].amax_unsigned
