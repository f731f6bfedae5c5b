"""model=torchvision on data=imagefolder through the commands: compare, sweep, sensitivity and search end to end
on the generated tree (tests/data/imagefolder_fixture.py) for four architectures, and search's estimate on
data.limit images confirmed on the whole val split without looking at the images it chose on.

At 32x32 crops of 30 images a split with seeded random weights (10 classes): the commands' code paths at a
fraction of ImageNet's cost. Random weights already spread their predictions over several classes at this
size, so the exact table agreeing with fake-quant on every image is not the agreement of two constant
answers (checked)."""
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from runner import session
from tests.conftest import compose, has_cpp
from tests.data.imagefolder_fixture import write_imagefolder

pytestmark = pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension (backend=cpp)")

# two late layers per architecture: sensitivity and search start their evaluations there (kept activations)
LAYERS = {"resnet18": "[layer4.1.conv2,fc]", "mobilenet_v3_small": "[classifier.0,classifier.3]",
          "efficientnet_b0": "[features.8.0,classifier.1]", "convnext_tiny": "[features.7.2.block.5,classifier.2]"}
TABLES = "[mul8s_1L2J,mul8s_1L12]"


def cli(args: list[str]) -> int:
    """`approx-run args` in this process, as a new process would start it (no session carried over)."""
    from runner.cli import main

    session.reset()
    try:
        return main(args)
    except SystemExit as exc:  # Hydra's task ends a user error with sys.exit(2)
        return exc.code
    finally:
        session.reset()


def state_dict(arch: str, path: Path, seed: int = 0) -> Path:
    from runner.models.torchvision_models import build

    torch.manual_seed(seed)
    torch.save(build(arch, num_classes=10).state_dict(), path)
    return path


def common(tmp_path: Path, arch: str, weights: Path, size: int = 32) -> list[str]:
    return ["model=torchvision", f"model.arch={arch}", f"model.weights={weights}", "+model.num_classes=10",
            "data=imagefolder", f"data.root={tmp_path / 'tree'}", f"data.resize={size + size // 4}",
            f"data.crop={size}", "data.workers=1", f"data.cache_dir={tmp_path / 'cache'}", "eval.repeats=1",
            "eval.warmup=0", "quant.calib_batches=1", f"paths.results={tmp_path / 'results'}",
            f"paths.checkpoints={tmp_path / 'checkpoints'}"]


def fakequant_predictions(args: list[str], tmp_path: Path) -> torch.Tensor:
    """The fake-quant predictions of a compare run just done, from a session that ran it."""
    from runner import compare
    from runner.cli import main

    session.reset()
    try:
        assert main(["compare", *args]) == 0
        return session.get().predictions(compare.plan_run(compose("compare", args, None)).row_keys["fakequant"])
    finally:
        session.reset()


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(LAYERS))
def test_every_command_end_to_end(arch, tmp_path, capsys):
    bad = write_imagefolder(tmp_path / "tree", per_class=3)  # train/ and val/: 30 images each, one damaged
    args = common(tmp_path, arch, state_dict(arch, tmp_path / f"{arch}.pt"))

    # the damaged file is named (exit 2) and nothing is cached; with data.skip_bad it is left out and counted
    assert cli(["compare", *args, "multiplier=exact"]) == 2
    out = "".join(capsys.readouterr())
    assert str(bad) in out and "data.skip_bad=true" in out and "Traceback" not in out
    assert not list((tmp_path / "cache").glob("val-*"))
    args.append("data.skip_bad=true")
    preds = fakequant_predictions([*args, "multiplier=exact"], tmp_path)
    out = capsys.readouterr().out
    assert "decoded 31 val images" in out and "skipped 1 damaged val image" in out
    rows = pd.read_csv(tmp_path / "results" / "results.csv").set_index("path")
    assert rows.loc["approx", "agreement_fakequant"] == 1.0  # the exact table: fake-quant's answer on every image
    assert rows.loc["approx", "n_images"] == 30  # every val image but the damaged one
    assert len(preds) == 30 and len(preds.unique()) >= 3  # not one constant answer agreeing with another

    # each later command reads the cache
    assert cli(["sweep", *args, f"sweep.multipliers={TABLES}"]) == 0
    out = capsys.readouterr().out
    assert out.count("decoded nothing") >= 2 and "decoding" not in out
    summary = pd.read_csv(next((tmp_path / "results" / "sweep").glob("*/summary.csv")))
    assert len(summary) == 2 and set(summary["status"]) == {"ok"}
    assert "sweep: 2 jobs" in out and "first evaluation" in out  # the count, then the estimate

    assert cli(["sensitivity", *args, f"sensitivity.multipliers={TABLES}", f"sensitivity.layers={LAYERS[arch]}"]) == 0
    out = capsys.readouterr().out
    assert "decoding" not in out and "sensitivity: 4 evaluations" in out
    table = pd.read_csv(next((tmp_path / "results" / "sensitivity").glob("*/sensitivity.csv")))
    assert len(table) == 4 and set(table["status"]) == {"ok"}

    assert cli(["search", *args, "data.limit=20", f"search.multipliers={TABLES}", f"search.layers={LAYERS[arch]}",
                "search.max_evals=2", "search.max_loss=5"]) == 0
    out = capsys.readouterr().out
    assert "search: 6 evaluations" in out and "at most 2 of the descent" in out and "first evaluation" in out
    assert "on 30 images (the whole val split" in out  # estimated on 20 a split, confirmed on all 30
    assert "approx-run compare multiplier=exact '+multiplier.layers=" in out


