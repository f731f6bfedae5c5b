"""`approx-run finetune` and retraining in compare/sweep: rows, checkpoints, reuse, bad input, interrupts."""
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from runner.errors import UserError
from runner.finetune import FinetuneConfig
from tests.conftest import REPO, compose, has_cpp, run_cli, tiny_lenet

pytestmark = pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension (backend=cpp)")

FAST = ["eval.limit=200", "eval.repeats=1", "eval.warmup=0", "train.epochs=1", "quant.calib_batches=1",
        "finetune.epochs=1", "finetune.batch_size=256"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One baseline for every test here (trained in-process)."""
    from runner.train import load_or_train

    root = tmp_path_factory.mktemp("finetune_ckpt")
    load_or_train(compose("finetune", [*FAST, f"paths.checkpoints={root}", f"paths.results={root / 'r'}"]))
    return root


def _args(tmp_path, checkpoints, *extra):
    return ["finetune", *FAST, f"paths.results={tmp_path / 'results'}", f"paths.checkpoints={checkpoints}", *extra]


def _finetuned_ckpts(checkpoints: Path):
    return sorted(checkpoints.glob("*_finetuned_*.pt"))


def test_config_validation():
    assert FinetuneConfig().grad == "ste"
    for bad, match in (({"grad": "exact"}, "finetune.grad"), ({"optimizer": "lbfgs"}, "finetune.optimizer"),
                       ({"lr": 0}, "finetune.lr"), ({"batch_size": 0}, "batch_size"),
                       ({"recalibrate": "always"}, "finetune.recalibrate"), ({"epochs": -1}, "finetune.epochs"),
                       ({"distill_alpha": 1.5}, "finetune.distill.alpha"),
                       ({"distill_temperature": 0}, "finetune.distill.temperature"),
                       ({"warmup_epochs": -1}, "finetune.warmup_epochs")):
        with pytest.raises(UserError, match=match):
            FinetuneConfig(**bad)
    with pytest.raises(UserError, match="unknown finetune setting"):
        FinetuneConfig.from_cfg({"epoch": 3})
    with pytest.raises(UserError, match="finetune.distill"):
        FinetuneConfig.from_cfg({"distill": {"alpah": 0.5}})
    nested = FinetuneConfig.from_cfg({"distill": {"alpha": 0.5, "temperature": 2}})
    assert (nested.distill_alpha, nested.distill_temperature) == (0.5, 2) and nested.distills


def test_recipe_comes_from_the_data_config(tmp_path):
    """Epochs, warm-up and batch were chosen per data set on its validation split (docs/finetune.md)."""
    def recipe(*overrides):
        ft = FinetuneConfig.from_cfg(compose("finetune", list(overrides), tmp_path).finetune)
        return ft.epochs, ft.warmup_epochs, ft.batch_size

    assert recipe() == (3, 0.0, 16)
    assert recipe("data=fashion_mnist") == (5, 0.5, 64)
    assert recipe("data=fashion_mnist", "finetune.epochs=2") == (2, 0.5, 64)
    assert compose("compare", ["data=fashion_mnist"], tmp_path).finetune.epochs == 0  # compare retrains only when asked


def test_row_key_includes_the_finetune_settings(tmp_path):
    from runner.compare import plan_run

    keys = [plan_run(compose("compare", ["backend=python", *extra], tmp_path)).row_keys
            for extra in ([], ["finetune.epochs=2"], ["finetune.epochs=2", "finetune.grad=lut"],
                          ["finetune.epochs=3"])]
    assert "approx_finetuned" not in keys[0]                       # compare: off by default
    assert keys[0]["approx"] == keys[1]["approx"] == keys[2]["approx"]
    assert len({k["approx_finetuned"] for k in keys[1:]}) == 3


def test_finetune_end_to_end_and_reuse(tmp_path, checkpoints):
    res = run_cli(*_args(tmp_path, checkpoints, "multiplier=mul8s_1L2N"))
    assert res.returncode == 0, res.stdout + res.stderr
    df = pd.read_csv(tmp_path / "results" / "results.csv")
    assert df["path"].tolist() == ["pytorch", "fakequant", "approx", "approx_finetuned"]
    approx, tuned = df.iloc[2], df.iloc[3]
    assert approx["multiplier"] == tuned["multiplier"] == "mul8s_1L2N"
    assert approx["lut_sha256"] == tuned["lut_sha256"] and tuned["status"] == "ok"
    assert tuned["finetune_grad"] == "ste" and tuned["finetune_epochs"] == 1 and tuned["finetune_epoch_s"] > 0
    assert pd.isna(approx["finetune_epochs"])
    assert tuned["accuracy"] > approx["accuracy"]                  # one epoch already recovers accuracy
    run_dir = Path(tuned["run_dir"])
    log = pd.read_csv(run_dir / "finetune_log.csv")
    assert log.columns.tolist()[:4] == ["epoch", "train_loss", "train_accuracy", "epoch_s"] and len(log) == 1
    ckpts = _finetuned_ckpts(checkpoints)
    assert [Path(tuned["finetune_checkpoint"])] == ckpts
    # the rerun reuses the retrained checkpoint: no training, the same accuracy
    mtime = ckpts[0].stat().st_mtime
    again = run_cli(*_args(tmp_path, checkpoints, "multiplier=mul8s_1L2N"))
    assert again.returncode == 0 and "reusing retrained checkpoint" in again.stdout
    assert ckpts[0].stat().st_mtime == mtime
    df = pd.read_csv(tmp_path / "results" / "results.csv")
    assert df["accuracy"].iloc[-1] == tuned["accuracy"]
    again_dir = Path(df["run_dir"].iloc[-1])                       # its run dir still gets the epoch log
    assert again_dir != run_dir and pd.read_csv(again_dir / "finetune_log.csv").equals(log)


@pytest.mark.parametrize("override,message", [
    ("finetune.epochs=0", "needs at least one epoch"),
    ("finetune.grad=exact", "finetune.grad='exact': choose ste or lut"),
    ("finetune.weight_scale_factor=1.5", "finetune.weight_scale_factor=1.5: must be in (0, 1]"),
    ("backend=cuda", "backend=cuda is not usable here"),
])
def test_bad_input_exits_2(tmp_path, checkpoints, override, message):
    before = _finetuned_ckpts(checkpoints)
    res = run_cli(*_args(tmp_path, checkpoints, override))
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr + res.stdout
    assert _finetuned_ckpts(checkpoints) == before
    assert not (tmp_path / "results" / "results.csv").exists()


def test_interrupted_finetune_leaves_no_checkpoint(tmp_path):
    """Ctrl-C while retraining: exit 130, no retrained checkpoint (not even a temp file); the rerun completes."""
    ckpt = tmp_path / "ckpt"
    args = _args(tmp_path, ckpt, "finetune.epochs=50", "multiplier=mul8s_1L2J")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "runner.cli", *args], cwd=REPO, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    for line in p.stdout:
        if line.startswith("finetune ") or time.time() > deadline:
            break
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 130, out
    assert "Traceback" not in out
    assert not _finetuned_ckpts(ckpt) and not list(ckpt.glob(".*tmp"))
    results = tmp_path / "results" / "results.csv"
    assert not results.exists() or "approx_finetuned" not in pd.read_csv(results)["path"].tolist()
    res = run_cli(*args[:-2], "finetune.epochs=1", "multiplier=mul8s_1L2J")
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(_finetuned_ckpts(ckpt)) == 1


def test_sweep_adds_a_finetuned_row_per_job_and_resumes(tmp_path, checkpoints):
    args = ["sweep", "sweep.multipliers=[mul8s_1L2N,mul8u_T83]", *FAST, f"paths.results={tmp_path / 'results'}",
            f"paths.checkpoints={checkpoints}", "+multiplier.layers={fc1: mul8s_1L2J}"]
    res = run_cli(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    df = pd.read_csv(tmp_path / "results" / "results.csv")
    tuned = df[df["path"] == "approx_finetuned"]
    assert sorted(tuned["multiplier"]) == ["mixed", "mixed"] and tuned["row_key"].is_unique
    assert all("fc1=mul8s_1L2J" in s for s in tuned["multiplier_per_layer"])
    summary = pd.read_csv(sorted((tmp_path / "results" / "sweep").iterdir())[-1] / "summary.csv")
    assert summary["finetuned_accuracy"].notna().all()
    again = run_cli(*args)
    assert again.returncode == 0
    assert len(pd.read_csv(tmp_path / "results" / "results.csv")) == len(df)   # resumed: nothing redone


@pytest.mark.parametrize("mode", ["none", "end"])
def test_train_epochs_recalibrates_at_the_end(mode):
    """`recalibrate=end` belongs to the training loop, so every caller (the command, the tuning benchmark)
    gets the scales of the retrained weights; `none` keeps the calibrated ones."""
    import copy

    import torch

    from runner.data import Dataset
    from runner.finetune import train_epochs
    from runner.finetune import recalibrate
    from runner.layers import quantized_models
    from runner.models import LeNet5
    from runner.multipliers import resolve
    from runner.quant import QuantConfig

    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 1, 28, 28, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    data = Dataset("tiny", x, y, x[:8], y[:8], 0.1307, 0.3081, "random")
    q = QuantConfig(calib_batches=1, calib_batch_size=64)
    torch.manual_seed(0)
    _, approx, _ = quantized_models(LeNet5(mean=0.1307, std=0.3081), resolve("exact"), q, x)
    before = approx.fc2.act_scale.clone()
    fcfg = FinetuneConfig(epochs=1, lr=0.05, batch_size=32, learn_scales=False, recalibrate=mode,
                          act_scale_factor=1.0)
    train_epochs(approx, data, fcfg, q, torch.device("cpu"), 0, "tiny")
    expected = copy.deepcopy(approx)
    recalibrate(expected, x, q)
    assert not torch.equal(expected.fc2.act_scale, before)   # training moved the activations
    assert torch.equal(approx.fc2.act_scale, expected.fc2.act_scale if mode == "end" else before)


def test_lr_schedule_warms_up_then_decays_to_zero():
    from runner.finetune import lr_factor

    cos = [lr_factor(s, 10, 2, "cosine") for s in range(10)]
    assert cos[:2] == [0.5, 1.0] and cos[2] == 1.0
    assert all(a > b for a, b in zip(cos[2:], cos[3:])) and cos[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert [lr_factor(s, 10, 0, "constant") for s in (0, 9)] == [1.0, 1.0]
    assert lr_factor(5, 10, 0, "cosine") == pytest.approx(0.5)


def test_distill_loss_is_ce_plus_scaled_kl():
    """alpha = 0 is plain cross-entropy; otherwise (1 - a) CE + a T^2 KL(teacher_T || student_T), written out."""
    import torch
    import torch.nn.functional as F

    from runner.finetune import distill_loss

    gen = torch.Generator().manual_seed(0)
    s, t, y = torch.randn(8, 10, generator=gen), torch.randn(8, 10, generator=gen), torch.randint(0, 10, (8,))
    T, a = 3.0, 0.7
    teacher_logp = F.log_softmax(t / T, 1)
    assert torch.equal(distill_loss(s, y, teacher_logp, FinetuneConfig()), F.cross_entropy(s, y))
    p = teacher_logp.exp()
    kl = (p * (teacher_logp - F.log_softmax(s / T, 1))).sum(1).mean()
    want = (1 - a) * F.cross_entropy(s, y) + a * T * T * kl
    got = distill_loss(s, y, teacher_logp, FinetuneConfig(distill_alpha=a, distill_temperature=T))
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def _tiny(n=64, backend="cpp"):
    data, q, teacher, _, approx = tiny_lenet(n, backend)
    return data, q, teacher, approx


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_train_epochs_step_is_the_plain_step(alpha):
    """One train_epochs step (the whole set as one batch, constant lr) moves the weights exactly as one step
    written out by hand with the same loss: cross-entropy (alpha 0, so a QAT step for the exact table, see
    test_one_step_moves_weights_like_qat), or with the teacher's softened targets mixed in."""
    import copy

    import torch
    import torch.nn.functional as F

    from runner.finetune import train_epochs

    data, q, teacher, approx = _tiny()
    fcfg = FinetuneConfig(epochs=1, lr=0.01, optimizer="sgd", batch_size=len(data.train_y), schedule="constant",
                          learn_scales=False, distill_alpha=alpha, distill_temperature=3.0, act_scale_factor=1.0,
                          weight_scale_factor=1.0)
    by_hand = copy.deepcopy(approx).train()
    opt = torch.optim.SGD(by_hand.parameters(), lr=0.01, momentum=0.9)
    logits = by_hand(data.train_x)
    loss = F.cross_entropy(logits, data.train_y)
    if alpha:
        with torch.no_grad():
            soft = F.log_softmax(teacher.eval()(data.train_x) / 3.0, 1)
        kl = F.kl_div(F.log_softmax(logits / 3.0, 1), soft, reduction="batchmean", log_target=True)
        loss = (1 - alpha) * loss + alpha * 9.0 * kl
    loss.backward()
    opt.step()
    trained = copy.deepcopy(approx)
    train_epochs(trained, data, fcfg, q, torch.device("cpu"), 0, "tiny", teacher=teacher)
    for (name, want), got in zip(by_hand.named_parameters(), trained.parameters()):
        moved = (want - dict(approx.named_parameters())[name]).abs().max()
        # the same sums but for the order of the images in the batch (train_epochs shuffles): fp32 rounding
        assert moved > 0 and (want - got).abs().max() <= 1e-7, name


@pytest.mark.parametrize("backend", ["cpp", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_non_finite_loss_stops_training_with_a_user_error(backend):
    """The step's loss check (a device flag, read without a host wait per step on a GPU) still stops a run
    whose loss is NaN: here the teacher's targets are NaN."""
    import torch

    from runner.finetune import train_epochs

    data, q, teacher, approx = _tiny(backend=backend)
    device = torch.device("cuda" if backend == "cuda" else "cpu")

    class NaNTeacher(torch.nn.Module):
        def forward(self, x):
            return torch.full((len(x), 10), float("nan"), device=x.device)

    # on a GPU the next layer's input flag may report it first (its message also says the run diverged)
    with pytest.raises(UserError, match="diverged"):
        train_epochs(approx, data, FinetuneConfig(epochs=1, batch_size=16, distill_alpha=0.5), q,
                     device, 0, "tiny", teacher=NaNTeacher())
    with pytest.raises(ValueError, match="teacher"):
        train_epochs(approx, data, FinetuneConfig(epochs=1, distill_alpha=0.5), q, torch.device("cpu"), 0, "tiny")


def _layer_outputs(model, x):
    """{layer: its output on x} for every quantized layer of model (requant=float, as correct_bias measures)."""
    import torch

    from runner.layers import quantized_layers

    outs, hooks = {}, []
    for name, layer in quantized_layers(model).items():
        layer.requant = "float"
        hooks.append(layer.register_forward_hook(lambda m, a, out, name=name: outs.__setitem__(name, out)))
    with torch.no_grad():
        model.eval()(x)
    for h in hooks:
        h.remove()
    return outs


def _channel_means(t):
    import torch

    return t.double().mean(0) if t.dim() == 2 else t.double().mean(dim=(0, 2, 3))


@pytest.mark.parametrize("name", ["mul8u_T83", "mul8s_1L12"])
def test_bias_correction_moves_each_layer_mean_output_to_the_exact_products(name):
    """After correct_bias, each LUT layer's mean output per channel equals, on the same input, that of the
    exact product of the same codes with the original bias (the fake-quant computation), where before it
    was off by the table's systematic error; the biases are the only parameters that move."""
    import copy

    import torch

    from runner.finetune import correct_bias
    from runner.layers import _FakeQuant, quantized_layers, quantized_models
    from runner.models import LeNet5
    from runner.multipliers import resolve
    from runner.quant import QuantConfig

    gen = torch.Generator().manual_seed(0)
    x = torch.rand(96, 1, 28, 28, generator=gen)
    q = QuantConfig(calib_batches=1, calib_batch_size=96)
    torch.manual_seed(0)
    _, approx, _ = quantized_models(LeNet5(mean=0.1307, std=0.3081), resolve(name), q, x, backend="cpp")
    original = copy.deepcopy(approx)
    shifts = correct_bias(approx, x, torch.device("cpu"), batch_size=40)  # 3 batches, one short
    inputs = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0]))
             for n, layer in quantized_layers(approx).items()]
    got = _layer_outputs(approx, x)
    for h in hooks:
        h.remove()
    for n, layer in quantized_layers(original).items():
        layer.requant = "float"
        with torch.no_grad():
            exact = _FakeQuant.forward(layer, inputs[n])
            uncorrected = layer(inputs[n])
        err_before = (_channel_means(uncorrected) - _channel_means(exact)).abs().max()
        err_after = (_channel_means(got[n]) - _channel_means(exact)).abs().max()
        assert err_before > 1e-3 and err_after < 1e-5 * max(1.0, float(exact.abs().max())), n
        assert shifts[n].abs().max() > 1e-3
    for (pname, p), p0 in zip(approx.named_parameters(), original.parameters()):
        assert torch.equal(p, p0) != pname.endswith("bias"), pname
    assert {m.requant for m in quantized_layers(approx).values()} == {"float"}  # _layer_outputs set it


