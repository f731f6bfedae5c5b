from pathlib import Path

import numpy as np
import pytest
import torch

from runner.errors import UserError
from runner.multipliers import get, import_table, list_multipliers, resolve, resolve_per_layer, save_table
from runner.multipliers.registry import user_dir

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _err(fn, *a, **kw):
    with pytest.raises(UserError) as e:
        fn(*a, **kw)
    return str(e.value)


@pytest.fixture(scope="module")
def hydra_ctx():
    pytest.importorskip("hydra")  # the GPU image has no hydra-core
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS / "multiplier"), version_base="1.3"):
        yield


def _compose(name, *overrides):
    from hydra import compose

    return compose(config_name=name, overrides=list(overrides))


def test_every_config_resolves():
    files = sorted(p.stem for p in (CONFIGS / "multiplier").glob("*.yaml"))
    assert len([f for f in files if f.startswith("mul8")]) == 50
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf

    for stem in files:  # OmegaConf.load: what Hydra composes for the group, without its overhead
        cfg = OmegaConf.load(CONFIGS / "multiplier" / f"{stem}.yaml")
        if stem in ("file", "named"):
            assert "needs" in _err(resolve, cfg)
            continue
        m = resolve(cfg)
        assert m.lut.shape == (256, 256) and m.lut.dtype == torch.int32
        if stem.startswith("mul8"):
            assert m.name == stem and m.signed == stem.startswith("mul8s")
    assert resolve(OmegaConf.load(CONFIGS / "multiplier" / "exact.yaml")).name == "exact_s"
    assert resolve(OmegaConf.load(CONFIGS / "multiplier" / "exact_unsigned.yaml")).name == "exact_u"


def test_family_override_from_config(hydra_ctx):
    m = resolve(_compose("drum", "k=6"))
    assert m.name == "drum6_s" and m.params == {"family": "drum", "k": 6}
    assert resolve(_compose("bam", "hbl=2", "vbl=6", "signed=false")).name == "bam_h2v6_u"


def test_file_config(tmp_path, hydra_ctx):
    save_table(get("mul8s_1KVQ"), tmp_path / "mine.txt.gz")
    m = resolve(_compose("file", f"path={tmp_path / 'mine.txt.gz'}"))
    assert m.name == "mine" and m.sha256 == get("mul8s_1KVQ").sha256
    assert "no such file" in _err(resolve, {"name": "file", "path": str(tmp_path / "nope.txt")})


def test_named_config_and_aliases(hydra_ctx):
    assert resolve(_compose("named", "name=mitchell_u")).name == "mitchell_u"
    assert resolve("exact").name == "exact_s"
    assert resolve({"name": "exact_unsigned"}).signed is False


def test_unknown_name_lists_close_matches():
    msg = _err(resolve, {"name": "mul8s_1L2K"})
    assert "unknown multiplier 'mul8s_1L2K'" in msg and "mul8s_1L2J" in msg


def test_spec_errors():
    assert "is unsigned" in _err(resolve, {"name": "mul8u_T83", "signed": True})
    assert "unknown key(s) k" in _err(resolve, {"name": "mul8s_1L2J", "k": 3})
    assert "needs a name" in _err(resolve, {})
    assert "signed must be" in _err(resolve, {"family": "drum", "k": 4, "signed": "yes"})
    assert "must be a name or a mapping" in _err(resolve, 42)


def test_per_layer_assignment(hydra_ctx):
    cfg = _compose("mul8s_1L2J", "+layers={conv1: {name: mul8s_1KV6}, fc3: {family: drum, k: 5}}")
    got = resolve_per_layer(cfg, ["conv1", "conv2", "fc1", "fc2", "fc3"])
    assert got["conv1"].name == "mul8s_1KV6" and got["fc3"].name == "drum5_s"
    assert got["conv2"].name == got["fc1"].name == got["fc2"].name == "mul8s_1L2J"
    assert resolve(cfg).name == "mul8s_1L2J"  # resolve ignores layers
    assert resolve_per_layer({"name": "exact", "layers": {"fc1": "mitchell_s"}}, ["fc1"])["fc1"].name == "mitchell_s"
    msg = _err(resolve_per_layer, {"name": "exact", "layers": {"conv9": {"name": "exact"}}}, ["conv1", "fc3"])
    assert "conv9" in msg and "conv1, fc3" in msg


def test_import_registers_in_user_dir(tmp_path, home, approx_signed):
    save_table(approx_signed, tmp_path / "t.npy")
    m = import_table(tmp_path / "t.npy", "my_mul")
    assert user_dir() == home / "multipliers" and (home / "multipliers" / "my_mul.json").is_file()
    assert [p.name for p in user_dir().glob("my_mul.*.txt.gz")] == [f"my_mul.{m.sha256[:16]}.txt.gz"]
    assert "my_mul" in list_multipliers()
    again = resolve({"name": "my_mul"})
    assert again.sha256 == m.sha256 == approx_signed.sha256 and again.signed
    assert "already imported" in _err(import_table, tmp_path / "t.npy", "my_mul")
    save_table(get("mul8s_1L2J"), tmp_path / "other.npy")
    import_table(tmp_path / "other.npy", "my_mul", force=True)
    assert get("my_mul").sha256 == get("mul8s_1L2J").sha256
    assert len(list(user_dir().glob("my_mul.*.txt.gz"))) == 1      # the replaced table is removed


def test_import_name_rules(tmp_path):
    save_table(get("exact_s"), tmp_path / "e.txt")
    assert "taken" in _err(import_table, tmp_path / "e.txt", "mul8s_1L2J")
    assert "taken" in _err(import_table, tmp_path / "e.txt", "drum4_s")
    assert "invalid name" in _err(import_table, tmp_path / "e.txt", "../evil")


def test_import_detects_transposed_shipped_table(tmp_path):
    m = get("mul8s_1KVM")
    assert not torch.equal(m.lut, m.lut.T)
    np.save(tmp_path / "t.npy", m.lut.numpy().T)
    assert "mul8s_1KVM transposed" in _err(import_table, tmp_path / "t.npy", "kvm")
    back = import_table(tmp_path / "t.npy", "kvm", transpose=True)
    assert back.sha256 == m.sha256 and "identical to shipped mul8s_1KVM" in back.params["layout_note"]


def test_import_tampered_entry_detected(tmp_path, approx_signed):
    save_table(approx_signed, tmp_path / "t.txt")
    m = import_table(tmp_path / "t.txt", "tamper")
    save_table(get("exact_s"), user_dir() / f"tamper.{m.sha256[:16]}.txt.gz")
    assert "sha256 mismatch" in _err(get, "tamper")
