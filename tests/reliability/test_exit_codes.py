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
    ("train data=mnsit", "did you mean mnist"),
    ("bench bench.repeat=3", "did you mean bench.repeats?"),
    ("sweep sweep.multipliers=[exact] quant=per_tensor", "did you mean per_tensor_minmax"),
    ("sensitivity sensitivity.multipliers=[exact] sensitivity.layer=[fc1]", "did you mean sensitivity.layers?"),
    ("search search.multipliers=[exact] search.max_los=1", "did you mean search.max_loss"),
    ("results --pivto {tmp}/none.csv", "did you mean --pivot"),
    ("results --scope layr {tmp}/none.csv", "--scope layr: unknown layr"),
    ("lut lst", "invalid choice: 'lst'"),
]


@pytest.mark.parametrize("line, message", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_exits_2_with_one_message(tmp_path, line, message):
    argv = line.format(tmp=tmp_path).split()
    if argv[0] in ("train", "compare", "finetune", "bench", "sweep") and not any("paths.results" in a for a in argv):
        argv += [f"paths.results={tmp_path / 'r'}"]
    argv += [f"paths.checkpoints={tmp_path / 'ck'}"] if argv[0] in ("train", "compare", "finetune", "sweep") else []
    rc, out = _main(argv)
    assert_clean_exit(rc, out, 2)
    assert message in out, out
    # stopped before any work: nothing trained, no result row
    assert not list(tmp_path.glob("ck/*.pt"))
    assert not (tmp_path / "r" / "results.csv").exists()


@pytest.mark.processes
def test_bench_without_a_usable_requested_backend_exits_2():
    """The case that used to print a skip line and die on an empty table (only cuda asked for, no GPU)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: cuda is usable here")
    for extra in ([], ["bench.ops=false"]):
        rc, out = run("bench", "bench.backends=[cuda]", *extra)
        assert_clean_exit(rc, out, 2)
        assert "none of bench.backends=['cuda'] can run here (cuda:" in out


@pytest.mark.processes
def test_a_closed_pipe_is_not_a_traceback():
    import subprocess

    cmd = f"{sys.executable} -m runner.cli lut list | head -n 2"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    assert out.returncode in (0, 141)
