"""Training through the LUT layers: gradients (ste / lut), weight requantization, table caches."""
import copy

import pytest
import torch
import torch.nn.functional as F

from runner._ext import backend_status
from runner.finetune import recalibrate
from runner.layers import learn_act_scales, quantized_models, set_grad_mode
from runner.multipliers import resolve
from runner.quant import QuantConfig

BACKENDS_ALL = [b for b, state in backend_status().items() if state == "available"]
LAYERS = ("conv1", "conv2", "fc1", "fc2", "fc3")


def _device(backend):
    return "cuda" if backend == "cuda" else "cpu"


def _params(backends):
    return [pytest.param(b, id=b, marks=[pytest.mark.cuda] if b == "cuda" else []) for b in backends]


@pytest.fixture(scope="module")
def lenet():
    from runner.models import LeNet5

    torch.manual_seed(0)
    return LeNet5(mean=0.1307, std=0.3081)


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(3)
    return torch.rand(32, 1, 28, 28, generator=gen), torch.randint(0, 10, (32,), generator=gen)


def _layer_inputs(model, x, names=LAYERS):
    """Each named layer's input in `model`, so both layers of a pair can be fed the same input."""
    seen = {}
    hooks = [getattr(model, n).register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, a[0].detach()))
             for n in names]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _layer_grads(layer, x, g):
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    layer(xi).backward(g)
    scale = getattr(layer, "act_log_scale", None)
    return (xi.grad, layer.weight.grad, layer.bias.grad) + (() if scale is None else (scale.grad,))


def _rel(a, b):
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("backend", _params(BACKENDS_ALL))
@pytest.mark.parametrize("grad", ["ste", "lut"])
@pytest.mark.parametrize("mult", ["exact", "exact_unsigned"])
@pytest.mark.parametrize("learn", [False, True], ids=["fixed_scales", "learned_scales"])
def test_exact_lut_gradients_equal_fakequant(lenet, batch, backend, grad, mult, learn, monkeypatch):
    """With the exact multiplier, both gradients are fake-quant's (QAT's) gradients, layer by layer, for the
    input, the weights, the bias and, when learned, the activation scale (torch's learnable fake-quant, LSQ):
    STE by construction, `lut` because the exact table's slopes are the operands themselves."""
    x, _ = batch
    # requant=float: the layers' inputs collected below are then off the code grid, as training inputs are;
    # integer hand-offs put them exactly on it, where the scale's gradient is a sum of rounding residuals
    q = QuantConfig(calib_batches=1, calib_batch_size=32, requant="float")
    fq, approx, _ = quantized_models(lenet, resolve(mult), q, x, backend=backend)
    set_grad_mode(approx, grad)
    learn_act_scales(fq, learn)
    learn_act_scales(approx, learn)
    dev = _device(backend)
    if dev == "cuda":  # fake-quant's conv gradient in TF32 would be the imprecise side of the comparison
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    fq, approx = fq.to(dev), approx.to(dev)
    gen = torch.Generator().manual_seed(0)
    for name, inp in _layer_inputs(fq, x.to(dev)).items():
        out = getattr(fq, name)(inp)
        g = torch.randn(out.shape, generator=gen).to(dev)
        want = _layer_grads(getattr(fq, name), inp, g)
        got = _layer_grads(getattr(approx, name), inp, g)
        # STE runs fake-quant's own aten calls; `lut` sums the same products in another order
        tol = 1e-6 if grad == "ste" else 2e-5
        assert len(want) == len(got) == (4 if learn else 3)
        for i, (w, a) in enumerate(zip(want, got)):
            # the scale's gradient is one fp32 sum over the whole input of terms of both signs (round(x/s) - x/s),
            # summed in another order than torch's: rounding shows more in it than in the others
            assert _rel(w, a) <= (1e-3 if i == 3 else tol), name