def _run_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "test" / "run.json").read_text())


@pytest.mark.parametrize("splits", [("val",), pytest.param(("train", "val"), marks=pytest.mark.slow)])
def test_search_estimates_on_the_limit_and_confirms_on_the_whole_split(splits, tmp_path, capsys):
    """data.limit=30 of 50 images: the search chooses on its validation split of those; the confirming compare
    measures the whole val split, calibrated apart, and never an image the choice was made on."""
    from runner.data import load_dataset
    from runner.train import held_apart, left_out

    write_imagefolder(tmp_path / "tree", per_class=5, splits=splits, corrupt=False)
    args = [*common(tmp_path, "resnet18", state_dict("resnet18", tmp_path / "r18.pt"), size=16), "data.limit=30"]
    assert cli(["search", *args, "search.multipliers=mul8u_T83", "search.layers=[fc]", "search.max_evals=1",
                "search.max_loss=100"]) == 0
    out = capsys.readouterr().out
    assert "search: 2 evaluations" in out and "at most 1 of the descent, on 10 validation images" in out
    assert "first evaluation" in out and "search: 3/3" in out  # the count, the estimate, the progress line
    run_dir = next((tmp_path / "results" / "search").glob("*/"))
    confirm = _run_json(run_dir)["config"]["data"]
    assert confirm["limit"] is None  # the whole split
    rows = pd.read_csv(tmp_path / "results" / "results.csv")
    measured = rows[rows["path"] == "approx"]["n_images"].iloc[-1]
    pareto = pd.read_csv(run_dir / "pareto.csv")
    if splits == ("train", "val"):
        # chosen on 20 % of 30 training images; measured on all 50 val images, calibrated on the same 30
        assert measured == 50 and confirm["train_limit"] == 30 and not confirm["exclude_images"]
        assert set(pareto["val_images"]) == {10}
        assert not (run_dir / "search_validation_images.txt").exists()
        return
    chosen_on = set((run_dir / "search_validation_images.txt").read_text().split())
    assert len(chosen_on) == 10 and set(pareto["val_images"]) == {10}  # one of each class of the 20 measured
    data_cfg = compose("search", args).data
    for k, v in confirm.items():
        data_cfg[k] = v
    from omegaconf import OmegaConf

    whole = left_out(held_apart(load_dataset(data_cfg), OmegaConf.create({"data": data_cfg})),
                     OmegaConf.create({"data": data_cfg}))
    names, calibrated = whole.test_x.names(), whole.train_x.names()
    assert not set(names) & chosen_on and not set(names) & set(calibrated)
    assert len(calibrated) == 10 and measured == len(names) == 50 - 10 - len(chosen_on - set(calibrated))
    assert measured > 20  # more than the estimate's split measures: the whole split
    assert f"on {measured} images (the whole val split less the images held apart" in out
