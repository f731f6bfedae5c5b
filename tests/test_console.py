"""The one number format of every table, and the table renderer."""
import math

import numpy as np
import pandas as pd
import pytest

from runner.console import fmt_number, print_table


@pytest.mark.parametrize("value, text", [
    (0.9712, "0.9712"), (0.97, "0.9700"), (3.4567, "3.457"), (-2.5, "-2.500"), (0.0018, "0.001800"),
    (1129.3, "1,129"), (11290.3, "11,290"), (np.float32(0.5), "0.5000"), (0.0, "0"), (1e-12, "1.000e-12"),
    (5, "5"), (np.int64(10000), "10,000"), (True, "True"), (np.bool_(False), "False"),
    (None, ""), (math.nan, ""), (pd.NA, ""), ("mul8s_1L2J", "mul8s_1L2J"),
])
def test_fmt_number(value, text):
    assert fmt_number(value) == text


def test_table_never_uses_exponents_for_ordinary_numbers(capsys):
    rows = [{"op": "conv2", "backend": "cpp", "throughput_img_s": 11290.3, "latency_ms_median": 0.0886}]
    print_table(pd.DataFrame(rows), "bench")
    out = capsys.readouterr().out
    assert "11,290" in out and "0.08860" in out and "e+" not in out


def test_progress_lines_say_how_long_is_left(monkeypatch, capsys):
    from runner import console as con

    monkeypatch.setattr(con, "is_interactive", lambda: False)
    clock = iter(range(0, 1000, 10))  # each step 10 s
    monkeypatch.setattr(con.time, "perf_counter", lambda: float(next(clock)))
    with con.progress_bar("sensitivity: 4 evaluations", total=4) as advance:
        for _ in range(4):
            advance(1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "sensitivity: 4 evaluations: 1/4 (10.0s, about 30s left)"
    assert lines[-1] == "sensitivity: 4 evaluations: 4/4 (40.0s)"
    assert con.eta(600, 1, 10) == ", about 1.5h left" and con.eta(3, 0, 10) == ""


def test_progress_estimates_leave_the_first_steps_set_up_out(monkeypatch, capsys):
    """A command's first evaluation carries its set-up: the later lines estimate from the evaluations after it."""
    from runner import console as con

    monkeypatch.setattr(con, "is_interactive", lambda: False)
    clock = iter([0.0, 100.0, 102.0, 104.0, 106.0, 108.0])  # a 100 s first step, then 2 s each
    monkeypatch.setattr(con.time, "perf_counter", lambda: next(clock))
    with con.progress_bar("sensitivity: 5 evaluations", total=5) as advance:
        for _ in range(5):
            advance(1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "sensitivity: 5 evaluations: 1/5 (100.0s, about 7m left)"  # nothing better known yet
    assert lines[1] == "sensitivity: 5 evaluations: 2/5 (102.0s, about 6s left)"
    assert lines[3] == "sensitivity: 5 evaluations: 4/5 (106.0s, about 2s left)"
