"""The zoo's ViT and every command with it, on a tiny written MNIST set (seconds): the attention products are
layers the commands take like any other."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from runner import session
from runner.attention import Attention, MatMul
from runner.energy import layer_macs
from runner.models import build_model
from runner.quant import quant_layers
from tests.conftest import compose

TINY = ["model=vit", "model.dim=16", "model.depth=2", "model.heads=2", "data=mnist", "train.epochs=1",
        "eval.repeats=1", "eval.warmup=0", "eval.batch_size=20", "quant.calib_batches=1"]


@pytest.fixture(scope="module")
def tiny_mnist(tmp_path_factory):
    from tests.data.test_mnist import _write_set

    root = tmp_path_factory.mktemp("mnist")
    _write_set(root, n_train=60, n_test=20, seed=0)
    return root


def test_vit_is_built_explicit_with_its_products_as_layers_when_asked():
    cfg = compose("train", ["model=vit"])
    model = build_model(cfg.model, 0.1, 0.3)
    assert isinstance(model.layers[0].self_attention, Attention)
    names = list(quant_layers(model))
    assert names[:5] == ["patch_embed", "layers.0.self_attention.q_proj", "layers.0.self_attention.k_proj",
                         "layers.0.self_attention.v_proj", "layers.0.self_attention.out_proj"]
    assert len(names) == 26 and not any(isinstance(m, MatMul) and m.approx for m in model.modules())
    with_products = build_model(compose("train", ["model=vit", "model.approx_matmuls=true"]).model, 0.1, 0.3)
    products = [n for n in quant_layers(with_products) if n.endswith((".qk", ".av"))]
    assert products[:2] == ["layers.0.self_attention.qk", "layers.0.self_attention.av"] and len(products) == 8
    # the energy model counts heads * T * T * d multiplies per image for each product
    macs = layer_macs(with_products, (1, 28, 28))
    assert macs["layers.0.self_attention.qk"] == macs["layers.0.self_attention.av"] == 4 * 17 * 17 * 16
    assert macs["layers.0.self_attention.q_proj"] == 17 * 64 * 64
    with torch.no_grad():
        assert model(torch.rand(2, 1, 28, 28)).shape == (2, 10)


def _main(args, tmp_path):
    from runner.cli import main

    session.reset()
    assert main([*args, f"paths.results={tmp_path / 'r'}", f"paths.checkpoints={tmp_path / 'ck'}"]) == 0
    return pd.read_csv(tmp_path / "r" / "results.csv")


def _has_cpp_lut_bmm() -> bool:
    try:
        from runner import ops

        a = torch.zeros(1, 1, 1, dtype=torch.int8)
        ops.lut_bmm(a, a, torch.zeros(256, 256, dtype=torch.int32), backend="cpp")
        return True
    except Exception:  # noqa: BLE001  (an extension built before the kernel)
        return False


def test_compare_with_the_products_agrees_with_fake_quant_on_every_image(tiny_mnist, tmp_path):
    args = ["compare", *TINY, f"data.root={tiny_mnist}", "multiplier=exact", "model.approx_matmuls=true"]
    rows = _main([*args, "backend=python"], tmp_path)
    approx = rows[rows["path"] == "approx"].iloc[-1]
    assert approx["agreement_fakequant"] == 1.0 and approx["status"] == "ok"
    if _has_cpp_lut_bmm():
        rows = _main([*args, "backend=cpp"], tmp_path)
        py, cpp = (rows[(rows["path"] == "approx") & (rows["backend"] == b)].iloc[-1] for b in ("python", "cpp"))
        assert cpp["accuracy"] == py["accuracy"] and cpp["agreement_fakequant"] == 1.0


@pytest.mark.slow  # four commands, about a minute on two free cores
def test_sweep_search_sensitivity_and_finetune_take_the_products(tiny_mnist, tmp_path):
    common = [*TINY, f"data.root={tiny_mnist}", "model.approx_matmuls=true", "backend=python"]
    rows = _main(["sweep", *common, "sweep.multipliers=[exact,mul8s_1L2N]"], tmp_path)
    assert set(rows.loc[rows["path"] == "approx", "multiplier"]) == {"exact_s", "mul8s_1L2N"}
    products = "[layers.0.self_attention.qk,layers.0.self_attention.av]"
    rows = _main(["sensitivity", *common, "sensitivity.multipliers=[mul8s_1L2N]", f"sensitivity.layers={products}",
                  "sensitivity.plot=false"], tmp_path)
    assert {"layers.0.self_attention.qk=mul8s_1L2N", "layers.0.self_attention.av=mul8s_1L2N"} <= \
        set(rows["multiplier_per_layer"].dropna())
    rows = _main(["search", *common, "search.multipliers=[mul8s_1L2N,mul8s_1KV8]", f"search.layers={products}",
                  "search.max_evals=4", "search.plot=false"], tmp_path)
    assert (rows["status"] == "ok").all()
    rows = _main(["finetune", *common, "multiplier=mul8s_1L2N", "finetune.epochs=1", "finetune.grad=lut"], tmp_path)
    assert "approx_finetuned" in set(rows["path"])
