"""runner.code_map: the stored weight code nearest, in mean square over a layer's activations, to the exact
products of each code; kept by the layers through requantization, training and a checkpoint's reload."""
import copy

import pytest
import torch

from runner.code_map import fit_code_maps, identity_code_map, table_code_map
from runner.errors import UserError
from runner.finetune import FinetuneConfig, train_epochs
from runner.layers import quantized_layers
from runner.multipliers import resolve
from runner.quant import quantize_weight
from tests.conftest import has_cpp, tiny_lenet

needs_cpp = pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension (backend=cpp)")


def _cost(lut, signed, p, m, c):
    """sum_a p(a) (LUT[a][c] - a m)^2, term by term."""
    off = 128 if signed else 0
    a = torch.arange(256, dtype=torch.float64) - off
    return float((p * (lut[:, c + off].double() - a * m) ** 2).sum())


def _activation_counts(signed, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(256, generator=gen, dtype=torch.float64) ** 4  # uneven, like post-ReLU codes
    if not signed:
        p[:8] *= 20
    return p


@pytest.mark.parametrize("name", ["exact", "mul8s_1L2N", "mul8u_T83", "mul8u_17C8"])
def test_the_map_is_the_brute_force_argmin_and_an_exact_table_maps_to_itself(name):
    m = resolve(name)
    p = _activation_counts(m.signed)
    cmap = table_code_map(m.lut, m.signed, p)
    assert cmap.dtype == torch.int8 and cmap.shape == (256,)
    codes = range(-127, 128) if m.signed else range(0, 128)
    cands = list(codes)
    for code in list(codes)[::9] + [max(codes)]:
        costs = [_cost(m.lut, m.signed, p / p.sum(), code, c) for c in cands]
        chosen = int(cmap[code + 128])
        assert chosen in cands
        best = min(costs)
        assert costs[cands.index(chosen)] <= best + 1e-9 * max(1.0, abs(best)), (name, code)
        if not m.signed:  # magnitudes: the sign goes around the product
            assert int(cmap[128 - code]) == -chosen
    if name == "exact":
        assert torch.equal(cmap, identity_code_map())
    if not m.signed:
        assert int(cmap[128]) == 0
    assert cmap.abs().max() <= 127


def test_codes_whose_products_tie_keep_their_plain_code():
    """A table whose products do not depend on the weight code over the layer's activations (here: activations
    all 0, and a row 0 with an offset) gives no code a reason to move: the map is the identity, not every code
    sent to the first of the tied ones (which would leave the layer one weight value)."""
    lut = resolve("mul8s_1L2N").lut.clone()
    lut[128, :] = 37                      # activation 0: the same product for every weight code
    p = torch.zeros(256, dtype=torch.float64)
    p[128] = 1.0
    assert torch.equal(table_code_map(lut, True, p), identity_code_map())
    unsigned = resolve("mul8u_T83")
    p = torch.zeros(256, dtype=torch.float64)
    p[3] = 1.0                            # only activation 3: T83's products with operands below 8 are all 0
    cmap = table_code_map(unsigned.lut, False, p)
    assert torch.equal(cmap[128:136], torch.arange(8, dtype=torch.int8))


def test_a_coarse_table_gets_codes_that_cut_its_product_error():
    """mul8u_T83 over post-ReLU-like activations: the map moves a third of the codes or more, and cuts the
    weighted mean square product error of the plain codes by a fifth or more (26 % with these counts)."""
    m = resolve("mul8u_T83")
    p = _activation_counts(False)
    cmap = table_code_map(m.lut, False, p)
    moved = (cmap[128:] != torch.arange(128, dtype=torch.int8)).float().mean()
    assert moved > 0.3
    total = lambda f: sum(_cost(m.lut, False, p / p.sum(), code, f(code)) for code in range(128))
    assert total(lambda c: int(cmap[c + 128])) < 0.8 * total(lambda c: c)


@needs_cpp
def test_layers_store_mapped_codes_through_requantization_and_reload():
    data, q, _, _, approx = tiny_lenet(32, multiplier="mul8u_T83")
    model = copy.deepcopy(approx)
    maps = fit_code_maps(model, data.train_x, q, 0)
    assert set(maps) == set(quantized_layers(model))
    for name, layer in quantized_layers(model).items():
        plain = quantize_weight(layer.weight, layer.weight_scale)
        assert torch.equal(layer.weight_codes, maps[name][plain.long() + 128])
    assert any(not torch.equal(layer.weight_codes, quantized_layers(approx)[n].weight_codes)
               for n, layer in quantized_layers(model).items())
    with torch.no_grad():
        model.conv1.weight.mul_(0.9)   # a weight change requantizes through the map
        out = model.eval()(data.test_x)
    plain = quantize_weight(model.conv1.weight, model.conv1.weight_scale)
    assert torch.equal(model.conv1.weight_codes, maps["conv1"][plain.long() + 128])
    reloaded = copy.deepcopy(approx)
    reloaded.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(data.test_x), out)


@needs_cpp
def test_retraining_fits_the_map_by_default_and_not_when_off():
    data, q, _, _, approx = tiny_lenet(32, multiplier="mul8u_T83")
    on, off = copy.deepcopy(approx), copy.deepcopy(approx)
    cpu = torch.device("cpu")
    train_epochs(on, data, FinetuneConfig(epochs=1, batch_size=16), q, cpu, 0, "on")
    train_epochs(off, data, FinetuneConfig(epochs=1, batch_size=16, code_map=False), q, cpu, 0, "off")
    assert FinetuneConfig().code_map is True
    assert not torch.equal(on.conv2.weight_code_map, identity_code_map())
    assert torch.equal(off.conv2.weight_code_map, identity_code_map())
    for model in (on, off):
        layer = model.conv2
        assert torch.equal(layer.weight_codes,
                           layer.weight_code_map[quantize_weight(layer.weight, layer.weight_scale).long() + 128])
    with pytest.raises(UserError, match="code_map"):
        FinetuneConfig(code_map="yes")


@pytest.mark.cuda
def test_graph_step_keeps_the_map_as_the_eager_step_does():
    """The map is applied in the captured step's requantization: graph and eager retraining through
    mul8u_T83 with the map end with the same weights and codes, bit for bit."""
    from tests.test_train_step import _assert_same, _cuda_ready, _state, _train

    if not _cuda_ready():
        pytest.skip("needs a GPU and the CUDA kernels")
    data, q, _, _, approx = tiny_lenet(72, backend="cuda", multiplier="mul8u_T83")
    fcfg = FinetuneConfig(epochs=2, lr=0.01, batch_size=16, warmup_epochs=0.5)
    graph_model, _ = _train(approx, data, q, fcfg, graph=True)
    eager_model, _ = _train(approx, data, q, fcfg, graph=False)
    assert not torch.equal(graph_model.conv2.weight_code_map.cpu(), identity_code_map())
    _assert_same(_state(graph_model), _state(eager_model))
