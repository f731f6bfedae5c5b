import pytest
import torch

from runner.quant import (QuantConfig, act_qrange, act_scale_from_amax, calibrate, fake_quant_act, quantize_bias,
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


@pytest.mark.parametrize("mode", ["minmax", "percentile"])
def test_calibration_does_not_depend_on_batching(trained_lenet, mnist5k, mode):
    """The same images in batches of 64 or in one batch of 512 give the same statistics, bit for bit (the
    float model runs in float64 on the CPU, so how the kernels split their sums leaves no trace)."""
    from runner.models import fold_input_normalization

    model = fold_input_normalization(trained_lenet[0])
    small = calibrate(model, mnist5k.train_x, QuantConfig(activation=mode, calib_batches=8, calib_batch_size=64))
    whole = calibrate(model, mnist5k.train_x, QuantConfig(activation=mode, calib_batches=1, calib_batch_size=512))
    assert small == whole
    # the scales come from float32 statistics: each amax is a float32 value
    assert all(torch.tensor(s.amax_signed).double().item() == s.amax_signed for s in small.values())


@pytest.mark.cuda
def test_calibration_same_for_a_model_on_the_gpu(trained_lenet, mnist5k):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from runner.models import fold_input_normalization

    model = fold_input_normalization(trained_lenet[0])
    q = QuantConfig(calib_batches=2, calib_batch_size=128)
    on_cpu = calibrate(model, mnist5k.train_x, q)
    on_gpu = calibrate(model.cuda(), mnist5k.train_x.cuda(), q)
    assert on_cpu == on_gpu


def test_requant_setting_is_validated():
    from runner.errors import UserError

    assert QuantConfig(requant="integer").requant == "integer"
    with pytest.raises(UserError, match="quant.requant='fixed'"):
        QuantConfig(requant="fixed")


def test_quantize_bias_rounds_at_the_accumulator_scale():
    sa, sw = torch.tensor(0.02), torch.tensor([0.01, 0.5, 1e-6])
    bias = torch.tensor([0.00301, -0.0125, 1e9])
    q = quantize_bias(bias, sa, sw)
    assert q.dtype == torch.int32 and q.tolist() == [15, -1, 2**31 - 1]  # -1.25 -> -1; a huge one saturates


def test_bad_requant_is_exit_2_with_one_message(tmp_path):
    from tests.conftest import run_cli

    says = "quant.requant='fixed'"
    out = run_cli("compare", "quant.requant=fixed", f"paths.results={tmp_path}/r", f"paths.checkpoints={tmp_path}/c")
    assert out.returncode == 2 and "Traceback" not in out.stderr and says in out.stderr
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())  # stopped before training


@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
def test_quantize_weight_gives_the_codes_of_fake_quant_grid(granularity):
    """quantize_weight (plain tensor ops, no GPU wait) returns exactly the codes torch's fake-quant rounds to,
    ties and the clamp included."""
    from runner.quant import fake_quant_weight, quantize_weight, weight_scale

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 6, 5, 5, generator=gen)
    scale = weight_scale(w, granularity)
    ties = (torch.arange(-130, 131, dtype=torch.float32) + 0.5)[: 6 * 5 * 5].reshape(1, 6, 5, 5) * scale[0]
    w = torch.cat([w, ties])
    scale = torch.cat([scale, scale[:1]])
    want = torch.round(fake_quant_weight(w, scale) / scale.view(-1, 1, 1, 1)).to(torch.int8)
    assert torch.equal(quantize_weight(w, scale), want)


@pytest.mark.cuda
def test_scales_on_the_gpu_equal_the_cpus():
    """Weight and activation scales divide by 127/255 once on every device (a GPU's division by a Python
    number would multiply by its reciprocal and differ in the last bit for some values)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    w = torch.randn(4096, 9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(weight_scale(w, "per_channel"), weight_scale(w.cuda(), "per_channel").cpu())
    amax = torch.rand(4096, generator=torch.Generator().manual_seed(1)) * 8
    for signed in (True, False):
        on_cpu = torch.stack([act_scale_from_amax(a, signed) for a in amax[:512]])
        on_gpu = torch.stack([act_scale_from_amax(a, signed) for a in amax[:512].cuda()]).cpu()
        assert torch.equal(on_cpu, on_gpu)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_training_fake_quant_without_host_waits_equals_torchs(device):
    """The training forward's fake-quant ops in plain tensor ops (no host wait, so a CUDA graph can hold them)
    give torch's own ops' values and gradients bit for bit: per-channel weights (STE) and a learned
    activation scale (LSQ), codes inside and outside the range."""
    from runner.quant import fake_quant_act_lsq, fake_quant_weight_ste

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(6, 4, 5, 5, generator=gen) * 0.3).to(device)
    s = (w.detach().abs().amax((1, 2, 3)) / 127 * 0.8).to(device)      # 0.8: some weights clip
    g = torch.randn(w.shape, generator=gen).to(device)
    ours, theirs = w.clone().requires_grad_(), w.clone().requires_grad_()
    out = fake_quant_weight_ste(ours, s)
    ref = torch.fake_quantize_per_channel_affine(theirs, s, torch.zeros(6, dtype=torch.int32, device=device),
                                                 0, -127, 127)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    assert torch.equal(out, ref) and torch.equal(ours.grad, theirs.grad)
    for signed in (True, False):
        qmin, qmax = act_qrange(signed)
        x = (torch.randn(8, 3, 7, 7, generator=gen) * 2).to(device)
        gx = torch.randn(x.shape, generator=gen).to(device)
        scale = torch.tensor(0.011, device=device)
        xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        ss, st = scale.clone().requires_grad_(), scale.clone().reshape(1).requires_grad_()
        out = fake_quant_act_lsq(xs, ss, signed)
        ref = torch._fake_quantize_learnable_per_tensor_affine(xt, st, torch.zeros(1, device=device), qmin, qmax, 1.0)
        (out * gx).sum().backward()
        (ref * gx).sum().backward()
        assert torch.equal(out, ref) and torch.equal(xs.grad, xt.grad)
        assert torch.equal(ss.grad.reshape(1), st.grad), (ss.grad, st.grad)


def test_quantize_bias_rounds_half_to_even_not_towards_zero():
    """Quotients where truncation, floor, half-up and half-to-even disagree, both signs; scales powers of two
    so every quotient is exact."""
    sa, sw = torch.tensor(0.25), torch.tensor([1.0])
    quotients = [2.5, 3.5, -2.5, -3.5, 2.75, -2.75, 0.5, -0.5, 1.5, -1.5, 2.25, -2.25]
    q = torch.cat([quantize_bias(torch.tensor([v * 0.25]), sa, sw) for v in quotients])
    assert q.tolist() == [2, 4, -2, -4, 3, -3, 0, 0, 2, -2, 2, -2]
