"""runner.distributed: retraining over several processes (DDP, gloo on the CPU), a rank that dies, resume."""
import copy
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from runner import distributed
from runner.errors import UserError
from tests.conftest import REPO, compose, has_cpp, tiny_lenet

needs_cpp = pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension (backend=cpp)")

# one epoch of LeNet-5 on mnist5k's 4,000 training images is 63 global batches of 64: long enough (seconds)
# to kill a rank in the middle of the second epoch, short enough for CI
FAST = ["eval.repeats=1", "eval.warmup=0", "train.epochs=1", "quant.calib_batches=1", "finetune.epochs=2",
        "finetune.batch_size=64", "multiplier=mul8s_1L2N"]


# ---------------------------------------------------------------- the helpers, in-process

def test_the_ranks_parts_of_a_global_batch_are_the_global_batch():
    order = torch.randperm(103, generator=torch.Generator().manual_seed(0))
    for world in (1, 2, 3, 4):
        padded = distributed.shard(order, world)
        assert len(padded) % world == 0 and len(padded) - len(order) < world
        assert torch.equal(padded[:len(order)], order)                     # the permutation itself, then padding
        bs = 8 * world
        for i in range(0, len(padded), bs):
            batch = padded[i:i + bs]
            parts = [distributed.my_part(batch, r, world) for r in range(world)]
            assert len({len(p) for p in parts}) == 1                         # every rank the same share
            assert sorted(torch.cat(parts).tolist()) == sorted(batch.tolist())


def test_devices_setting_and_global_batch_are_checked():
    assert distributed.resolve(1, False, "finetune.devices") == ["cpu"]
    assert distributed.resolve("auto", False, "finetune.devices") == ["cpu"]  # no GPU: one process
    assert distributed.resolve(2, False, "finetune.devices") == ["cpu", "cpu"]
    assert distributed.resolve(["cpu", "cpu", "cpu"], False, "finetune.devices") == ["cpu"] * 3
    for bad, match in ((0, "number of devices"), (["cuda:0"], "computes on the cpu|not here"),
                       ("gpu0", "not a device")):
        with pytest.raises(UserError, match=match):
            distributed.resolve(bad, False, "finetune.devices")
    assert distributed.check_batch(64, 2, "finetune.batch_size") == 32
    with pytest.raises(UserError, match="finetune.batch_size=63 is the global batch"):
        distributed.check_batch(63, 2, "finetune.batch_size")
    assert distributed.lr_scale("none", 4) == 1.0 and distributed.lr_scale("linear", 4) == 4.0
    assert distributed.lr_scale("sqrt", 4) == 2.0
    with pytest.raises(UserError, match="finetune.lr_scaling"):
        distributed.lr_scale("quadratic", 4)


@pytest.mark.parametrize("command,overrides,message", [
    ("finetune", ["finetune.devices=2", "finetune.batch_size=63"], "finetune.batch_size=63 is the global batch"),
    ("finetune", ["finetune.devices=2", "finetune.resume=maybe"], "finetune.resume='maybe'"),
    ("finetune", ["finetune.devices=2", "finetune.lr_scaling=cube"], "finetune.lr_scaling='cube'"),
    ("finetune", ["finetune.devices=[cuda:0,cuda:1]"], "finetune.devices"),
    ("compare", ["finetune.epochs=1", "finetune.devices=2"], "compare and sweep retrain on one device per job"),
    ("compare", ["eval.devices=2"], "eval.devices shards the one evaluation of `approx-run compare`"),
])
def test_bad_distributed_settings_stop_before_any_work(tmp_path, command, overrides, message):
    """Refused before a rank starts or a baseline trains: one message (the CLI's exit 2), nothing written."""
    from runner import compare

    cfg = compose(command, ["backend=python", *overrides], tmp_path)
    run = compare.run_finetune if command == "finetune" else compare.run  # compare.run: a sweep's job
    with pytest.raises(UserError, match=re.escape(message) if "[" not in message else message):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_lr_scaling_names_another_checkpoint_only_when_it_changes_the_lr(tmp_path):
    from runner.compare import plan_run

    keys = [plan_run(compose("compare", ["finetune.epochs=1", *extra], tmp_path)).row_keys["approx_finetuned"]
            for extra in ([], ["finetune.lr_scaling=linear"], ["finetune.devices=1", "finetune.resume=true"])]
    assert len(set(keys)) == 1  # one process: linear scaling is x1, and run keys name nothing


