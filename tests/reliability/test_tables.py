"""Tables whose values do not decide their layout, symmetric tables, and a `lut import` killed at any
moment: the store holds the old table or the new one, whole."""
import os
import signal
import time

import numpy as np
import pytest

from runner.errors import UserError
from runner.multipliers import get, import_table, load_table, save_table
from tests.reliability.conftest import assert_clean_exit, finish, run, start


def _write(path, table):
    np.save(path, np.asarray(table, dtype=np.int32))
    return path


@pytest.mark.parametrize("table", [np.zeros((256, 256)), np.full((256, 256), 7), np.eye(256) * 100])
def test_undecidable_table_is_refused_naming_the_flags(tmp_path, table):
    path = _write(tmp_path / "t.npy", table)
    with pytest.raises(UserError, match="signed and an unsigned multiplier alike.*--signed.*--unsigned"):
        load_table(path)
    with pytest.raises(UserError, match="--signed.*--unsigned"):
        import_table(path, "t")
    assert load_table(path, signed=False).signed is False


def test_declared_signedness_is_taken_for_an_undecidable_table(tmp_path):
    path = _write(tmp_path / "t.npy", np.zeros((256, 256)))
    assert load_table(path, signed=False).signed is False and load_table(path, signed=True).signed is True
    assert import_table(path, "z", signed=False).signed is False


@pytest.mark.parametrize("prefix, signed", [("mul8u_", False), ("mul8s_", True)])
def test_file_name_convention_decides_and_says_so(tmp_path, prefix, signed):
    path = _write(tmp_path / f"{prefix}zero.npy", np.zeros((256, 256)))
    m = load_table(path)
    assert m.signed is signed
    assert f"{prefix}*) from the file name" in m.params["layout_note"]
    # a table whose values decide is read from the values, whatever its name says
    values = get("mul8u_2V0").lut.numpy()
    assert load_table(_write(tmp_path / "mul8s_looks_signed.npy", values)).signed is False


def test_values_still_decide_ordinary_tables(tmp_path):
    for name in ("mul8s_1L2J", "mul8u_T83", "drum4_u", "mitchell_s"):
        m = get(name)
        assert load_table(save_table(m, tmp_path / "anon.npy")).signed == m.signed, name
    a = np.arange(256)
    half = np.outer(a, a) // 2                    # every value fits int16, still clearly unsigned
    assert load_table(_write(tmp_path / "h.npy", half)).signed is False


def test_symmetric_tables_say_transpose_cannot_matter(tmp_path, capsys):
    from runner.multipliers.cli import main

    sym = save_table(get("mitchell_s"), tmp_path / "sym.txt")
    assert "symmetric" in load_table(sym).params["layout_note"]
    asym = save_table(get("mul8s_1KVM"), tmp_path / "asym.txt")
    assert "symmetric" not in load_table(asym).params["layout_note"]
    assert main(["import", str(sym), "--name", "s", "--transpose"]) == 0
    assert "--transpose changes nothing" in capsys.readouterr().out


@pytest.mark.processes
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_lut_import_killed_leaves_old_or_new_table_whole(tmp_path, home, sig):
    """SIGINT or SIGKILL `lut import --force` at spread-out moments of its run (most of which is start-up,
    so the moments are drawn from the last part of a measured full run); after each signal the entry reads
    back whole as one of the two tables, and no stray entry appears. Ctrl-C also exits 130 with the
    resume hint, never a traceback."""
    a = save_table(get("mul8s_1L2J"), tmp_path / "a.txt")
    b = save_table(get("mul8s_1KVM"), tmp_path / "b.txt")
    valid = {get("mul8s_1L2J").sha256, get("mul8s_1KVM").sha256}
    t0 = time.perf_counter()
    assert run("lut", "import", str(a), "--name", "mine")[0] == 0
    full = time.perf_counter() - t0
    rng = np.random.default_rng(int(sig))
    for i in range(4):
        p = start("lut", "import", str(b if i % 2 == 0 else a), "--name", "mine", "--force")
        time.sleep(full * float(rng.uniform(0.6, 1.0)))
        if p.poll() is None:
            os.killpg(p.pid, sig)
        rc, out = finish(p)
        if rc != 0:  # 0: it had finished before the signal came
            if sig == signal.SIGINT:
                assert_clean_exit(rc, out, 130)
                assert "interrupted: finished results are kept" in out
            else:
                assert rc == -signal.SIGKILL, out
        assert get("mine").sha256 in valid
    assert sorted(p.name for p in (home / "multipliers").glob("*.json")) == ["mine.json"]
