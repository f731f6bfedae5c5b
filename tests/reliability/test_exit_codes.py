"""Every command's bad input exits 2 with one message and no traceback, before any work; the rest of
the exit codes (1 for failed sweep jobs and file-system errors, 130 for Ctrl-C) are in test_signals."""
import io
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest

from runner.cli import main
from tests.reliability.conftest import assert_clean_exit, run


def _main(argv) -> tuple[int, str]:
    """runner.cli.main in-process (a Hydra task reports its error and calls sys.exit)."""
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue()


# (command line, what the one message must say); {tmp} is a fresh output dir
BAD_INPUT = [
    ("train train.epochs=3O", "train.epochs='3O' is not an integer"),
    ("train train.lr=0", "train.lr=0 must be > 0"),
    ("compare seed=abc", "seed='abc' is not an integer"),
    ("compare eval.limit=-5", "eval.limit=-5 must be >= 1"),
    ("compare eval.batch_size=0", "eval.batch_size=0 must be >= 1"),
    ("compare eval.repeats=-1", "eval.repeats=-1 must be >= 0"),
    ("compare eval.paths=[]", "eval.paths=[] names none of"),
    ("compare backend.algo=nonsense", "not an algorithm of backend=cpp"),
    ("compare multiplier=file multiplier.path={tmp}/none.txt", "none.txt: no such file"),
    ("compare paths.results=/proc/no/such", "paths.results=/proc/no/such cannot be used"),
    ("finetune finetune.epochs=abc", "finetune.epochs='abc' is not an integer"),
    ("finetune finetune.batch_size=0", "finetune.batch_size=0 must be >= 1"),
    ("bench bench.backends=[]", "none of bench.backends=[] can run here"),
    ("bench bench.repeats=0", "bench.repeats=0 must be >= 1"),
    ("bench bench.batches=[0]", "bench.batches[0]=0 must be >= 1"),
    ("bench bench.backends=[tpu]", "unknown backend(s) ['tpu']"),
    ("sweep sweep.multipliers=[]", "sweep.multipliers is empty"),
    ("sweep sweep.multipliers=mul8s_1KV7", "Did you mean"),
    ("sweep sweep.multipliers=[exact] eval.limit=-5", "eval.limit=-5 must be >= 1"),
    ("sweep sweep.multipliers=[exact] paths.results=/proc/no/such", "paths.results=/proc/no/such cannot be used"),
    ("results {tmp}/none.csv", "no results file"),
    ("results --limit 0 {tmp}/none.csv", "--limit: '0' is not a whole number"),
    ("lut show nosuch", "unknown multiplier 'nosuch'"),
    ("lut import {tmp}/none.txt --name x", "none.txt: no such file"),
    ("lut", "required"),
    ("info extra", "unrecognized arguments"),
    ("frobnicate", "unknown command"),
    # a mistyped option or key: one line with the nearest valid names
    ("compare multiplier=mul8s_1L2X", "no multiplier option 'mul8s_1L2X' (multiplier=mul8s_1L2X); did you mean"),
    ("compare finetune.epoch=3", "unknown key 'finetune.epoch'; did you mean finetune.epochs?"),
    ("finetune eval.limt=5", "did you mean eval.limit?"),
    # a key another option of the group has: how to add it, not itself as the nearest name
    ("train model=torchvision model.num_classes=10", "add it with +model.num_classes=VALUE"),
    ("train data=mnsit", "did you mean mnist"),
    ("bench bench.repeat=3", "did you mean bench.repeats?"),
    ("sweep sweep.multipliers=[exact] quant=per_tensor", "did you mean per_tensor_minmax"),
    ("sensitivity sensitivity.multipliers=[exact] sensitivity.layer=[fc1]", "did you mean sensitivity.layers?"),
    ("search search.multipliers=[exact] search.max_los=1", "did you mean search.max_loss"),
    ("results --pivto {tmp}/none.csv", "did you mean --pivot"),
    ("results --scope layr {tmp}/none.csv", "--scope layr: unknown layr"),
    ("lut lst", "invalid choice: 'lst'"),
    # a list where one value goes: Hydra would merge a group's options into one (a sweep of one job)
    ("sweep multiplier=[exact,mul8s_1L2J]", "one job per multiplier: approx-run sweep 'sweep.multipliers=[exact,mul8s_1L2J]'"),
    ("sweep multipliers=[exact,mul8s_1L2J]", "did you mean sweep.multipliers"),
    ("compare multipliers=[exact,mul8s_1L2J]", "approx-run sweep 'sweep.multipliers=[exact,mul8s_1L2J]'"),
    ("compare multiplier=[exact,mul8s_1L2J]", "approx-run sweep 'sweep.multipliers=[exact,mul8s_1L2J]'"),
    ("sensitivity multiplier=[exact,mul8s_1L2J]", "sensitivity.multipliers=[exact,mul8s_1L2J]"),
    ("sweep sweep.multipliers=[exact] model=[lenet5,resnet8]", "the model config group takes one option"),
    ("compare quant=[per_channel_minmax]", "the quant config group takes one option"),
    ("compare backend=[cpp,python]", "the backend config group takes one option"),
    ("train data=[mnist5k,mnist]", "the data config group takes one option"),
    ("sweep sweep.multipliers=[exact] train.lr=[0.1,0.2]", "train.lr takes one value, not a list; one job per value: train.lr=0.1,0.2"),
    ("sweep sweep.multipliers=[exact] train.epochs=[1,2]", "train.epochs takes one value"),
    ("compare device=[cpu,cuda]", "device takes one value"),
    ("compare multiplier=drum multiplier.k=[2,4]", "multiplier.k takes one value"),
    # a case-only typo: the exact match first
    ("compare multiplier=mul8s_1l2j", "did you mean mul8s_1L2J?"),
    ("sweep sweep.multipliers=mul8s_1l2j", "Did you mean: mul8s_1L2J,"),
    # numbers that are not settings
    ("train train.lr=inf", "train.lr=inf is not a finite number"),
    ("train train.lr=-1", "train.lr=-1 must be > 0"),
    ("train train.epochs=-3", "train.epochs=-3 must be >= 1"),
    ("finetune finetune.lr=inf", "finetune.lr=inf is not a finite number"),
    ("search search.multipliers=[exact] search.max_loss=nan", "search.max_loss=nan is not a finite number"),
    # what every job would fail alike: once, before any job
    ("sweep sweep.multipliers=[exact,mul8s_1L2J,mul8u_T83] backend=cpp device=cuda",
     "backend=cpp runs on cpu, but device=cuda"),
    ("sensitivity sensitivity.multipliers=[exact] sensitivity.layers=[fc9]", "are not Conv2d/Linear layers"),
    ("compare data=mnist data.root={tmp}/nonexistent/mnist", "Data set 'mnist' not found"),
    # a model that does not fit the data: its shape, the model's own error, before any training
    ("compare model=custom model._target_=torchvision.models.resnet18 +model.num_classes=10",
     "model=custom (torchvision.models.resnet18) does not fit data=mnist5k (images 1x28x28, 10 classes): its first "
     "batch fails with RuntimeError: Given groups=1, weight of size [64, 3, 7, 7], expected input[2, 1, 28, 28] to "
     "have 3 channels"),
    ("sweep sweep.multipliers=[exact,mul8s_1L2J] model.in_channels=3", "to have 3 channels"),
    ("train model.num_classes=7", "gives outputs of shape [2, 7] for 2 images, not [2, 10]"),
]

