from pathlib import Path

import pytest

from runner.quant import QuantConfig
from runner.config import CONFIG_DIR
from tests.conftest import compose

GROUPS = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in CONFIG_DIR.iterdir() if d.is_dir()}
CASES = [(g, o) for g, opts in sorted(GROUPS.items()) for o in opts]


def test_every_axis_has_a_group():
    assert {"data", "model", "train", "multiplier", "backend", "quant"} <= set(GROUPS)


def _check_usable(cfg, group, option, tmp_path):
    """What a run would build from the option succeeds, not merely that it composes."""
    if group == "quant":
        QuantConfig.from_cfg(cfg.quant)
    elif group == "multiplier":
        from runner.multipliers import resolve_per_layer

        m = resolve_per_layer(cfg.multiplier, ["conv1"])["conv1"]
        assert tuple(m.lut.shape) == (256, 256) and len(m.sha256) == 64
        if option.startswith("mul8"):
            assert m.name == option and m.signed == option.startswith("mul8s")
    elif group == "model":
        from runner.models import build_model
        from runner.quant import quant_layers

        assert len(quant_layers(build_model(cfg.model, 0.0, 1.0))) > 0
    elif group == "backend":
        from runner import _ext
        from runner.ops import check_algo

        assert cfg.backend.name == option
        if _ext.backend_status().get(option, "available") == "available":  # cuda's variants need its device
            check_algo(cfg.backend.name, cfg.backend.algo)
    elif group == "finetune":
        from runner.finetune import FinetuneConfig

        FinetuneConfig.from_cfg(cfg.finetune)
    elif group == "data":
        assert cfg.data.name == option


@pytest.mark.parametrize("group,option", CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_every_option_builds(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if (group, option) == ("multiplier", "file"):
        import numpy as np

        from runner.multipliers import exact_table

        np.savetxt(tmp_path / "table.txt", exact_table(True), fmt="%d")
        overrides.append(f"multiplier.path={tmp_path / 'table.txt'}")
    elif (group, option) == ("multiplier", "named"):
        overrides.append("multiplier.name=exact")
    elif (group, option) == ("model", "custom"):  # a user's nn.Module: the config names it
        overrides.append("model._target_=tests.test_models.TinyNet")
    _check_usable(compose("compare", overrides), group, option, tmp_path)


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


def test_a_signal_during_composition_is_delivered_after_it(monkeypatch):
    """Ctrl-C in the middle of composing: the composition finishes whole, then the interrupt is raised
    (inside OmegaConf it would turn into an AttributeError traceback)."""
    import os
    import signal

    import hydra

    from runner import config

    real = hydra.compose
    finished = []

    def interrupted_compose(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # arrives mid-composition
        cfg = real(*args, **kwargs)
        finished.append(cfg)
        return cfg

    monkeypatch.setattr(hydra, "compose", interrupted_compose)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        config.compose("compare", ["multiplier=mul8s_1L2N"])
    assert finished and finished[0].multiplier.name == "mul8s_1L2N"
    assert signal.getsignal(signal.SIGINT) is before


def test_held_signals_go_to_the_handler_that_was_there():
    import os
    import signal

    from runner.config import HeldSignals

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with HeldSignals():
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == []
        assert seen == [signal.SIGTERM]
        with HeldSignals(hold=False):
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_lists_go_only_to_keys_that_take_them():
    """A list to a key whose default is a list, null or a new key (+) is a list setting; to a group or a one-value
    key it is refused (test_exit_codes has the messages)."""
    from runner.config import refuse_lists
    from runner.errors import UserError

    refuse_lists("sweep", ["sweep.devices=[cpu,cpu]", "model.approx_layers=[conv1]", "eval.paths=[pytorch]",
                           "+model.extra=[1]", "model=lenet5,resnet8", "~eval.limit", "seed=1"])
    refuse_lists("sensitivity", ["sensitivity.layers=[conv1]", "sensitivity.devices=[cpu]"])
    for bad in ("multiplier=[exact]", "seed=[1]", "train.epochs=[3]", "hydra/launcher=[joblib]"):
        with pytest.raises(UserError, match="takes one"):
            refuse_lists("sweep", [bad])
