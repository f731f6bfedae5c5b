"""A damaged results.csv (a cut-off last line, rows of another column layout, a file of an older version
without the resume columns) stops compare, sweep and results with its path and the fix, exit 2, and
is left exactly as it was: never rewritten with fewer rows."""
import pytest

from runner.store import append_rows
from tests.reliability.conftest import TINY, assert_clean_exit, outputs, run

pytestmark = pytest.mark.processes

ROWS = [{"row_key": f"k{i}", "status": "ok", "path": "approx", "multiplier": "exact_s", "accuracy": 0.9}
        for i in range(3)]


def _damage(path, how):
    append_rows(path, ROWS)
    text = path.read_text()
    if how == "truncated":
        path.write_text(text[:-7])
    elif how == "extra fields":
        path.write_text(text + "k9,ok,approx,exact_s,0.9,surplus\n")
    else:  # an older version's file: no row_key/status columns
        path.write_text("path,multiplier,accuracy\napprox,exact_s,0.9\napprox,mul8s_1L2J,0.8\n")
    return path.read_bytes()


@pytest.mark.parametrize("how, message", [("truncated", "last line is cut off"),
                                          ("extra fields", "record 5 has 6 fields"),
                                          ("older", "no row_key / status column")])
def test_damaged_results_stop_every_writer_and_stay_untouched(tmp_path, baseline, how, message):
    results = tmp_path / "results" / "results.csv"
    results.parent.mkdir()
    before = _damage(results, how)
    for argv in (["compare", *TINY, *outputs(tmp_path, baseline)],
                 ["sweep", "sweep.multipliers=[exact]", *TINY, *outputs(tmp_path, baseline)]):
        rc, out = run(*argv)
        assert_clean_exit(rc, out, 2)
        assert message in out and str(results) in out and "mv " in out, out
        assert results.read_bytes() == before
    if how != "older":  # an older file is still a readable report source
        rc, out = run("results", str(results))
        assert_clean_exit(rc, out, 2)
        assert message in out
