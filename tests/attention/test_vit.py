"""The zoo's ViT and every command with it, on a tiny written MNIST set (seconds): the attention products are
layers the commands take like any other."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from runner import session
from runner.attention import Attention, MatMul
from runner.energy import layer_macs
from runner.layers import approximate, quantized_layers
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


def test_fp32_vit_trains_as_plain_modules():
    """No weight-read routing (a TorchFunctionMode entered around every forward) on the zoo's ViT: its attention
    is explicit from the start, so fp32 training pays for nothing but its own operations."""
    model = build_model(compose("train", ["model=vit"]).model, 0.1, 0.3)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_python_and_cpp_give_the_same_logits_with_the_products_on_a_table():
    if not _has_cpp_lut_bmm():
        pytest.skip("the C++ extension here predates approx::lut_bmm")
    torch.manual_seed(0)
    model = build_model(compose("train", [*TINY[:4]]).model, 0.1, 0.3).eval()
    x = torch.rand(16, 1, 28, 28)
    logits = {}
    for backend in ("python", "cpp"):
        _, approx = approximate(model, "mul8s_1L2N", x, backend=backend, matmuls=True)
        assert "layers.1.self_attention.av" in quantized_layers(approx)
        with torch.no_grad():
            logits[backend] = approx(x)
    assert torch.equal(logits["python"], logits["cpp"])


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
    assert approx["agreement_fakequant"] == 1.0 and approx["status"] == "ok" and approx["n_images"] == 20
    if not _has_cpp_lut_bmm():
        pytest.skip("the C++ extension here predates approx::lut_bmm: python == cpp not checked")
    rows = _main([*args, "backend=cpp"], tmp_path)
    py, cpp = (rows[(rows["path"] == "approx") & (rows["backend"] == b)].iloc[-1] for b in ("python", "cpp"))
    for column in ("n_images", "correct", "accuracy", "agreement_fakequant", "agreement_pytorch"):
        assert cpp[column] == py[column], column


@pytest.mark.slow  # four commands, about a minute on two free cores
def test_sweep_search_sensitivity_and_finetune_take_the_products(tiny_mnist, tmp_path):
    common = [*TINY, f"data.root={tiny_mnist}", "model.approx_matmuls=true", "backend=python"]
    rows = _main(["sweep", *common, "sweep.multipliers=[mul8s_1L2J,mul8s_1L2N]"], tmp_path)
    approx = rows[rows["path"] == "approx"]
    assert set(approx["multiplier"]) == {"mul8s_1L2J", "mul8s_1L2N"} and (approx["status"] == "ok").all()
    assert approx["multiplier_per_layer"].str.contains("layers.1.self_attention.av=").all()
    products = "[layers.0.self_attention.qk,layers.0.self_attention.av]"
    rows = _main(["sensitivity", *common, "sensitivity.multipliers=[mul8s_1L2N]", f"sensitivity.layers={products}",
                  "sensitivity.plot=false"], tmp_path)
    assert {"layers.0.self_attention.qk=mul8s_1L2N", "layers.0.self_attention.av=mul8s_1L2N"} <= \
        set(rows["multiplier_per_layer"].dropna())
    searched = ["layers.0.self_attention.qk", "layers.0.self_attention.av", "layers.0.mlp.0"]
    rows = _main(["search", *common, "search.multipliers=[mul8s_1L2N,mul8s_1KV8]",
                  f"search.layers=[{','.join(searched)}]",
                  "search.max_evals=4", "search.plot=false"], tmp_path)
    assert (rows["status"] == "ok").all()
    # the chosen assignment's test row: the searched layers (the products among them) on the candidates, the
    # others exact
    chosen = dict(p.split("=") for p in rows.iloc[-1]["multiplier_per_layer"].split(";"))
    assert {chosen[n] for n in searched} <= {"mul8s_1L2N", "mul8s_1KV8"}
    assert {m for n, m in chosen.items() if n not in searched} == {"exact_s"}
    rows = _main(["finetune", *common, "multiplier=mul8s_1L2N", "finetune.epochs=1", "finetune.grad=lut"], tmp_path)
    assert "approx_finetuned" in set(rows["path"])
