"""`approx-run bench` end to end with tiny settings: every table is written, with sane numbers."""
import json

import pandas as pd

from tests.conftest import has_cpp, run_cli


def test_bench_command_writes_tables(tmp_path):
    backends = "[python,cpp]" if has_cpp() else "[python]"
    out = run_cli("bench", "--algos", f"bench.backends={backends}", "bench.batches=[1,8]", "bench.repeats=1",
                  "bench.warmup=0", "bench.model_images=50", "bench.model_batch_size=25", "train.epochs=1",
                  "bench.train_batch_size=1000",
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
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["threads"] >= 1 and "git_sha" in meta


def test_bench_rejects_unknown_backend(tmp_path):
    out = run_cli("bench", "bench.backends=[fpga]", f"paths.results={tmp_path}/r")
    assert out.returncode == 2 and "fpga" in out.stderr and "Traceback" not in out.stderr


def test_cuda_workspace_is_prep_plus_expanded_table():
    from runner.bench import cuda_workspace_bytes
    prep = 256 + 256 * 256 * 6
    assert cuda_workspace_bytes("linear", (120, 256), "direct") == -(-prep // 256) * 256
    # fc1: 256 taps x 256 codes x 120 channels (already a multiple of 8) x 4 bytes
    assert cuda_workspace_bytes("linear", (120, 256), "expanded_rows") == -(-prep // 256) * 256 + 256 * 256 * 120 * 4
    # conv1: 25 taps padded to 32, 6 channels padded to 8, plus the tap table
    conv_prep = -(-(prep + 32 * 16) // 256) * 256
    assert cuda_workspace_bytes("conv", (6, 1, 5, 5), "expanded_window") == conv_prep + 32 * 256 * 8 * 4
    # fc3: 10 channels = one whole group + a compact tail of one 2-channel word, and the 5
    # channel pairs of expanded_pairs
    assert cuda_workspace_bytes("linear", (10, 84), "expanded_cluster") == (
        -(-prep // 256) * 256 + 88 * 256 * 16 * 4 + 88 * 256 * 1 * 4 + 88 * 256 * 5 * 4)
    assert cuda_workspace_bytes("linear", (16, 84), "expanded_pairs") == (
        -(-prep // 256) * 256 + 88 * 256 * 16 * 4 + 88 * 256 * 8 * 4)
