"""The job layer: argv splitting, multiplier nodes, plans, run-dir naming, one error handling for planning."""
import re
from pathlib import Path

import pytest
import torch

from runner.errors import UserError
from runner.jobs.argv import launcher_of, split_argv, wants_cuda
from runner.jobs.plan import Job, Plan, multiplier_node, remove_if_bare, run_dir, with_multiplier
from runner.jobs.run import plan_all, plan_or_reason
from tests.conftest import REPO, compose


def test_split_argv_takes_the_multiplier_set_out():
    flags, overrides, value = split_argv(["--cfg", "job", "search.multipliers=mul8*", "backend=cpp"],
                                         "search.multipliers")
    assert (flags, overrides, value) == (["--cfg"], ["job", "backend=cpp"], "mul8*")
    with pytest.raises(UserError, match="sweep.multiplier is set per job"):
        split_argv(["sweep.multiplier=exact"])


def test_launcher_and_cuda_from_overrides():
    assert launcher_of([]) == "basic" and launcher_of(["hydra/launcher=joblib"]) == "joblib"
    assert wants_cuda(["backend=cuda"]) and not wants_cuda(["backend=cuda", "hydra/launcher=joblib"])
    assert wants_cuda(["+device=cuda:1"]) and not wants_cuda(["backend=cpp"])


def test_multiplier_node_of_a_name_and_of_a_file():
    assert multiplier_node("mul8s_1L2J") == {"name": "mul8s_1L2J"}
    assert multiplier_node("/tmp/t.txt") == {"name": "file", "path": "/tmp/t.txt", "signed": None}
    assert multiplier_node("t.npy", {"fc1": "exact"}) == {"name": "file", "path": "t.npy", "signed": None,
                                                           "layers": {"fc1": "exact"}}


def test_with_multiplier_keeps_per_layer_overrides(tmp_path):
    cfg = compose("sweep", ["sweep.multiplier=mul8s_1L2J", "+multiplier.layers={fc3: exact}"], tmp_path)
    node = with_multiplier(cfg).multiplier
    assert node.name == "mul8s_1L2J" and node.layers.fc3 == "exact"


def test_run_dir_is_named_as_hydra_names_it(tmp_path):
    cfg = compose("sensitivity", [], tmp_path)
    path = run_dir(cfg)
    assert path.parent == tmp_path / "results" / "sensitivity"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}", path.name)
    common = (REPO / "configs" / "common.yaml").read_text()
    # the pattern run_dir follows: change both or neither
    assert common.count("dir: ${paths.results}/${command}/${now:%Y-%m-%d}_${now:%H-%M-%S}") == 2


def test_plan_has_named_fields_and_moves_device(tmp_path):
    plan, reason = plan_or_reason(compose("compare", ["backend=python", "model.approx_layers=[fc1]"], tmp_path))
    assert reason == "" and isinstance(plan, Plan)
    assert plan.approx_layers == ["fc1"] and {"pytorch", "fakequant", "approx"} <= set(plan.row_keys)
    moved = plan.on(torch.device("meta"))
    assert moved.device == torch.device("meta") and moved.row_keys == plan.row_keys and plan.device.type == "cpu"


def test_a_job_that_cannot_be_planned_keeps_the_reason(tmp_path):
    cfg = compose("compare", ["backend=python", "model.approx_layers=[conv9]"], tmp_path)
    (job,) = plan_all([Job(0, ["model.approx_layers=[conv9]"], cfg, Path(tmp_path / "0"))])
    assert job.plan is None and "conv9" in job.plan_error


def test_planning_resolves_the_job_config_and_plans_as_before(tmp_path):
    """A job config given to plan_all as composed (sensitivity's) leaves it resolved, with the same values and
    the plan its unresolved twin gets."""
    import copy

    from omegaconf import OmegaConf

    cfg = compose("compare", ["backend=python", "multiplier=mul8u_2V0"], tmp_path)
    twin = copy.deepcopy(cfg)
    assert "${" in OmegaConf.to_yaml(twin)
    (job,) = plan_all([Job(0, [], cfg, Path(tmp_path / "0"))])
    assert "${" not in OmegaConf.to_yaml(job.cfg)
    assert OmegaConf.to_container(job.cfg) == OmegaConf.to_container(twin, resolve=True)
    plan, _ = plan_or_reason(twin)
    assert (job.plan.approx_layers, job.plan.row_keys) == (plan.approx_layers, plan.row_keys)


def test_a_run_dir_with_only_its_config_is_removed_with_its_empty_parents(tmp_path):
    root = tmp_path / "results"
    bare = root / "compare" / "2026-01-01_00-00-00"
    (bare / ".hydra").mkdir(parents=True)
    for f in ("config.yaml", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "compare.log"):
        (bare / f).write_text("x")
    kept = root / "sweep" / "2026-01-01_00-00-00"
    (kept / "0").mkdir(parents=True)
    (kept / "config.yaml").write_text("x")
    (kept / "0" / "metrics.csv").write_text("a\n1\n")   # a result: the dir stays
    assert remove_if_bare(bare, root) and not (root / "compare").exists() and root.is_dir()
    assert not remove_if_bare(kept, root) and (kept / "0" / "metrics.csv").exists()
    other = root / "compare" / "2026-01-01_00-00-01"
    (root / "compare" / "2026-01-01_00-00-02").mkdir(parents=True)   # another run's dir: the parent stays
    other.mkdir()
    assert remove_if_bare(other, root) and (root / "compare").is_dir()


def test_run_jobs_estimates_the_total_from_the_second_evaluation(tmp_path, monkeypatch, capsys):
    """The first job carries the command's set-up (56 s against 3 s an evaluation for a ResNet-50 on a GPU), so
    its time times the count is only an upper bound; the second job's time gives the estimate."""
    import time

    from omegaconf import OmegaConf

    import runner.jobs.run as run_mod

    pace = iter([2.6, 0.05, 0.05, 0.05])

    def fake_job(cfg, out_dir, **_):
        time.sleep(next(pace))
        return {"status": "ok"}

    monkeypatch.setattr(run_mod, "run_job", fake_job)
    jobs = [Job(i, [], OmegaConf.create({"i": i}), tmp_path / str(i)) for i in range(4)]
    run_mod.run_jobs(jobs, "demo: 4 evaluations")
    out = capsys.readouterr().out
    upper = re.search(r"take at most about (\S+)", out).group(1)
    estimate = re.search(r"second evaluation \S+: the 4 take about (\S+)", out).group(1)
    assert (upper, estimate) == ("10s", "3s")  # 4 x 2.6 s against 2.6 + 3 x 0.05 s
