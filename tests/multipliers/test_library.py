"""The shipped EvoApproxLib tables against the library's circuit files (skipped where the sources are absent)."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from runner.multipliers import get, manifest
from runner.multipliers.build_library import REQUIRED, build
from runner.multipliers.circuits import compare_published, load_circuit
from runner.multipliers.core import table_sha256
from runner.multipliers.registry import DATA

# the library as distributed, beside the checkout (../shared/evoapprox/v2022) or beside a worktree's parent
_ROOT = Path(__file__).resolve().parents[2]
SOURCES = next((p for p in (_ROOT.parent / "shared", _ROOT.parents[1] / "shared") if p.is_dir()), _ROOT.parent / "shared")
SOURCES = SOURCES / "evoapprox" / "v2022"
CIRCUITS = sorted(p.stem for p in SOURCES.glob("mul8*.c")) if SOURCES.is_dir() else []
ENTRIES = {e["name"]: e for e in manifest()["multipliers"]}
needs_sources = pytest.mark.skipif(not CIRCUITS, reason=f"EvoApproxLib sources not at {SOURCES}")


@needs_sources
def test_every_circuit_ships():
    assert len(CIRCUITS) == 50 and sorted(ENTRIES) == CIRCUITS


@needs_sources
@pytest.mark.parametrize("name", CIRCUITS)
def test_circuit_c_and_v_give_the_shipped_table(name):
    c, v = SOURCES / f"{name}.c", SOURCES / f"{name}.v"
    from_c, from_v = load_circuit(c), load_circuit(v)        # no flags: order, signedness, figures from the files
    assert from_c.signed == from_v.signed == name.startswith("mul8s_")
    assert np.array_equal(from_c.values, from_v.values)
    e = ENTRIES[name]
    assert table_sha256(from_c.values) == e["sha256"] == get(name).sha256
    assert hashlib.sha256(c.read_bytes()).hexdigest() == e["c_sha256"]
    assert hashlib.sha256(v.read_bytes()).hexdigest() == e["v_sha256"]
    ok, bad = compare_published(from_c.values, from_c.signed, from_c.published)
    assert set(REQUIRED) <= set(ok), bad
    assert from_c.published["pwr"] == e["published"]["pwr"] and "area" in from_v.published
    # one circuit in well under a second on the 2-core machine (the 50 take 0.01-0.2 s each there)
    assert from_c.seconds < 1.0 and from_v.seconds < 1.0


@needs_sources
def test_rebuild_reproduces_package_data(tmp_path):
    """The rebuild script gives byte-identical package data (three circuits, to stay quick)."""
    src = tmp_path / "src"
    src.mkdir()
    names = ["mul8s_1L2J", "mul8u_0AB", "mul8u_17MN"]
    for n in names:
        for ext in (".c", ".v"):
            shutil.copy(SOURCES / f"{n}{ext}", src)
    build(src, data=tmp_path / "data", configs=tmp_path / "configs")
    cfg_dir = Path(__file__).resolve().parents[2] / "configs" / "multiplier"
    built = {e["name"]: e for e in json.loads((tmp_path / "data" / "manifest.json").read_text())["multipliers"]}
    for n in names:
        assert (tmp_path / "data" / f"{n}.txt.gz").read_bytes() == (DATA / f"{n}.txt.gz").read_bytes()
        assert built[n] == ENTRIES[n]
        assert (tmp_path / "configs" / f"{n}.yaml").read_text() == (cfg_dir / f"{n}.yaml").read_text()


@needs_sources
def test_cli_import_with_no_flags(capsys):
    from runner.multipliers.cli import main
    from runner.multipliers.registry import user_names

    for ext in (".c", ".v"):
        assert main(["import", str(SOURCES / f"mul8u_0AB{ext}")]) == 0
        out = capsys.readouterr().out
        assert "checked mul8u_0AB (unsigned)" in out and "header figures reproduced: MAE%, WCE%, EP%" in out
        assert "identical to the shipped table mul8u_0AB" in out and "MISMATCH" not in out
    assert user_names() == []
    assert main(["import", str(SOURCES / "mul8s_1KVQ.v"), "--name", "kvq"]) == 0
    out = capsys.readouterr().out
    assert "MISMATCH with the header: MAE published 36, computed 36.5352" in out
    assert get("kvq").sha256 == get("mul8s_1KVQ").sha256 and get("kvq").published["pwr"] == "0.351"
