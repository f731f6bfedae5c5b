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



class _TinyAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x)
        return self.head((h + self.attn(h, h, h, need_weights=False)[0]).mean(1))


@pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension")
def test_a_raw_multihead_attention_is_timed_in_its_explicit_form():
    """nn.MultiheadAttention (torchvision's ViT) reads out_proj's weight itself: bench makes the attention
    explicit first, as approximate does, instead of stopping at calibration; the caller's model is untouched."""
    torch.manual_seed(0)
    model, x = _TinyAttention().eval(), torch.rand(8, 5, 4)
    df = bench_model_layers(model, resolve("exact"), QuantConfig(calib_batches=1, calib_batch_size=8), x, x,
                            ["cpp"], batches=(2,), repeats=1, warmup=0)
    assert list(df.layer) == ["embed", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "head"]
    assert (df.macs == [2 * 5 * 4 * 8] + [2 * 5 * 8 * 8] * 4 + [2 * 8 * 3]).all()
    assert isinstance(model.attn, torch.nn.MultiheadAttention)


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