@needs_cpp
def test_resume_continues_as_if_never_stopped(tmp_path):
    """Stopped after epoch 1 of 2 (the resume state written), then resumed: the weights of the uninterrupted run,
    bit for bit. A resume state of another configuration is not used."""
    from runner.finetune import FinetuneConfig, Resume, train_epochs

    data, q, _, _, approx = tiny_lenet(64)
    fcfg = FinetuneConfig(epochs=2, batch_size=32, lr=1e-3)
    straight = copy.deepcopy(approx)
    train_epochs(straight, data, fcfg, q, torch.device("cpu"), 0, "straight",
                 resume=Resume(tmp_path / "a.resume", "id"))
    assert (tmp_path / "a.resume").exists()  # obtain removes it once the checkpoint is saved

    class StopAfterFirst(Resume):
        def write(self, epoch, *args):
            super().write(epoch, *args)
            if epoch == 1:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_epochs(copy.deepcopy(approx), data, fcfg, q, torch.device("cpu"), 0, "stopped",
                     resume=StopAfterFirst(tmp_path / "b.resume", "id"))
    resumed = copy.deepcopy(approx)
    history = train_epochs(resumed, data, fcfg, q, torch.device("cpu"), 0, "resumed",
                           resume=Resume(tmp_path / "b.resume", "id", load=True))
    assert [h["epoch"] for h in history] == [1, 2]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    other = copy.deepcopy(approx)  # another identity: starts from the beginning (and differs after 1 epoch)
    one = dataclasses.replace(fcfg, epochs=1)
    train_epochs(other, data, one, q, torch.device("cpu"), 0, "other",
                 resume=Resume(tmp_path / "b.resume", "another", load=True))
    assert not torch.equal(other.fc1.weight, resumed.fc1.weight)


# ---------------------------------------------------------------- two gloo ranks, as a user runs them

def _args(tmp_path, checkpoints, *extra):
    return ["finetune", *FAST, f"paths.results={tmp_path / 'results'}", f"paths.checkpoints={checkpoints}", *extra]


def _run_dirs(tmp_path):
    """The finetune run dirs so far (a run that ended before writing anything leaves none: the job layer removes
    a bare run dir)."""
    root = tmp_path / "results" / "finetune"
    return sorted(root.iterdir()) if root.exists() else []