def test_bias_correction_is_zero_for_the_exact_table_and_runs_in_train_epochs():
    """The exact table has no error: no shift. bias_correction=before|after|both reaches correct_bias
    through train_epochs (every retraining caller), and a bad value is a UserError."""
    import copy

    import torch

    import runner.finetune as ft

    data, q, teacher, approx = _tiny()
    shifts = ft.correct_bias(copy.deepcopy(approx), data.train_x, torch.device("cpu"))
    assert all(torch.equal(s, torch.zeros_like(s)) for s in shifts.values())
    calls = []
    real = ft.correct_bias
    try:
        ft.correct_bias = lambda model, x, device: calls.append(len(x)) or real(model, x, device)
        for mode, n in (("none", 0), ("before", 1), ("after", 1), ("both", 2)):
            calls.clear()
            fcfg = FinetuneConfig(epochs=1, batch_size=32, bias_correction=mode)
            ft.train_epochs(copy.deepcopy(approx), data, fcfg, q, torch.device("cpu"), 0, "tiny")
            assert calls == [len(data.train_x)] * n, mode
    finally:
        ft.correct_bias = real
    with pytest.raises(UserError, match="bias_correction"):
        FinetuneConfig(bias_correction="sometimes")


def test_act_scale_factor_scales_the_static_activation_scales_before_training():
    """act_scale_factor multiplies every static activation scale before the first step (epochs=0 shows the
    start), so the codes grow by 1/factor; 1 leaves them alone; outside (0, 1] is a UserError."""
    import copy

    import torch

    from runner.finetune import train_epochs
    from runner.layers import quantized_layers

    data, q, _, approx = _tiny()
    start = {n: m.act_scale.clone() for n, m in quantized_layers(approx).items()}
    for factor in (1.0, 0.25):
        model = copy.deepcopy(approx)
        fcfg = FinetuneConfig(epochs=0, act_scale_factor=factor, learn_scales=False)  # no exp(log) round trip
        train_epochs(model, data, fcfg, q, torch.device("cpu"), 0, "t")
        for n, m in quantized_layers(model).items():
            assert torch.equal(m.act_scale, start[n] * factor), (factor, n)
    for bad in (0, 1.5, -0.5):
        with pytest.raises(UserError, match="act_scale_factor"):
            FinetuneConfig(act_scale_factor=bad)
