"""runner.graphs.GraphedForward and the timed passes of run_timed: graph replays give the eager logits, a model that
cannot be captured runs eagerly with the reason kept, and the predictions never come from a replay."""
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from runner.errors import UserError
from runner.evaluate import check_eval_config, run_timed
from runner.graphs import GraphedForward
from tests.conftest import tiny_lenet


def _cuda_lenet():
    from runner._ext import backend_status

    if not torch.cuda.is_available() or backend_status().get("cuda") != "available":
        pytest.skip("no CUDA device / CUDA kernels")
    data, _, _, _, approx = tiny_lenet(300, backend="cuda", multiplier="mul8s_1L2J")
    return data.train_x, approx.cuda().eval()


class _HostSync(nn.Module):
    """A forward that reads a value back to the host: not capturable."""

    def forward(self, x):
        return x * float(x.abs().max())


def test_cpu_inputs_run_eagerly_and_the_setting_is_checked():
    model = nn.Linear(4, 3)
    x = torch.rand(5, 4)
    graphed = GraphedForward(model)
    assert torch.equal(graphed(x), model(x)) and not graphed.graphs
    timed = run_timed(model, x, 2, torch.device("cpu"), warmup=1, repeats=1)
    assert timed.timed_as == "eager"
    check_eval_config(OmegaConf.create({"batch_size": 1, "warmup": 0, "repeats": 0, "cuda_graph": False}))
    with pytest.raises(UserError, match="eval.cuda_graph='yes'"):
        check_eval_config(OmegaConf.create({"batch_size": 1, "warmup": 0, "repeats": 0, "cuda_graph": "yes"}))


@pytest.mark.cuda
def test_replays_equal_the_eager_forward_for_full_and_last_batches():
    x, approx = _cuda_lenet()
    graphed = GraphedForward(approx)
    with torch.no_grad():
        for batch in (x[:128].cuda(), x[128:256].cuda(), x[256:].cuda(), x[:128].cuda()):
            want = approx(batch)
            got = graphed(batch)
            assert torch.equal(got, want)
    assert len(graphed.graphs) == 2 and not graphed.failure  # batches of 128 and of 44


@pytest.mark.cuda
def test_run_timed_replays_graphs_and_keeps_the_eager_predictions():
    x, approx = _cuda_lenet()
    dev = torch.device("cuda")
    eager = run_timed(approx, x, 128, dev, warmup=1, repeats=2, cuda_graph=False)
    graphed = run_timed(approx, x, 128, dev, warmup=1, repeats=2, cuda_graph=True)
    assert (eager.timed_as, graphed.timed_as) == ("eager", "cuda_graph")
    assert torch.equal(eager.logits, graphed.logits) and len(graphed.batch_ms) == 2 * 3


@pytest.mark.cuda
def test_a_forward_that_syncs_with_the_host_runs_eagerly():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = _HostSync().cuda()
    x = torch.rand(8, 3, device="cuda")
    graphed = GraphedForward(model)
    assert torch.equal(graphed(x), model(x))
    assert graphed.failure and not graphed.graphs
    timed = run_timed(model, x.cpu(), 4, torch.device("cuda"), warmup=0, repeats=1)
    assert timed.timed_as == "eager"
