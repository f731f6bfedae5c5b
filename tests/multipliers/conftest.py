import numpy as np
import pytest

from runner.multipliers import Multiplier, exact_table


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """Keep user imports out of the real ~/.approx-run."""
    d = tmp_path / "home"
    monkeypatch.setenv("APPROX_RUN_HOME", str(d))
    return d


@pytest.fixture
def approx_signed():
    """A signed non-commutative table: exact plus an error depending on both operands."""
    t = exact_table(True)
    a = np.arange(256) - 128
    err = (a[:, None] % 4) - (a[None, :] % 3)
    return Multiplier("t_s", True, (t + err).astype(np.int32))
