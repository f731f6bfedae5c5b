from pathlib import Path

import pytest

from runner.quant import QuantConfig
from runner.config import CONFIG_DIR
from tests.conftest import compose

GROUPS = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in CONFIG_DIR.iterdir() if d.is_dir()}
CASES = [(g, o) for g, opts in sorted(GROUPS.items()) for o in opts]


def test_every_axis_has_a_group():
    assert {"data", "model", "train", "multiplier", "backend", "quant"} <= set(GROUPS)


@pytest.mark.parametrize("group,option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_every_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if (group, option) == ("multiplier", "file"):
        overrides.append("multiplier.path=/tmp/table.txt")
    cfg = compose("compare", overrides)
    assert cfg[group] is not None
    if group == "quant":
        QuantConfig.from_cfg(cfg.quant)  # every shipped scheme validates


def test_outputs_go_under_results_command_dir():
    from omegaconf import OmegaConf
    from hydra import compose as hc, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = hc(config_name="train", return_hydra_config=True)
    assert cfg.hydra.run.dir.startswith("results/train/")
    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${hydra.job.num}"


@pytest.mark.parametrize("bad", [dict(weight="per_row"), dict(activation="ema"), dict(percentile=20.0),
                                 dict(calib_batches=0)])
def test_quant_config_rejects_bad_values(bad):
    from runner.errors import UserError

    with pytest.raises(UserError):
        QuantConfig(**bad)