@needs_cpp
@pytest.mark.processes
def test_two_ranks_killed_resumed_and_as_one_process(tmp_path, baseline_checkpoints):
    """2 gloo ranks on the CPU: one rank killed in the middle of epoch 2 stops the run with a message naming it
    (exit 1), no retrained checkpoint and no row; finetune.resume=true finishes it from epoch 1's state, rank 0
    alone writing the checkpoint and the rows; its accuracy is within 1 point of the one-process run at the same
    global batch (the ranks' sums round in another order, and 2 epochs of an approximate multiplier's steps carry
    that apart: 0.5-0.7 points on a 2-core AMD EPYC, up to 0.3 on a 2-core Xeon; a global batch's gradient itself is
    checked exactly above, resume's weights in test_resume_continues_as_if_never_stopped)."""
    import shutil

    from runner import compare, session

    ckpt = tmp_path / "ckpt"
    shutil.copytree(baseline_checkpoints, ckpt)
    args = _args(tmp_path, ckpt, "finetune.devices=2")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "runner.cli", *args], cwd=REPO, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    pids, out = None, []
    deadline = time.time() + 240
    for line in p.stdout:
        out.append(line)
        found = re.search(r"pids (\d+), (\d+)", line)
        if found:
            pids = [int(found[1]), int(found[2])]
        if line.startswith("epoch 1/2 finished") or time.time() > deadline:
            break
    assert pids, "".join(out)
    os.kill(pids[1], signal.SIGKILL)  # rank 1, while rank 0 is in epoch 2
    rest, _ = p.communicate(timeout=120)
    text = "".join(out) + rest
    assert p.returncode == 1, text
    assert "rank 1 of 2 (cpu" in text and "SIGKILL" in text and "finetune.resume=true" in text
    assert not list(ckpt.glob("*_finetuned_*.pt")) and not list(ckpt.glob(".*tmp"))
    assert len(list(ckpt.glob("*_finetuned_*.resume"))) == 1
    assert not (tmp_path / "results" / "results.csv").exists()
    killed_dir = _run_dirs(tmp_path)

    res = subprocess.run([sys.executable, "-m", "runner.cli", *args, "finetune.resume=true"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "after epoch 1 of 2" in res.stdout
    assert len(list(ckpt.glob("*_finetuned_*.pt"))) == 1 and not list(ckpt.glob("*.resume"))
    df = pd.read_csv(tmp_path / "results" / "results.csv")
    assert df["path"].tolist() == ["pytorch", "fakequant", "approx", "approx_finetuned"]  # once, by rank 0
    tuned = df.iloc[3]
    assert (tuned["finetune_world_size"], tuned["finetune_devices"], tuned["finetune_batch_size"],
            tuned["finetune_batch_per_device"], tuned["finetune_lr_scaling"]) == (2, "cpu;cpu", 64, 32, "none")
    new_dirs = [d for d in _run_dirs(tmp_path) if d not in killed_dir]
    assert len(new_dirs) == 1 and len(pd.read_csv(new_dirs[0] / "finetune_log.csv")) == 2

    # the one-process run of the same configuration, in this process
    session.reset()
    cfg = compose("finetune", [*FAST, f"paths.results={tmp_path / 'one'}", f"paths.checkpoints={tmp_path / 'c1'}"])
    shutil.copytree(baseline_checkpoints, tmp_path / "c1")
    out_dir = tmp_path / "one" / "run"
    out_dir.mkdir(parents=True)
    one = [r for r in compare.run_finetune(cfg, out_dir)["rows"] if r["path"] == "approx_finetuned"][0]
    session.reset()
    assert one["finetune_world_size"] == 1 and one["n_images"] == tuned["n_images"] == 1000
    assert abs(one["accuracy"] - tuned["accuracy"]) <= 0.01, (one["accuracy"], tuned["accuracy"])


@needs_cpp
@pytest.mark.processes
def test_sharded_evaluation_rows_equal_the_one_process_rows(tmp_path, baseline_checkpoints):
    """compare with eval.devices=2 (2 gloo ranks): the batches split over the ranks (5 batches of 64 with
    a partial last one; dynamic scales, which depend on each batch), the rows' counts and keys those of the
    one-process run, written once."""
    from runner import compare, session

    over = ["eval.repeats=1", "eval.warmup=0", "eval.limit=300", "eval.batch_size=64", "train.epochs=1",
            "quant.calib_batches=1", "quant=per_channel_dynamic", "multiplier=mul8s_1L2N",
            f"paths.checkpoints={baseline_checkpoints}"]
    res = subprocess.run([sys.executable, "-m", "runner.cli", "compare", *over, "eval.devices=2",
                          f"paths.results={tmp_path / 'two'}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    two = pd.read_csv(tmp_path / "two" / "results.csv")
    session.reset()
    cfg = compose("compare", [*over, f"paths.results={tmp_path / 'one'}"])
    (tmp_path / "one" / "run").mkdir(parents=True)
    one = pd.DataFrame(compare.run(cfg, tmp_path / "one" / "run")["rows"])
    session.reset()
    cols = ["path", "n_images", "correct", "accuracy", "agreement_fakequant", "agreement_pytorch", "row_key",
            "n_batches"]
    assert len(two) == 3 and two[cols].fillna(-1).equals(one[cols].fillna(-1))
    assert (two["eval_world_size"] == 2).all() and (two["eval_devices"] == "cpu;cpu").all()
    assert len(list((tmp_path / "two" / "compare").iterdir())) == 1


@pytest.mark.processes
def test_train_under_torchrun_rank_0_alone_writes(tmp_path):
    """`approx-run train` as 2 torchrun ranks (env:// rendezvous, gloo): the baseline trained with DDP, one
    checkpoint and one run dir (rank 1's Hydra output went to a temporary directory), the ranks in its meta."""
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "runner.cli", "train",
            "train.epochs=1", "train.batch_size=256", f"paths.results={tmp_path / 'results'}",
            f"paths.checkpoints={tmp_path / 'ckpt'}",
            # a run dir per rank unless the rank writes nothing (the ranks start within the same second)
            f"hydra.run.dir={tmp_path / 'results' / 'train'}/rank${{oc.env:RANK}}"]
    res = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    ckpts = list((tmp_path / "ckpt").glob("*.pt"))
    assert len(ckpts) == 1
    meta = torch.load(ckpts[0], weights_only=True)["meta"]
    assert (meta["world_size"], meta["batch_per_device"]) == (2, 128) and meta["test_accuracy"] > 0.3
    runs = list((tmp_path / "results" / "train").iterdir())
    assert [r.name for r in runs] == ["rank0"] and (runs[0] / "train_log.csv").exists()
    assert res.stdout.count("saved checkpoint") == 1


# ---------------------------------------------------------------- a sweep with fewer jobs than devices

def test_fewer_jobs_than_devices_share_them_two_or_more_each():
    from runner.jobs.run import device_shares

    gpus = [f"cuda:{i}" for i in range(8)]
    assert device_shares(1, gpus[:4]) == [gpus[:4]]
    assert device_shares(2, gpus[:4]) == [gpus[:2], gpus[2:4]]
    assert device_shares(3, gpus[:4]) is None  # one each: the pool's way
    assert device_shares(3, gpus) == [gpus[:3], gpus[3:6], gpus[6:]]  # every device used
    assert device_shares(4, gpus) == [gpus[i:i + 2] for i in range(0, 8, 2)]
    assert device_shares(0, gpus) is None and device_shares(1, ["cpu"]) is None


def test_which_sweep_jobs_are_sharded(tmp_path):
    """Only the jobs with work to do count, and only evaluation-only jobs on the devices' kind are sharded."""
    from runner.jobs.plan import Job
    from runner.jobs.run import plan_all, sharded_jobs
    from runner.store import append_rows

    def jobs(*extra, tables=("mul8s_1L2N", "mul8s_1KV8")):
        return plan_all([Job(i, [], compose("sweep", ["backend=python", f"multiplier={t}", *extra], tmp_path),
                             tmp_path / str(i)) for i, t in enumerate(tables)])

    cpus = ["cpu"] * 4
    two = jobs()
    assert sharded_jobs(two, cpus) == {0: ["cpu", "cpu"], 1: ["cpu", "cpu"]}
    assert sharded_jobs(two, ["cpu"] * 3) == {}                         # 1 each at most: the pool
    assert sharded_jobs(jobs("finetune.epochs=1"), cpus) == {}          # retraining: one device per job
    # job 0 recorded: job 1 alone has work, over all four
    append_rows(tmp_path / "results" / "results.csv",
                [{"row_key": two[0].plan.row_keys[p], "status": "ok", "path": p} for p in two[0].plan.row_keys])
    assert sharded_jobs(jobs(), cpus) == {1: cpus}
    assert sharded_jobs(jobs("skip_done=false"), cpus) == {0: ["cpu", "cpu"], 1: ["cpu", "cpu"]}


@needs_cpp
@pytest.mark.processes
def test_sweep_of_one_job_on_two_devices_shards_it_and_gives_the_one_device_row(tmp_path, baseline_checkpoints):
    """A sweep of one table with sweep.devices=[cpu,cpu]: its evaluation runs as 2 gloo ranks (the batches
    dealt to them; dynamic scales and a partial last batch), its rows those of the one-device sweep, the
    approx row written once with eval_world_size 2."""
    from runner import session, sweep

    over = ["sweep.multipliers=mul8s_1L2N", "backend=cpp", "eval.repeats=1", "eval.warmup=0", "eval.limit=300",
            "eval.batch_size=64", "train.epochs=1", "quant.calib_batches=1", "quant=per_channel_dynamic",
            f"paths.checkpoints={baseline_checkpoints}"]
    res = subprocess.run([sys.executable, "-m", "runner.cli", "sweep", *over, "sweep.devices=[cpu,cpu]",
                          f"paths.results={tmp_path / 'two'}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ranks: 2 processes on cpu, cpu" in res.stdout
    two = pd.read_csv(tmp_path / "two" / "results.csv")
    session.reset()
    assert sweep.main([*over, "sweep.devices=[cpu]", f"paths.results={tmp_path / 'one'}"]) == 0
    session.reset()
    one = pd.read_csv(tmp_path / "one" / "results.csv")
    cols = ["path", "multiplier", "status", "n_images", "correct", "accuracy", "agreement_fakequant",
            "agreement_pytorch", "row_key", "n_batches"]
    assert len(two) == 3
    pd.testing.assert_frame_equal(two[cols], one[cols])
    approx = two[two["path"] == "approx"].iloc[0]
    assert (approx["eval_world_size"], approx["eval_devices"]) == (2, "cpu;cpu")
    assert "eval_world_size" not in one.columns
    summary = pd.read_csv(next((tmp_path / "two" / "sweep").glob("*/summary.csv")))
    assert summary["status"].tolist() == ["ok"] and summary["row_key"].iloc[0] == approx["row_key"]
    job = json.loads(next((tmp_path / "two" / "sweep").glob("*/0/job.json")).read_text())
    assert (job["status"], job["devices"]) == ("ok", "cpu;cpu")


def _lazy_sharded_rank(cfg, out_dir):
    """A rank of test_sharded_evaluation_reads_a_lazy_set: run_timed_sharded over a lazily read set (ImageFolder's
    runner.data.Images) and over the tensor it stands for."""
    from runner.data.dataset import Images
    from runner.evaluate import run_timed_sharded

    raw, model = _lazy_case()
    lazy = run_timed_sharded(model, Images(raw.numpy()), 6, torch.device("cpu"), warmup=0, repeats=1)
    eager = run_timed_sharded(model, raw.float() / 255, 6, torch.device("cpu"), warmup=0, repeats=1)
    return {"lazy": lazy.predictions, "eager": eager.predictions, "computed_here": len(lazy.logits)}


def _lazy_case():
    raw = torch.randint(0, 256, (20, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    return raw, torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(144, 10))


@pytest.mark.processes
def test_sharded_evaluation_reads_a_lazy_set(tmp_path):
    """2 gloo ranks over 20 lazily read images in batches of 6: rank 0 computes batches 0 and 2 (12 images), every
    rank gets the one-process predictions back, as for a tensor."""
    from runner.evaluate import run_timed

    ranks = distributed.spawn_ranks("tests.test_distributed:_lazy_sharded_rank", {}, tmp_path, ["cpu", "cpu"])
    assert ranks.ok, ranks.failure()
    raw, model = _lazy_case()
    one = run_timed(model, raw.float() / 255, 6, torch.device("cpu"), warmup=0, repeats=0).predictions
    assert torch.equal(ranks.result["lazy"], one) and torch.equal(ranks.result["eager"], one)
    assert ranks.result["computed_here"] == 12


def _calibration_rank(cfg, out_dir):
    """A rank of test_ranks_take_rank_0s_calibration: each rank offers other images; every rank's statistics."""
    import torch.distributed as dist

    from runner.quant import QuantConfig
    from runner.session import Session

    rank = dist.get_rank()
    x = torch.rand(64, 3, 8, 8, generator=torch.Generator().manual_seed(rank))
    _, stats = Session().calibration(_lazy_case()[1], Path("ckpt"), x, QuantConfig(), 0)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {n: vars(s) for n, s in stats.items()})
    return every


@pytest.mark.processes
def test_ranks_take_rank_0s_calibration(tmp_path):
    """Rank 0 alone calibrates and the others take its statistics (they would differ here: each rank offers other
    images), equal to a one-process calibration on rank 0's images."""
    from runner.quant import QuantConfig
    from runner.session import Session

    ranks = distributed.spawn_ranks("tests.test_distributed:_calibration_rank", {}, tmp_path, ["cpu", "cpu"])
    assert ranks.ok, ranks.failure()
    x0 = torch.rand(64, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    _, one = Session().calibration(_lazy_case()[1], Path("ckpt"), x0, QuantConfig(), 0)
    assert ranks.result[0] == ranks.result[1] == {n: vars(s) for n, s in one.items()}


def test_digest_of_a_state_with_an_expanded_tensor():
    """A buffer broadcast from a scalar (stride 0) hashes as its values do: the end-of-training check of the ranks'
    states used to fail on it (ResNet-8 under finetune.devices)."""
    a, b = torch.nn.Module(), torch.nn.Module()
    a.register_buffer("s", torch.tensor(2.0).expand(1))
    b.register_buffer("s", torch.tensor([2.0]))
    assert a.s.stride() == (0,) and distributed.digest(a) == distributed.digest(b)
    b.s += 1
    assert distributed.digest(a) != distributed.digest(b)


def test_a_sharded_job_whose_rank_fails_is_recorded_once(tmp_path, monkeypatch):
    """run_sharded with the ranks' outcome given: a failed rank gives one failed row (the rank's error in it) and a
    failed job.json; ranks that ended well give an ok job.json naming their devices and no row of their own."""
    from runner.jobs.plan import Job
    from runner.jobs.run import plan_all, run_sharded
    from runner.store import read_csv

    jobs = plan_all([Job(i, [f"multiplier={t}"], compose("sweep", ["backend=python", f"multiplier={t}"], tmp_path),
                         tmp_path / "sweep" / str(i)) for i, t in enumerate(("mul8s_1L2N", "mul8s_1KV8"))])
    for job in jobs:
        job.out_dir.mkdir(parents=True)
    outcomes = {str(jobs[0].out_dir): distributed.Ranks(["cpu", "cpu"], [11, 12], {0: 75, 1: 1}, [1, 0],
                                                        {1: "ValueError: boom"}),
                str(jobs[1].out_dir): distributed.Ranks(["cpu", "cpu"], [13, 14], {0: 0, 1: 0}, [0, 1], {},
                                                        {"status": "ok", "rows": []})}
    monkeypatch.setattr(distributed, "spawn_ranks", lambda entry, cfg, out_dir, devices, stop: outcomes[str(out_dir)])
    advanced = []
    run_sharded(jobs, {0: ["cpu", "cpu"], 1: ["cpu", "cpu"]}, lambda n, **info: advanced.append(info["status"]))
    rows = read_csv(tmp_path / "results" / "results.csv")
    assert len(rows) == 1 and rows["status"].iloc[0] == "failed"
    assert "sharded over cpu;cpu: rank 1 of 2 (cpu, pid 12) exited with code 1 (ValueError: boom)" in rows["error"].iloc[0]
    failed, ok = (json.loads((job.out_dir / "job.json").read_text()) for job in jobs)
    assert failed["status"] == "failed" and "boom" in failed["error"]
    assert (ok["status"], ok["devices"], ok["overrides"]) == ("ok", "cpu;cpu", ["multiplier=mul8s_1KV8"])
    assert sorted(advanced) == ["failed", "ok"]
