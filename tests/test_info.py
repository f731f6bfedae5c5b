"""`approx-run info`'s checks that need no subprocess (the command itself: tests/test_cli.py)."""
import importlib.util
from pathlib import Path

from runner.info import bytecode_state


def test_bytecode_state(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("x = 1\n")
    assert "not cached, not written" in bytecode_state(str(source), dont_write=True)
    assert bytecode_state(str(source), dont_write=False).startswith("not cached yet")
    cached = Path(importlib.util.cache_from_source(str(source)))
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(b"")
    assert bytecode_state(str(source), dont_write=True) == "cached"
