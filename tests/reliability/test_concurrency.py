"""Processes racing on shared files: two sweeps over overlapping multiplier sets into one results file
(one with the joblib launcher), and two `train` runs of one checkpoint."""
import pytest
import torch

from tests.reliability.conftest import TINY, assert_clean_exit, finish, ok_rows, outputs, start

pytestmark = pytest.mark.processes



def test_two_sweeps_overlapping_record_each_row_once(tmp_path, baseline):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    common = [*TINY, *outputs(tmp_path, baseline)]
    a = start("sweep", "sweep.multipliers=[exact,mul8s_1KV8,mul8u_2V0]", *common,
              f"hydra.sweep.dir={tmp_path / 'a'}")
    b = start("sweep", "sweep.multipliers=[mul8s_1KV8,mul8u_2V0,mul8s_1L2N]", *common,
              "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path / 'b'}")
    for p in (a, b):
        assert_clean_exit(*finish(p, timeout=180), 0)
    ok = ok_rows(tmp_path / "results" / "results.csv")
    assert ok["row_key"].is_unique
    assert sorted(ok.loc[ok["path"] == "approx", "multiplier"]) == ["exact_s", "mul8s_1KV8", "mul8s_1L2N",
                                                                   "mul8u_2V0"]
    # the references once per signedness, whichever sweep got there first
    assert (ok["path"] == "pytorch").sum() == 1 and (ok["path"] == "fakequant").sum() == 2


def test_two_trains_of_one_checkpoint_train_it_once(tmp_path):
    args = ["train", "train.epochs=1", *outputs(tmp_path)]
    first, second = start(*args), start(*args)
    outs = [finish(p, timeout=180) for p in (first, second)]
    for rc, out in outs:
        assert_clean_exit(rc, out, 0)
    texts = "\n".join(out for _, out in outs)
    assert texts.count("saved checkpoint") == 1 and texts.count("reusing checkpoint") == 1, texts
    (ckpt,) = (tmp_path / "ckpt").glob("*.pt")
    assert torch.load(ckpt, weights_only=True)["meta"]["epochs"] == 1
    assert not list((tmp_path / "ckpt").glob(".*.tmp"))


def test_two_imports_of_one_name_leave_one_whole_entry(tmp_path, home):
    from runner.multipliers import get, save_table

    tables = {n: save_table(get(n), tmp_path / f"{n}.txt") for n in ("mul8s_1L2J", "mul8s_1KVM")}
    procs = [start("lut", "import", str(path), "--name", "mine", "--force") for path in tables.values()]
    for p in procs:
        assert_clean_exit(*finish(p), 0)
    entry = get("mine")                               # reads back: the table matches its metadata
    assert entry.sha256 in {get(n).sha256 for n in tables}
    assert [p.name for p in (home / "multipliers").glob("mine.*.txt.gz")] == [f"mine.{entry.sha256[:16]}.txt.gz"]
