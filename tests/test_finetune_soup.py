"""finetune.soup: k retraining runs from the same converted weights (seeds seed .. seed + k - 1), their weights,
biases and learned activation scales averaged into the model; its codes follow from the averaged weights."""
import copy

import pytest
import torch

from runner.errors import UserError
from runner.finetune import FinetuneConfig, train_epochs, train_run
from runner.layers import quantized_layers
from runner.quant import quantize_weight, weight_scale
from tests.conftest import has_cpp, tiny_lenet

pytestmark = pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension (backend=cpp)")


def test_soup_is_the_mean_of_runs_with_consecutive_seeds():
    data, q, _, _, approx = tiny_lenet(64, multiplier="mul8u_T83")
    cpu = torch.device("cpu")
    fcfg = FinetuneConfig(epochs=1, batch_size=16)
    runs = []
    for seed in (3, 4):
        member = copy.deepcopy(approx)
        train_run(member, data, fcfg, q, cpu, seed, "member")
        runs.append(member)
    assert not torch.equal(runs[0].conv1.weight, runs[1].conv1.weight)  # the seeds' runs differ
    soup = copy.deepcopy(approx)
    history = train_epochs(soup, data, FinetuneConfig(epochs=1, batch_size=16, soup=2), q, cpu, 3, "soup")
    assert [h["run"] for h in history] == [0, 1]
    members = [quantized_layers(m) for m in runs]
    for name, layer in quantized_layers(soup).items():
        mean_w = (members[0][name].weight + members[1][name].weight) / 2
        torch.testing.assert_close(layer.weight, mean_w, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.bias, (members[0][name].bias + members[1][name].bias) / 2, rtol=0, atol=1e-6)
        geo = (members[0][name].act_scale * members[1][name].act_scale).sqrt()
        torch.testing.assert_close(layer.act_scale, geo, rtol=1e-6, atol=0)
        # the codes the next forward computes with are those of the averaged weights
        assert torch.equal(layer.weight_scale, weight_scale(layer.weight.detach(), layer.granularity))
        assert torch.equal(layer.weight_codes, quantize_weight(layer.weight.detach(), layer.weight_scale))
    assert torch.isfinite(soup(data.test_x)).all()


def test_soup_one_is_a_single_run_and_bad_values_are_refused():
    data, q, _, _, approx = tiny_lenet(32, multiplier="mul8u_T83")
    a, b = copy.deepcopy(approx), copy.deepcopy(approx)
    train_epochs(a, data, FinetuneConfig(epochs=1, batch_size=16), q, torch.device("cpu"), 0, "a")
    train_run(b, data, FinetuneConfig(epochs=1, batch_size=16), q, torch.device("cpu"), 0, "b")
    assert torch.equal(a.conv1.weight, b.conv1.weight)
    for bad in (0, -1, 1.5):
        with pytest.raises(UserError, match="soup"):
            FinetuneConfig(soup=bad)
    with pytest.raises(UserError, match="soup"):
        FinetuneConfig(soup=2, learn_scales=False, recalibrate="epoch")
