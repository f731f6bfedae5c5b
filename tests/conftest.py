import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers share the cores: OpenMP threads that busy-wait for a core held by another worker
    # more than doubled the CPU time of the suite on 2 cores. One thread a worker, in the processes the
    # tests start too.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _sigint_is_delivered():
    """Tests interrupt themselves and the processes they start with SIGINT. A shell without job control that
    starts pytest in the background makes it ignore SIGINT, which its children inherit; Python's own handler
    restored here is reset to the default in every child, so those tests test what a user's Ctrl-C does."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def compose(command: str, overrides=(), tmp_path: Path | None = None):
    """The config `approx-run <command> <overrides>` would run with; outputs redirected to tmp_path."""
    from runner.config import compose as compose_config

    extra = []
    if tmp_path is not None:
        extra = [f"paths.results={tmp_path / 'results'}", f"paths.checkpoints={tmp_path / 'checkpoints'}"]
    return compose_config(command, [*overrides, *extra])


def run_cli(*args, cwd=None, env=None, timeout=600):
    """The console script end to end, in a subprocess (as a user runs it)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "runner.cli", *args], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def mnist5k():
    from runner.data import load_mnist5k

    return load_mnist5k(seed=0)


@pytest.fixture(scope="session")
def trained_lenet(mnist5k, tmp_path_factory):
    """A LeNet-5 trained briefly on mnist5k (a few seconds): enough to be far above chance."""
    from runner.train import train_model

    cfg = compose("train", ["train.epochs=4"], tmp_path_factory.mktemp("trained"))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, history = train_model(cfg, mnist5k, torch.device("cpu"))
    return model, history


def has_cpp() -> bool:
    from runner._ext import backend_status

    return backend_status()["cpp"] == "available"


def tiny_lenet(n: int, backend: str = "cpp", multiplier: str = "exact"):
    """A LeNet-5 (seed 0) on n random images: (data, quant config, the fp32 teacher, fake-quant, approx), for
    tests of retraining that need a model but no real data."""
    import torch

    from runner.data import Dataset
    from runner.layers import quantized_models
    from runner.models import LeNet5
    from runner.multipliers import resolve
    from runner.quant import QuantConfig

    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    data = Dataset("tiny", x, y, x[:8], y[:8], 0.1307, 0.3081, "random")
    q = QuantConfig(calib_batches=1, calib_batch_size=n)
    torch.manual_seed(0)
    teacher = LeNet5(mean=0.1307, std=0.3081)
    fq, approx, _ = quantized_models(teacher, resolve(multiplier), q, x, backend=backend)
    return data, q, teacher, fq, approx


@pytest.fixture(scope="session")
def baseline_checkpoints(tmp_path_factory):
    """A checkpoint directory holding the mnist5k LeNet-5 baseline of `train.epochs=1` (trained in-process
    once per session), for tests whose commands would otherwise each train it."""
    from runner.train import load_or_train

    root = tmp_path_factory.mktemp("baseline_ckpt")
    load_or_train(compose("train", ["train.epochs=1", f"paths.checkpoints={root}", f"paths.results={root / 'r'}"]))
    return root


def _outputs_in_the_clone() -> set[str]:
    """What lies in the clone's results/ and checkpoints/ (two levels: results.csv, results/<command>/<run>)."""
    found = set()
    for d in ("results", "checkpoints"):
        for pattern in ("*", "*/*"):
            found |= {str(p.relative_to(REPO)) for p in (REPO / d).glob(pattern) if p.name != ".gitkeep"}
    return found


@pytest.fixture(autouse=True)
def _outputs_stay_out_of_the_clone():
    """A test writes under tmp_path, never into the clone's results/ or checkpoints/ (git would not show it:
    they are ignored): a command run without paths.results / paths.checkpoints, or with a relative one
    outside a chdir to tmp_path, fails the test that ran it."""
    before = _outputs_in_the_clone()
    yield
    new = sorted(_outputs_in_the_clone() - before)
    assert not new, f"the test wrote {new} into the clone; give it paths.results= and paths.checkpoints= under tmp_path"


@contextlib.contextmanager
def recording(owner, name: str, keep):
    """owner.<name> wrapped while the block runs: the list it yields gets keep(args, kwargs, result) of each call,
    where that is not None (which calls a forward made, and with what)."""
    seen, real = [], getattr(owner, name)

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        item = keep(args, kwargs, out)
        if item is not None:
            seen.append(item)
        return out
    setattr(owner, name, wrapper)
    try:
        yield seen
    finally:
        setattr(owner, name, real)