# commands that write under paths.results and paths.checkpoints
WRITERS = ("train", "compare", "finetune", "bench", "sweep", "sensitivity", "search")


def _tree(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("line, message", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_exits_2_with_one_message(tmp_path, line, message):
    argv = line.format(tmp=tmp_path).split()
    if argv[0] in WRITERS and not any("paths.results" in a for a in argv):
        argv += [f"paths.results={tmp_path / 'r'}"]
    argv += [f"paths.checkpoints={tmp_path / 'ck'}"] if argv[0] in WRITERS else []
    for d in ("r", "ck"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "earlier.csv").write_text("a\n1\n")  # a user's file: left alone
    before = {d: _tree(tmp_path / d) for d in ("r", "ck")}
    rc, out = _main(argv)
    assert_clean_exit(rc, out, 2)
    assert message in out, out
    # stopped before any work: nothing written at all (no run dir, no lock file, no checkpoint, no row)
    assert {d: _tree(tmp_path / d) for d in ("r", "ck")} == before


@pytest.mark.processes
def test_bench_without_a_usable_requested_backend_exits_2(tmp_path):
    """The case that used to print a skip line and die on an empty table (only cuda asked for, no GPU)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: cuda is usable here")
    for extra in ([], ["bench.ops=false"]):
        rc, out = run("bench", "bench.backends=[cuda]", *extra, f"paths.results={tmp_path / 'r'}")
        assert_clean_exit(rc, out, 2)
        assert "none of bench.backends=['cuda'] can run here (cuda:" in out
        assert not list((tmp_path / "r").rglob("*"))  # Hydra's run dir, made before the error, is gone


@pytest.mark.processes
def test_a_closed_pipe_is_not_a_traceback():
    import subprocess

    cmd = f"{sys.executable} -m runner.cli lut list | head -n 2"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    assert out.returncode in (0, 141)


@pytest.mark.parametrize("command", ["compare", "sweep"])
@pytest.mark.parametrize("blob", ["list", "no meta"])
def test_a_foreign_checkpoint_is_named_not_a_traceback(tmp_path, command, blob):
    """A checkpoint file of the wrong structure at the baseline's name: one message naming it, exit 2, before any
    row (a sweep checks it once, before its jobs, instead of recording a failed row per job)."""
    import torch

    from runner.models import LeNet5
    from runner.train import checkpoint_path
    from tests.conftest import compose

    paths = [f"paths.results={tmp_path / 'r'}", f"paths.checkpoints={tmp_path / 'ck'}"]
    multipliers = ["sweep.multipliers=[exact,mul8s_1L2J]"] if command == "sweep" else []
    ckpt = checkpoint_path(compose(command, paths))
    ckpt.parent.mkdir(parents=True)
    torch.save([1, 2, 3] if blob == "list" else {"state_dict": LeNet5().state_dict()}, ckpt)
    (tmp_path / "r").mkdir()
    rc, out = _main([command, *multipliers, *paths])
    assert_clean_exit(rc, out, 2)
    assert f"Checkpoint {ckpt} is unreadable" in out and "train.force=true" in out, out
    assert not list((tmp_path / "r").iterdir())


def test_a_foreign_retrained_checkpoint_is_named(tmp_path):
    import torch

    from runner import finetune
    from runner.errors import UserError
    from runner.models import LeNet5

    path = tmp_path / "ft.pt"
    for blob in ([1, 2, 3], {"state_dict": LeNet5().state_dict()}, {"meta": {}}):
        torch.save(blob, path)
        with pytest.raises(UserError, match=f"Retrained checkpoint {path} is unreadable"):
            finetune._load(path, LeNet5())