def test_lut_gradient_sees_the_multiplier_error(lenet, batch):
    """With a damaged multiplier the `lut` gradient differs from STE (it uses the table's slopes)."""
    x, _ = batch
    mult = resolve("mul8s_1L12")
    _, approx, _ = quantized_models(lenet, mult, QuantConfig(calib_batches=1, calib_batch_size=32), x)
    grads = {}
    for grad in ("ste", "lut"):
        layer = copy.deepcopy(approx.fc2)
        layer.set_grad(grad)
        inp = torch.rand(8, 120)
        grads[grad] = _layer_grads(layer, inp, torch.ones(8, 84))
    assert _rel(grads["ste"][1], grads["lut"][1]) > 1e-2
    assert torch.equal(grads["ste"][2], grads["lut"][2])  # the bias gradient does not involve the LUT


@pytest.mark.parametrize("backend", _params([b for b in BACKENDS_ALL if b != "python"]))
def test_compiled_lut_gradient_matches_reference(lenet, batch, backend):
    """The `lut` gradient on the fast kernels equals the python reference's, for a damaged multiplier."""
    x, _ = batch
    q = QuantConfig(calib_batches=1, calib_batch_size=32)
    for mult in ("mul8s_1L2N", "mul8u_T83"):
        _, ref, _ = quantized_models(lenet, resolve(mult), q, x, backend="python", layers=["conv2", "fc1"])
        _, fast, _ = quantized_models(lenet, resolve(mult), q, x, backend=backend, layers=["conv2", "fc1"])
        set_grad_mode(ref, "lut")
        set_grad_mode(fast, "lut")
        fast = fast.to(_device(backend))
        gen = torch.Generator().manual_seed(1)
        for name, inp in _layer_inputs(ref, x, ("conv2", "fc1")).items():
            g = torch.randn(getattr(ref, name)(inp).shape, generator=gen)
            want = _layer_grads(getattr(ref, name), inp, g)
            got = _layer_grads(getattr(fast, name), inp.to(_device(backend)), g.to(_device(backend)))
            for w, a in zip(want, got):
                assert _rel(w, a.cpu()) <= 2e-5, (mult, name)


@pytest.mark.parametrize("backend", _params([b for b in BACKENDS_ALL if b != "python"]))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_one_step_moves_weights_like_qat(lenet, batch, backend, optimizer):
    """One retraining step with the exact LUT and STE moves every weight as one QAT step of the fake-quant
    model does, to fp32 rounding. Layer by layer the gradients agree to 1e-6 (above); through the whole
    model the fp32 rounding of fake-quant's sums may decide a max-pool tie or a code boundary that the
    exact int32 sums decide the other way, so a few weights move by a few 1e-6 more or less."""
    x, y = batch
    dev = _device(backend)
    fq, approx, _ = quantized_models(lenet, resolve("exact"), QuantConfig(calib_batches=1, calib_batch_size=32), x,
                                     backend=backend)
    steps = []
    for model in (fq, approx):
        model = model.to(dev).train()
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd"
               else torch.optim.Adam(model.parameters(), lr=1e-3))
        opt.zero_grad()
        F.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
        opt.step()
        steps.append({n: (p.detach() - start[n]).cpu() for n, p in model.named_parameters()})
    for name, want in steps[0].items():
        got = steps[1][name]
        assert want.abs().max() > 0, f"{name} did not move"
        assert (want - got).abs().max().item() <= 5e-6, name
        assert ((want - got).norm() / want.norm()).item() <= 5e-3, name


@pytest.mark.parametrize("backend", _params([b for b in BACKENDS_ALL if b != "python"]))
@pytest.mark.parametrize("algo", ["auto", "expanded"])
def test_no_stale_table_after_optimizer_step(lenet, batch, backend, algo):
    """The kernels cache weight-expanded tables (cpp: by content, cuda: by tensor identity and version). After
    an optimizer step the model must compute with the new weights: its inference output equals that of a
    model freshly built from the stepped weights."""
    x, y = batch
    dev = _device(backend)
    q = QuantConfig(calib_batches=1, calib_batch_size=32)
    _, approx, _ = quantized_models(lenet, resolve("mul8s_1L2J"), q, x, backend=backend, algo=algo)
    approx = approx.to(dev)
    xs = torch.rand(600, 1, 28, 28, generator=torch.Generator().manual_seed(5)).to(dev)  # large: tables pay off
    with torch.no_grad():
        before = approx(xs)
        assert torch.equal(approx(xs), before)  # second call: from the cached tables
    opt = torch.optim.SGD(approx.parameters(), lr=0.5)
    approx.train()
    F.cross_entropy(approx(x.to(dev)), y.to(dev)).backward()
    opt.step()
    approx.eval()
    with torch.no_grad():
        after = approx(xs)
    fresh = copy.deepcopy(approx)
    for m in fresh.modules():
        if hasattr(m, "weight_codes"):
            m.weight_codes = m.weight_codes.clone()  # new tensors: nothing cached for them
            m._weight_seen = None
    with torch.no_grad():
        expected = fresh(xs)
    assert not torch.equal(after, before)
    assert torch.equal(after, expected)


