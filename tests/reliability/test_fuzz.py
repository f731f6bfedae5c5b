"""Fuzzing the parsers of files users hand the tool (hypothesis, time-bounded): multiplier tables (txt,
txt.gz, npy), IDX data files and the CSV sources of `approx-run results`. Whatever the bytes, the
outcome is a parsed object or a UserError naming the file, never another exception or a hang."""
import gzip
import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.data import read_idx
from runner.errors import UserError
from runner.multipliers import get, load_table, save_table
from runner.report import load_results
from runner.store import read_csv

# every example must finish well within the deadline (a hang fails the test), and the whole module in
# seconds: few, varied examples per parser
FUZZ = settings(max_examples=200, deadline=3000, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _clean(fn, path):
    """fn(path) returns or raises UserError mentioning the file."""
    try:
        return fn(path)
    except UserError as exc:
        assert path.name in str(exc), str(exc)
        return None


def _mutate(data, blob: bytes) -> bytes:
    """A few edits of a valid file: truncation, byte overwrites, an insertion, a deleted span."""
    for _ in range(data.draw(st.integers(1, 3))):
        op = data.draw(st.sampled_from(["truncate", "overwrite", "insert", "delete"]))
        at = data.draw(st.integers(0, max(0, len(blob) - 1)))
        if op == "truncate":
            blob = blob[:at]
        elif op == "overwrite":
            junk = data.draw(st.binary(min_size=1, max_size=8))
            blob = blob[:at] + junk + blob[at + len(junk):]
        elif op == "insert":
            blob = blob[:at] + data.draw(st.sampled_from([b"\n", b" ", b"-", b"x", b"99999999999", b"\x00",
                                                          b"1.5", b"#", b"\xff\xfe"])) + blob[at:]
        else:
            blob = blob[:at] + blob[at + data.draw(st.integers(1, 600)):]
    return blob


_TABLES: dict[str, bytes] = {}


def _table_file(suffix: str, tmp_path) -> bytes:
    """A valid file of mul8s_1L2J in each format (made once; not a fixture, which hypothesis would print)."""
    if suffix not in _TABLES:
        _TABLES[suffix] = save_table(get("mul8s_1L2J"), tmp_path / f"valid{suffix}").read_bytes()
    return _TABLES[suffix]


@pytest.mark.parametrize("suffix", [".txt", ".txt.gz", ".npy"])
@FUZZ
@given(data=st.data())
def test_table_parsers(tmp_path, suffix, data):
    blob = _table_file(suffix, tmp_path)
    if suffix == ".txt.gz" and data.draw(st.booleans()):   # damage the text inside a whole gzip stream
        blob = gzip.compress(_mutate(data, gzip.decompress(blob)), mtime=0)
    else:
        blob = _mutate(data, blob)
    path = tmp_path / f"fuzz{suffix}"
    path.write_bytes(blob)
    signed = data.draw(st.sampled_from([None, True, False]))
    m = _clean(lambda p: load_table(p, signed), path)
    if m is not None:
        assert tuple(m.lut.shape) == (256, 256)


def _filled(value, dtype) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):      # nan/inf cast to an integer dtype on purpose
        return np.full((256, 256), value).astype(dtype)


@FUZZ
@given(arr=st.one_of(
    st.builds(lambda v, dt: _filled(v, dt),
              st.one_of(st.integers(-70000, 70000), st.floats(allow_nan=True, allow_infinity=True)),
              st.sampled_from(["int8", "uint16", "int32", "int64", "float32", "float64", "bool", "complex64"])),
    st.builds(lambda shape: np.zeros(shape, dtype=np.int32),
              st.lists(st.integers(0, 300), min_size=0, max_size=3).map(tuple)),
))
def test_npy_arrays_of_any_dtype_and_shape(tmp_path, arr):
    path = tmp_path / "a.npy"
    np.save(path, arr)
    _clean(load_table, path)


def _idx(dims, payload: bytes) -> bytes:
    return bytes([0, 0, 8, len(dims)]) + b"".join(int(d).to_bytes(4, "big") for d in dims) + payload


@FUZZ
@given(data=st.data())
def test_idx_reader(tmp_path, data):
    dims = data.draw(st.lists(st.integers(0, 12), min_size=0, max_size=3))
    blob = _idx(dims, bytes(int(np.prod(dims)) if dims else 0))
    if data.draw(st.booleans()):
        blob = _mutate(data, blob)
    if data.draw(st.booleans()):                                   # absurd dimensions: no allocation, an error
        blob = _idx([2**32 - 1] * 3, b"")
    gz = data.draw(st.booleans())
    path = tmp_path / ("f-idx3-ubyte.gz" if gz else "f-idx3-ubyte")
    if gz and data.draw(st.booleans()):
        blob = gzip.compress(blob, mtime=0)
        if data.draw(st.booleans()):
            blob = _mutate(data, blob)                             # a damaged gzip stream
    path.write_bytes(blob)
    arr = _clean(read_idx, path)
    if arr is not None:
        assert arr.dtype == np.uint8 and arr.ndim >= 1


CSV = ("row_key,status,path,multiplier,accuracy,error\n"
       "a,ok,approx,mul8s_1L2J,0.97,\n"
       "b,failed,approx,bad,,\"line one\nline two\"\n"
       "c,ok,pytorch,,0.98,\n").encode()


@FUZZ
@given(data=st.data())
def test_results_csv_sources(tmp_path, data):
    path = tmp_path / "results.csv"
    path.write_bytes(_mutate(data, CSV) if data.draw(st.booleans()) else data.draw(st.binary(max_size=200)))
    _clean(read_csv, path)
    df = _clean(lambda p: load_results([str(p)]), path)
    if df is not None:
        assert len(df) >= 1
    from runner.report import main

    for argv in ([str(path), "--csv"], [str(path), "--pivot", "--markdown"]):
        try:
            with io.StringIO() as buf, __import__("contextlib").redirect_stdout(buf):
                main(argv)
        except UserError:
            pass
