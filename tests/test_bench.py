"""`approx-run bench` end to end with tiny settings: every table is written, with sane numbers."""
import json

import pandas as pd
import torch

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
    assert set(mm.codes) == {"uniform", "attention"}
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


def test_bench_matmuls_times_uniform_and_attention_codes(monkeypatch):
    """bench_matmuls' table has a `codes` row of each distribution per (backend, model, op, batch), and the codes
    it times under "attention" are concentrated like attention's (Q, K std ~32 codes; P mostly small
    probabilities) where the "uniform" ones span the whole range; the same seeded codes on every call."""
    from runner import bench, ops

    seen = []  # (a, b) of each timed case, in row order

    def fake_lut_bmm(a, b, lut, *, backend):
        if not seen or seen[-1][0] is not a:
            seen.append((a, b))
        return torch.zeros(a.shape[0], a.shape[1], b.shape[1], dtype=torch.int32)

    monkeypatch.setattr(ops, "lut_bmm", fake_lut_bmm)
    df = bench.bench_matmuls(["python"], batches=(1,), repeats=1, warmup=0, python_max_macs=10**9)
    assert list(df.codes) == ["uniform", "attention"] * (len(df) // 2) and len(seen) == len(df) == 8
    assert set(zip(df.model, df.op, df.codes)) == {(m, o, c) for m in bench.ATTENTION_SHAPES for o in ("qk", "av")
                                                   for c in ("uniform", "attention")}
    assert "codes" in bench._SHOWN["matmuls"]
    for (_, row), (a, b) in zip(df.iterrows(), seen):
        assert a.dtype == b.dtype == torch.int8 and (tuple(a.shape), tuple(b.shape)) == ((row.B, row.M, row.K),
                                                                                        (row.B, row.N, row.K))
        a, b = a.float(), b.float()
        assert 60 < b.std() < 85 if row.codes == "uniform" else 25 < b.std() < 40  # K, V
        if row.op == "qk":
            assert 60 < a.std() < 85 if row.codes == "uniform" else 25 < a.std() < 40
        else:  # P: codes 0..127
            assert a.min() >= 0 and a.max() <= 127
            if row.codes == "uniform":
                assert 55 < a.mean() < 72
            else:
                assert a.max() == 127 and a.mean() < 15 and (a == 0).float().mean() > 0.3
    again = bench.matmul_codes("av", (2, 5, 6, 7), "attention", torch.Generator().manual_seed(0))
    assert all(torch.equal(x, y) for x, y in
               zip(again, bench.matmul_codes("av", (2, 5, 6, 7), "attention", torch.Generator().manual_seed(0))))


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
    assert set(df.batch) == {1, 300} and len(df) == 5 * 2 * 4
    assert (df.loc[df.algo == "direct", "workspace_mib"] == 0).all()
    assert (df.loc[df.algo.isin(["expanded", "tiled"]), "workspace_mib"] > 0).all()
    auto = df[df.algo == "auto"]
    assert set(auto.auto_pick) <= {"direct", "expanded", "tiled"} and (auto.auto_pick != "").all()