def test_weight_codes_follow_load_state_dict(lenet, batch):
    x, _ = batch
    q = QuantConfig(calib_batches=1, calib_batch_size=32)
    _, a, _ = quantized_models(lenet, resolve("exact"), q, x)
    _, b, _ = quantized_models(lenet, resolve("exact"), q, x)
    with torch.no_grad():
        for p in a.parameters():
            p.mul_(0.5)
    with torch.no_grad():
        a(x)  # requantizes a's weights
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
        assert torch.equal(a.fc1.weight_codes, b.fc1.weight_codes)


def test_recalibrate_sets_static_scales(lenet, batch):
    x, _ = batch
    q = QuantConfig(calib_batches=1, calib_batch_size=32)
    _, approx, stats = quantized_models(lenet, resolve("exact"), q, x)
    with torch.no_grad():
        approx.fc1.weight.mul_(3.0)
    new = recalibrate(approx, x, q)
    assert new["fc2"].amax_signed > 2 * stats["fc2"].amax_signed
    for name in ("fc1", "fc2"):  # observed through the model's own (quantized) layers
        assert torch.allclose(getattr(approx, name).act_scale, torch.tensor(new[name].amax_signed / 127))
    assert abs(new["fc1"].amax_signed / stats["fc1"].amax_signed - 1) < 0.1


def test_unknown_grad_mode_is_a_user_error(lenet, batch):
    from runner.errors import UserError

    _, approx, _ = quantized_models(lenet, resolve("exact"), QuantConfig(calib_batches=1, calib_batch_size=32),
                                    batch[0])
    with pytest.raises(UserError, match="finetune.grad='exact'.*ste or lut"):
        set_grad_mode(approx, "exact")


def test_learned_scale_moves_and_is_fixed_afterwards(lenet, batch):
    x, y = batch
    _, approx, _ = quantized_models(lenet, resolve("mul8u_T83"), QuantConfig(calib_batches=1, calib_batch_size=32), x,
                                    layers=["fc1", "fc2"])
    start = approx.fc2.act_scale.clone()
    learn_act_scales(approx, True)
    assert {n for n, _ in approx.named_parameters() if "scale" in n} == {"fc1.act_log_scale", "fc2.act_log_scale"}
    opt = torch.optim.Adam(approx.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(approx.train()(x), y).backward()
        opt.step()
    learned = approx.fc2.act_log_scale.detach().exp()
    learn_act_scales(approx, False)
    assert not any("scale" in n for n, _ in approx.named_parameters())
    assert not torch.equal(approx.fc2.act_scale, start) and torch.equal(approx.fc2.act_scale, learned)


@pytest.mark.cuda
@pytest.mark.parametrize("grad", ["ste", "lut"])
def test_training_step_does_not_wait_for_the_gpu(lenet, batch, grad):
    """A retraining step (forward, loss, backward, Adam) on the GPU makes no host-device synchronization that
    torch can see: the weight check after a step and the input checks are device flags, read later. The first
    steps are left out (auto's trials and the first table builds may wait)."""
    x, y = batch
    _, approx, _ = quantized_models(lenet, resolve("exact"), QuantConfig(calib_batches=1, calib_batch_size=32), x,
                                    backend="cuda")
    model = approx.to("cuda").train()
    set_grad_mode(model, grad, 48)
    learn_act_scales(model, True)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x, y = x.cuda(), y.cuda()

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
