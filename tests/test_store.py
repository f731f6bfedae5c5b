"""The results store: appends under a lock, resume keys, and damaged files reported, never rewritten."""
import subprocess
import sys
import threading

import numpy as np
import pandas as pd
import pytest

from runner.errors import UserError
from runner.store import append_rows, done_keys, locked, read_csv, read_rows, write_csv


def test_append_skips_recorded_ok_keeps_failed(tmp_path):
    path = tmp_path / "r.csv"
    assert len(append_rows(path, [{"row_key": "a", "status": "ok", "v": 1}], skip_recorded=True)) == 1
    added = append_rows(path, [{"row_key": "a", "status": "ok", "v": 2}, {"row_key": "", "status": "failed"},
                               {"row_key": "b", "status": "ok", "v": 3}], skip_recorded=True)
    assert [r["status"] for r in added] == ["failed", "ok"]
    df = read_csv(path)
    assert df["row_key"].fillna("").tolist() == ["a", "", "b"] and df["v"].tolist()[0] == 1
    assert done_keys(path) == {"a", "b"}


def test_new_columns_widen_the_table(tmp_path):
    path = tmp_path / "r.csv"
    append_rows(path, [{"row_key": "a", "status": "ok", "accuracy": 0.5}])
    append_rows(path, [{"row_key": "b", "status": "ok", "latency_ms_median": 2.0, "accuracy": 0.25}])
    df = read_csv(path)
    assert df["accuracy"].tolist() == [0.5, 0.25]
    assert pd.isna(df["latency_ms_median"][0]) and df["latency_ms_median"][1] == 2.0


def test_threads_appending_at_once_lose_nothing(tmp_path):
    path = tmp_path / "r.csv"

    def work(t):
        for i in range(10):
            append_rows(path, [{"row_key": f"{t}-{i}", "status": "ok"}], skip_recorded=True)
            append_rows(path, [{"row_key": "shared", "status": "ok"}], skip_recorded=True)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = read_csv(path)["row_key"].tolist()
    assert sorted(keys) == sorted([f"{t}-{i}" for t in range(4) for i in range(10)] + ["shared"])


def test_lock_timeout_is_a_user_error(tmp_path):
    path = tmp_path / "r.csv"
    held = threading.Event()
    release = threading.Event()

    def holder():
        with locked(path):
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    try:
        # filelock is re-entrant per object, not per path: a second FileLock on the path must wait
        with pytest.raises(UserError, match="could not lock .* within 0 s"):
            with locked(path, timeout=0.2):
                pass
    finally:
        release.set()
        t.join()


GOOD = "row_key,status,accuracy\na,ok,0.5\nb,ok,0.25\n"


@pytest.mark.parametrize("text, message", [
    (GOOD + "c,ok,0.1", "last line is cut off"),                       # the writer or a copy died mid-line
    (GOOD + 'c,failed,"Traceback', "last line is cut off"),
    (GOOD + "c,ok,0.1,extra,fields\n", "record 4 has 5 fields where the header has 3"),
    (GOOD + "c,ok\n", "record 4 has 2 fields"),
])
def test_damaged_file_is_reported_and_left_alone(tmp_path, text, message):
    path = tmp_path / "results.csv"
    path.write_text(text)
    for call in (lambda: read_csv(path), lambda: done_keys(path),
                 lambda: append_rows(path, [{"row_key": "d", "status": "ok", "accuracy": 1.0}])):
        with pytest.raises(UserError, match=message) as info:
            call()
        assert str(path) in str(info.value) and "mv " in str(info.value)
    assert path.read_text() == text


def test_file_of_an_older_version_is_not_appended_to(tmp_path):
    path = tmp_path / "results.csv"
    text = "multiplier,accuracy\nexact,0.97\nmul8s_1L2J,0.96\n"      # no row_key / status: resume cannot work
    path.write_text(text)
    assert len(read_csv(path)) == 2                                  # still readable as a report source
    with pytest.raises(UserError, match="no row_key / status column.*older approx-run"):
        append_rows(path, [{"row_key": "d", "status": "ok"}])
    assert path.read_text() == text


def test_quoted_newlines_are_not_damage(tmp_path):
    path = tmp_path / "results.csv"
    append_rows(path, [{"row_key": "", "status": "failed", "error": "line one\nline two, with a comma"}])
    append_rows(path, [{"row_key": "a", "status": "ok"}])
    assert read_csv(path)["error"][0] == "line one\nline two, with a comma"


def test_missing_file_reads_empty(tmp_path):
    path = tmp_path / "none.csv"
    assert read_csv(path).empty and read_rows(path) == [] and done_keys(path) == set()


ROWS = [{"row_key": "a", "status": "ok", "accuracy": 0.1 + 0.2, "small": 1e-7, "n": 3, "flag": True,
         "missing": None, "nan": float("nan"), "text": 'say "hi", then\na new line'},
        {"row_key": "b", "status": "failed", "accuracy": np.float32(0.5), "n": 4, "extra": "late column"}]


def test_rows_are_written_as_pandas_writes_them(tmp_path):
    """Appending writes the text itself (no pandas on the sweep's path): the file must read back as if
    pandas had written it, widened columns included."""
    path = tmp_path / "r.csv"
    append_rows(path, ROWS[:1])
    append_rows(path, ROWS[1:])
    frame = pd.DataFrame(ROWS)
    assert path.read_text() == frame.to_csv(index=False)
    write_csv(tmp_path / "w.csv", ROWS)
    assert (tmp_path / "w.csv").read_text() == frame.to_csv(index=False)
    rows = read_rows(path)
    assert rows[0]["accuracy"] == repr(0.1 + 0.2) and rows[0]["nan"] == "" and rows[0]["extra"] == ""
    assert rows[0]["text"] == ROWS[0]["text"] and rows[1]["accuracy"] == "0.5"
    assert read_csv(path)["accuracy"].tolist() == [0.1 + 0.2, 0.5]


def test_the_sweep_path_does_not_import_pandas():
    """pandas takes 0.4 s to import on the GPU hosts, a tenth of a whole sweep there."""
    code = ("import sys, runner.sweep, runner.compare, runner.store, runner.train, runner.finetune; "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_keys_of_digits_stay_text(tmp_path):
    """A row key is 16 hex digits; one of digits alone must keep its leading zero and match again."""
    path = tmp_path / "r.csv"
    append_rows(path, [{"row_key": "0123456789012345", "status": "ok", "accuracy": 0.5}])
    assert read_csv(path)["row_key"].tolist() == ["0123456789012345"]
    assert done_keys(path) == {"0123456789012345"}
