"""Energy estimate and operand-aware metrics, checked against counts and sums written out by hand."""
import math

import pytest
import torch
from torch import nn

from runner.energy import energy, layer_macs, power_mw
from runner.errors import UserError
from runner.layers import FakeQuantLinear
from runner.models import LeNet5
from runner.multipliers import resolve
from runner.multipliers.core import Multiplier, exact_table
from runner.operand import metrics, operand_histograms
from runner.quant import ActStats, QuantConfig

# LeNet-5 multiplies per image: outputs x products per output
LENET_MACS = {"conv1": 6 * 24 * 24 * 25, "conv2": 16 * 8 * 8 * 150, "fc1": 120 * 256, "fc2": 84 * 120, "fc3": 10 * 84}


def test_layer_macs_of_lenet5():
    assert layer_macs(LeNet5(), (1, 28, 28)) == LENET_MACS


def test_energy_relative_to_the_exact_multiplier():
    exact, cheap, t83 = resolve("exact"), resolve("mul8u_17C8"), resolve("mul8u_T83")
    names = list(LENET_MACS)
    assert energy({n: exact for n in names}, names, LENET_MACS)["mult_energy_rel"] == pytest.approx(1.0)
    assert energy({n: cheap for n in names}, names, LENET_MACS)["mult_energy_rel"] == pytest.approx(0.104 / 0.425)
    # one layer approximated, the others count as the exact multiplier
    total = sum(LENET_MACS.values())
    want = (LENET_MACS["conv1"] * 0.034 + (total - LENET_MACS["conv1"]) * 0.425) / (total * 0.425)
    per = {n: t83 for n in names}
    assert energy(per, ["conv1"], LENET_MACS)["mult_energy_rel"] == pytest.approx(want)
    drum = resolve({"name": "drum", "family": "drum", "k": 4})
    assert energy({n: drum for n in names}, names, LENET_MACS)["mult_energy_rel"] is None   # no figure: no guess


def test_power_figures_from_config_and_identical_tables():
    assert power_mw(resolve("exact")) == 0.425                  # the generated exact table is mul8s_1KV6
    assert power_mw(resolve({"name": "mul8s_1L2J", "power_mw": 0.2})) == 0.2
    assert power_mw(resolve("mul8s_1L2J")) == 0.301              # the shared shipped object is untouched
    drum = resolve({"name": "drum", "family": "drum", "k": 4, "power_mw": 0.15})
    assert power_mw(drum) == 0.15
    for bad in (-1, 0, "x"):
        with pytest.raises(UserError, match="power_mw"):
            resolve({"name": "mul8s_1L2J", "power_mw": bad})


def _fq_linear(w_codes: torch.Tensor, signed: bool = True):
    layer = nn.Linear(w_codes.shape[1], w_codes.shape[0], bias=False)
    layer.weight.data = w_codes.float()
    # weight scale 1 (max |w| = 127, one scale) and activation scale 1: codes equal the values
    fq = FakeQuantLinear(layer, signed, QuantConfig(weight="per_tensor"), ActStats(0.0, 127.0, 255.0))
    return nn.Sequential(fq)


def test_operand_histogram_counts_every_product():
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (3, 4), generator=gen)
    w[0, 0] = 127
    x = torch.randint(-128, 128, (64, 4), generator=gen).float()
    q = QuantConfig(calib_batches=2, calib_batch_size=32)
    rec = operand_histograms(_fq_linear(w), ["0"], x, q, seed=0)["0"]
    brute = torch.zeros(256, 256, dtype=torch.float64)
    for row in x.long():
        for o in range(3):
            for k in range(4):
                brute[row[k] + 128, w[o, k] + 128] += 1
    assert torch.equal(rec["hist"], brute) and rec["k"] == 4
    assert rec["acc_ms"] == pytest.approx(float(((x @ w.float().t()).double() ** 2).mean()))


