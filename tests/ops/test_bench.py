"""bench_ops returns a well-formed table (tiny settings; the real figures are in benchmarks/)."""
from runner.bench import bench_ops

from .conftest import BACKENDS


def test_bench_ops_table():
    backends = ["python"] + [b for b, _ in BACKENDS if b == "cpp"]
    df = bench_ops(backends, batches=(1, 2), repeats=2, warmup=1, distributions=("relu",))
    assert set(df.layer) == {"conv1", "conv2", "fc1", "fc2", "fc3"}
    assert set(df.backend) == set(backends)
    assert (df.min_us <= df.median_us).all() and (df.gmacs > 0).all()
    assert {"first_us", "mean_us", "threads", "algo", "macs"} <= set(df.columns)
    conv2 = df[(df.layer == "conv2") & (df.batch == 2)]
    assert (conv2.macs == 2 * 16 * 8 * 8 * 150).all()
