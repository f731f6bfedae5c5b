"""runner.train_step: the training step replayed as a CUDA graph does what the eager step does, bit for bit,
with new data every replay, a partial last batch, the learning-rate schedule and the weight requantization;
a step that cannot be captured runs eagerly with the reason; on the CPU nothing changes."""
import copy

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from runner.errors import UserError
from runner.finetune import FinetuneConfig, cuda_graph_setting, train_epochs
from runner.train_step import TrainStep
from tests.conftest import has_cpp, tiny_lenet


def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from runner._ext import backend_status

    return backend_status()["cuda"] == "available"


def _tiny(n=72, backend="cpp", multiplier="exact"):
    """72 random images: at batch 16, four full batches and a partial one of 8 per epoch."""
    return tiny_lenet(n, backend, multiplier)


def _state(model):
    """Everything a step changes: parameters and the buffers that follow them (codes, scales)."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0
        assert torch.equal(a[k], b[k]), f"{k}: max |graph - eager| = {diff}"


def test_cuda_graph_setting_is_checked():
    assert cuda_graph_setting(OmegaConf.create({"finetune": {"epochs": 1}})) is True
    assert cuda_graph_setting(OmegaConf.create({"finetune": {"cuda_graph": False}})) is False
    with pytest.raises(UserError, match="finetune.cuda_graph"):
        cuda_graph_setting(OmegaConf.create({"finetune": {"cuda_graph": "maybe"}}))
    # a run setting, not a training setting: accepted, and not part of what names the checkpoint
    fcfg = FinetuneConfig.from_cfg(OmegaConf.create({"epochs": 1, "cuda_graph": False}))
    assert "cuda_graph" not in fcfg.as_dict()
    with pytest.raises(UserError, match="finetune.cuda_graph"):   # checked wherever the settings are read
        FinetuneConfig.from_cfg(OmegaConf.create({"epochs": 1, "cuda_graph": 1}))


@pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension")
def test_cpu_step_is_eager_and_ignores_the_switch():
    data, q, _, _, approx = _tiny()
    model = approx.train()

    def loss_of(x, y):
        logits = model(x)
        return F.cross_entropy(logits, y), logits, y

    step = TrainStep(model, loss_of, "sgd", 0.01, 0.0, torch.device("cpu"), cuda_graph=True)
    for _ in range(5):
        step(data.train_x[:16], data.train_y[:16])
    assert step.mode == "eager" and step.graph is None and step.replays == 0 and step.eager_steps == 5
    assert "CUDA" in step.reason


# ------------------------------------------------------------------------------------------------- GPU
def _train(approx, data, q, fcfg, graph, teacher=None):
    model = copy.deepcopy(approx)
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, benchmark=False):
        history = train_epochs(model, data, fcfg, q, torch.device("cuda"), 0, "t", teacher=teacher, cuda_graph=graph)
    return model, history


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer,grad,learn_scales,schedule", [
    ("sgd", "ste", False, "constant"),   # the plain case: the exact table, SGD, fixed scales
    ("sgd", "ste", True, "cosine"),      # learned activation scales, the lr changing every step
    ("adam", "lut", True, "cosine"),     # the fused Adam's device step counter, the LUT-slope backward
])
def test_graph_step_equals_eager_step(optimizer, grad, learn_scales, schedule):
    """Two epochs of 4 full batches and one partial: step 4 on is captured and replayed with new indices, the
    partial batch runs eagerly in between; every weight, code, scale and the logged loss equal an eager run's.
    The same kernels in the same order on the same data: no tolerance (cuDNN held to its deterministic
    algorithms for both)."""
    if not _cuda_ready():
        pytest.skip("needs a GPU and the CUDA kernels")
    data, q, _, _, approx = _tiny(backend="cuda")
    fcfg = FinetuneConfig(epochs=2, lr=0.01, optimizer=optimizer, grad=grad, batch_size=16, schedule=schedule,
                          warmup_epochs=0.5 if schedule == "cosine" else 0.0, learn_scales=learn_scales)
    graph_model, graph_hist = _train(approx, data, q, fcfg, graph=True)
    eager_model, eager_hist = _train(approx, data, q, fcfg, graph=False)
    moved = (graph_model.conv1.weight.detach().cpu() - approx.conv1.weight.detach()).abs().max()
    assert moved > 0
    _assert_same(_state(graph_model), _state(eager_model))
    assert [h["train_loss"] for h in graph_hist] == [h["train_loss"] for h in eager_hist]
    assert [h["lr_end"] for h in graph_hist] == [h["lr_end"] for h in eager_hist]


def _step_for(model, data, optimizer="sgd", graph=True):
    def loss_of(idx):
        xb, yb = xs[idx], ys[idx]
        logits = model(xb)
        return F.cross_entropy(logits, yb), logits, yb

    xs, ys = data.train_x.cuda(), data.train_y.cuda()
    model.cuda().train()
    return TrainStep(model, loss_of, optimizer, 0.01, 0.0, torch.device("cuda"), cuda_graph=graph)


@pytest.mark.cuda
def test_replays_train_on_new_data_and_requantize():
    """Each replay reads the indices copied in for it (not those of the capture) and leaves the weight codes
    those of its updated weights: the same as the layer computes them from scratch."""
    if not _cuda_ready():
        pytest.skip("needs a GPU and the CUDA kernels")
    from runner.quant import quantize_weight, weight_scale

    data, _, _, _, approx = _tiny(backend="cuda")
    runs = {}
    for graph in (True, False):
        model = copy.deepcopy(approx)
        step = _step_for(model, data, graph=graph)
        losses = []
        with torch.backends.cudnn.flags(enabled=True, deterministic=True, benchmark=False):
            for i in range(8):
                start = (i * 16) % 64
                idx = torch.arange(start, start + 16, device="cuda")
                losses.append(float(step(idx)))
        runs[graph] = (model, step, losses)
    model, step, losses = runs[True]
    assert step.mode == "graph" and step.replays == 5 and step.eager_steps == 3
    assert losses == runs[False][2]
    assert len(set(losses[3:7])) == 4            # four replays on four different batches
    for name in ("conv1", "fc1"):
        layer = getattr(model, name)
        scale = weight_scale(layer.weight, layer.granularity)
        assert torch.equal(layer.weight_scale, scale), name
        assert torch.equal(layer.weight_codes, quantize_weight(layer.weight, scale)), name


@pytest.mark.cuda
def test_partial_batch_runs_eagerly_between_replays():
    if not _cuda_ready():
        pytest.skip("needs a GPU and the CUDA kernels")
    data, _, _, _, approx = _tiny(backend="cuda")
    states = {}
    for graph in (True, False):
        model = copy.deepcopy(approx)
        step = _step_for(model, data, graph=graph)
        with torch.backends.cudnn.flags(enabled=True, deterministic=True, benchmark=False):
            for i, size in enumerate((16, 16, 16, 16, 8, 16, 16, 8, 16)):
                step(torch.randperm(72, generator=torch.Generator().manual_seed(i))[:size].cuda())
        if graph:
            assert step.replays == 4 and step.eager_steps == 5   # 3 warm-up, 2 partial
        step.close()
        states[graph] = _state(model)
    _assert_same(states[True], states[False])


@pytest.mark.cuda
def test_a_step_that_cannot_be_captured_runs_eagerly_with_the_reason():
    """An op that reads a device value on the host cannot be in a graph: the capture fails, the step says
    why and runs eagerly, and the failed capture left no trace (the weights equal an eager run's)."""
    if not _cuda_ready():
        pytest.skip("needs a GPU and the CUDA kernels")

    class HostRead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x) * float(x.abs().max())  # .item(): a host wait

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=gen).cuda(), torch.randint(0, 4, (16,), generator=gen).cuda()
    weights = {}
    for graph in (True, False):
        torch.manual_seed(0)
        model = HostRead().cuda()

        def loss_of(xb, yb):
            logits = model(xb)
            return F.cross_entropy(logits, yb), logits, yb

        step = TrainStep(model, loss_of, "adam", 0.01, 0.0, torch.device("cuda"), cuda_graph=graph)
        for _ in range(6):
            step(x, y)
        weights[graph] = model.fc.weight.detach().cpu()
        if graph:
            assert step.mode == "eager" and "could not be captured" in step.reason and step.replays == 0
    assert torch.equal(weights[True], weights[False])


@pytest.mark.cuda
def test_non_finite_input_in_a_replay_names_the_layer():
    if not _cuda_ready():
        pytest.skip("needs a GPU and the CUDA kernels")
    from runner.train_step import read_input_flags

    data, _, _, _, approx = _tiny(backend="cuda")
    data.train_x[64:] = float("nan")
    model = copy.deepcopy(approx)
    step = _step_for(model, data)
    for i in range(4):
        step(torch.arange(i * 16, i * 16 + 16, device="cuda"))
    assert step.replays == 1
    read_input_flags(model)                                  # finite so far
    step(torch.arange(56, 72, device="cuda"))               # a replay on a batch holding NaN images
    with pytest.raises(UserError, match="layer conv1: the input holds non-finite"):
        read_input_flags(model)
