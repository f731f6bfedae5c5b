"""`approx-run bench` end to end with tiny settings: every table is written, with sane numbers."""
import json

import pandas as pd

from tests.conftest import has_cpp, run_cli


def test_bench_command_writes_tables(tmp_path):
    backends = "[python,cpp]" if has_cpp() else "[python]"
    out = run_cli("bench", "--algos", f"bench.backends={backends}", "bench.batches=[1,8]", "bench.repeats=1",
                  "bench.warmup=0", "bench.model_images=50", "bench.model_batch_size=25", "train.epochs=1",
                  "bench.train_batch_size=1000", "bench.matmuls=true", "bench.matmul_batches=[1]",
                  f"paths.results={tmp_path}/r", f"paths.checkpoints={tmp_path}/c")
    assert out.returncode == 0, out.stderr
    run_dir = next((tmp_path / "r" / "bench").iterdir())
    ops, model = pd.read_csv(run_dir / "ops.csv"), pd.read_csv(run_dir / "model.csv")
    assert set(ops.layer) == {"conv1", "conv2", "fc1", "fc2", "fc3"} and (ops.gmacs > 0).all()
    assert {"pytorch", "fakequant", "approx"} <= set(model.path) and (model.median_ms > 0).all()
    assert (model.images == 50).all() and (model.threads >= 1).all()
    if has_cpp():
        algos = pd.read_csv(run_dir / "algos.csv")
        assert set(algos.algo) >= {"auto", "direct", "expanded"} and algos.supported.all()
    train = pd.read_csv(run_dir / "train.csv")
    assert {"pytorch", "fakequant", "approx"} <= set(train.path) and (train.step_ms_median > 0).all()
    assert (train.epoch_s_median > 0).all() and (train.images == 4000).all()
    if has_cpp():
        assert set(train.loc[train.backend == "cpp", "grad"]) == {"ste", "lut"}
    mm = pd.read_csv(run_dir / "matmuls.csv")
    assert (mm.tmacs > 0).all() and (mm.macs == mm.B * mm.M * mm.N * mm.K).all()
    assert set(zip(mm.model, mm.op)) >= {("vit_small", "qk"), ("vit_small", "av")}
    if has_cpp():  # the ViT-B/16 shapes are past python_max_macs
        assert set(mm.loc[mm.backend == "cpp", "model"]) == {"vit_b16", "vit_small"}
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["threads"] >= 1 and "git_sha" in meta


def test_bench_matmul_shapes_and_config_checks():
    """Attention's matmuls as lut_bmm sees them (ViT-B/16: 12 heads, 197 tokens, head dim 64), and a bad
    bench.matmul_batches is a user error."""
    import pytest
    from omegaconf import OmegaConf

    from runner.bench import ATTENTION_SHAPES, attention_matmul_shapes, check_bench_config
    from runner.errors import UserError

    assert attention_matmul_shapes(64, *ATTENTION_SHAPES["vit_b16"]) == {"qk": (768, 197, 197, 64),
                                                                          "av": (768, 197, 64, 197)}
    base = OmegaConf.load("configs/bench.yaml").bench
    for bad in ([], [0]):
        b = OmegaConf.merge(base, {"matmuls": True, "matmul_batches": bad})
        with pytest.raises(UserError, match="matmul_batches"):
            check_bench_config(b)


def test_bench_rejects_unknown_backend(tmp_path):
    out = run_cli("bench", "bench.backends=[fpga]", f"paths.results={tmp_path}/r")
    assert out.returncode == 2 and "fpga" in out.stderr and "Traceback" not in out.stderr


def test_bench_algos_reports_the_kernels_workspace_and_auto_pick():
    """bench --algos shows, per layer and batch size, what the kernels report (approx::lut_algos): no
    table for direct, a positive one for expanded, and the variant auto ran at that batch size (that
    it is what ran: tests/ops/test_auto.py; that the reported bytes are what the CUDA kernels
    allocate: tests/ops/test_cuda.py)."""
    from runner.bench import bench_algos
    if not has_cpp():
        return
    df = bench_algos(["cpp"], batches=(1, 300), repeats=1, warmup=0)
    assert set(df.batch) == {1, 300} and len(df) == 5 * 2 * 3
    assert (df.loc[df.algo == "direct", "workspace_mib"] == 0).all()
    assert (df.loc[df.algo == "expanded", "workspace_mib"] > 0).all()
    auto = df[df.algo == "auto"]
    assert set(auto.auto_pick) <= {"direct", "expanded"} and (auto.auto_pick != "").all()