def test_operand_metrics_of_a_constant_error():
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (5, 8), generator=gen)
    w[0, 0] = 127
    x = torch.randint(-128, 128, (32, 8), generator=gen).float()
    rec = operand_histograms(_fq_linear(w), ["0"], x, QuantConfig(calib_batches=1, calib_batch_size=32), 0)
    exact = Multiplier("e", True, torch.from_numpy(exact_table(True)).int())
    off = Multiplier("e3", True, torch.from_numpy(exact_table(True) + 3).int())
    cols, layers = metrics({"0": exact}, rec, {"0": 40})
    assert cols["op_mae_pct"] == 0 and cols["op_acc_nrmse"] == 0
    cols, layers = metrics({"0": off}, rec, {"0": 40})
    m = layers["0"]
    assert m["op_mean_error"] == pytest.approx(3) and m["op_error_std"] == pytest.approx(0, abs=1e-6)
    assert m["op_acc_error_std"] == pytest.approx(8 * 3)                     # K products, each 3 too large
    assert m["op_acc_nrmse"] == pytest.approx(24 / math.sqrt(rec["0"]["acc_ms"]))


def test_run_from_kept_activations_equals_forward():
    from runner.models import run_from, run_until

    torch.manual_seed(0)
    model, x = LeNet5(mean=0.13, std=0.31).eval(), torch.rand(4, 1, 28, 28)
    with torch.no_grad():
        for layer in ("conv1", "conv2", "fc1", "fc3"):
            assert torch.equal(run_from(model, run_until(model, x, layer), layer), model(x))


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("stride,padding,dilation", [(1, 0, 1), (2, 1, 1), (1, 2, 2)])
def test_operand_histogram_of_a_conv_counts_every_tap(signed, stride, padding, dilation):
    """Every (activation, weight) pair a convolution multiplies, padding (code 0) included, counted one by one
    from the unfolded input; the accumulators' mean square from a float64 convolution."""
    from runner.layers import FakeQuantConv2d

    gen = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (4, 3, 3, 2), generator=gen)
    w[0, 0, 0, 0] = 127
    lo = -128 if signed else 0
    x = torch.randint(lo, lo + 256, (12, 3, 7, 6), generator=gen).float()
    layer = nn.Conv2d(3, 4, (3, 2), stride=stride, padding=padding, dilation=dilation, bias=False)
    layer.weight.data = w.float()
    amax = 127.0 if signed else 255.0
    fq = nn.Sequential(FakeQuantConv2d(layer, signed, QuantConfig(weight="per_tensor"), ActStats(0.0, amax, amax)))
    rec = operand_histograms(fq, ["0"], x, QuantConfig(calib_batches=2, calib_batch_size=8), seed=0)["0"]
    cols = torch.nn.functional.unfold(x, (3, 2), dilation=dilation, padding=padding, stride=stride)  # [B, K, L]
    rows = cols.transpose(1, 2).reshape(-1, 18).long() + (128 if signed else 0)
    brute = torch.zeros(256, 256, dtype=torch.float64)
    wk = w.reshape(4, 18) + 128
    for k in range(18):
        counts = torch.bincount(rows[:, k], minlength=256).double()
        for o in range(4):
            brute[:, wk[o, k]] += counts
    assert torch.equal(rec["hist"], brute) and rec["k"] == 18
    acc = torch.nn.functional.conv2d(x.double(), w.double(), stride=stride, padding=padding, dilation=dilation)
    assert rec["acc_ms"] == pytest.approx(float((acc ** 2).mean()))


def test_layer_macs_of_grouped_and_depthwise_convs():
    """A conv's multiplies per output are in_channels / groups x kernel: depthwise layers (MobileNetV2) have
    one input channel per output, not all of them."""
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.full = nn.Conv2d(8, 16, 3, padding=1)
            self.grouped = nn.Conv2d(16, 16, 3, padding=1, groups=4)
            self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
            self.pointwise = nn.Conv2d(16, 4, 1)

        def forward(self, x):
            return self.pointwise(self.depthwise(self.grouped(self.full(x))))

    per_pixel = 5 * 5
    assert layer_macs(Net(), (8, 5, 5)) == {"full": per_pixel * 16 * 8 * 9, "grouped": per_pixel * 16 * 4 * 9,
                                            "depthwise": per_pixel * 16 * 1 * 9, "pointwise": per_pixel * 4 * 16}


def test_accumulator_square_sum_is_exact_whatever_the_order():
    from runner.operand import _exact_square_sum

    gen = torch.Generator().manual_seed(0)
    acc = torch.randint(-(2**30), 2**30, (100_000,), generator=gen)
    want = sum(int(v) ** 2 for v in acc.tolist())
    assert _exact_square_sum(acc) == want == _exact_square_sum(acc.flip(0))
    # a float64 sum of the same squares rounds (which is why its value depended on the device's order)
    assert int((acc.double() ** 2).sum().item()) != want
