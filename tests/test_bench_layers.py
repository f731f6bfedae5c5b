"""bench per layer of the chosen model: one row per Conv2d/Linear with its geometry and sane timings."""
import pytest
import torch

from runner.bench_layers import bench_model_layers
from runner.models import build_model
from runner.multipliers import resolve
from runner.quant import QuantConfig
from tests.conftest import compose, has_cpp


@pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension")
def test_every_layer_of_mobilenetv2_is_timed():
    torch.manual_seed(0)
    model = build_model(compose("train", ["model=mobilenetv2"]).model).eval()
    x = torch.rand(8, 1, 28, 28)
    df = bench_model_layers(model, resolve("exact"), QuantConfig(calib_batches=1, calib_batch_size=8), x, x,
                            ["cpp"], batches=(2,), repeats=1, warmup=0)
    assert len(df) == 23 and set(df.kind) == {"conv", "depthwise", "linear"}
    assert (df.gmacs > 0).all() and (df.fp32_median_us > 0).all() and (df.batch == 2).all()
    first = df.iloc[0]
    assert first.layer == "stem.0" and first.input_shape == "2x1x30x30"  # the stem's padding moved to PadWith
    assert df.set_index("layer").loc["blocks.1.depthwise.0", "stride"] == 2
    assert (df.device == "cpu").all() and df.auto_pick.isin(["direct", "expanded", "tiled"]).all()
    assert (df.limit_fraction > 0).all() and (df.limit_fraction < 50).all()  # a measured limit, per layer


@pytest.mark.cuda
def test_resnet_layers_are_timed_on_the_gpu():
    """backend cuda: both layers on the GPU, timed with CUDA events; auto's pick reported per layer."""
    from runner._ext import backend_status

    if not torch.cuda.is_available() or backend_status().get("cuda") != "available":
        pytest.skip("no CUDA device / CUDA kernels")
    torch.manual_seed(0)
    model = build_model(compose("train", ["model=resnet8"]).model).eval()
    x = torch.rand(16, 1, 28, 28)
    df = bench_model_layers(model, resolve("exact"), QuantConfig(calib_batches=1, calib_batch_size=16), x, x,
                            ["cpp", "cuda"], batches=(4,), repeats=2, warmup=1)
    gpu = df[df.backend == "cuda"]
    assert len(gpu) == 10 and (gpu.device == "cuda").all() and (gpu.gmacs > 0).all()
    assert (gpu.fp32_median_us > 0).all() and (gpu.auto_pick != "").all()
    assert list(gpu.layer) == list(df[df.backend == "cpp"].layer)
