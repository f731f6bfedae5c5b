import gzip

import numpy as np
import pytest
import torch

from runner.errors import UserError
from runner.multipliers import Multiplier, exact_table, get, load_table, metrics_of, save_table, table_sha256
from runner.multipliers.io import raw_bytes_to_offset128


@pytest.mark.parametrize("suffix", [".txt", ".txt.gz", ".npy"])
@pytest.mark.parametrize("name", ["mul8s_1KVP", "mul8u_NLX", "drum4_s"])
def test_round_trip(tmp_path, suffix, name):
    m = get(name)
    p = save_table(m, tmp_path / f"t{suffix}")
    back = load_table(p, signed=m.signed)
    assert back.signed == m.signed
    assert torch.equal(back.lut, m.lut) and back.lut.dtype == torch.int32
    assert back.sha256 == m.sha256
    assert load_table(p).signed == m.signed  # signedness inferred from the values


def test_text_format_is_approxtorch(tmp_path):
    m = get("exact_s")
    lines = save_table(m, tmp_path / "e.txt").read_text().splitlines()
    assert len(lines) == 256
    first = [int(v) for v in lines[0].split()]
    assert first[0] == 16384 and first[128] == 0 and first[255] == -128 * 127
    assert int(lines[129].split()[130]) == 1 * 2  # row = A + 128, column = B + 128


def test_sha256_definition(approx_signed):
    import hashlib
    expect = hashlib.sha256(approx_signed.lut.numpy().astype("<i4").tobytes()).hexdigest()
    assert approx_signed.sha256 == expect == table_sha256(approx_signed.lut)


def test_comments_and_blank_lines_ignored(tmp_path):
    rows = exact_table(False)
    text = "# exact unsigned\n\n" + "\n".join(" ".join(map(str, r)) for r in rows) + "\n\n"
    (tmp_path / "u.txt").write_text(text)
    assert load_table(tmp_path / "u.txt").sha256 == get("exact_u").sha256


def _write(tmp_path, rows, name="bad.txt"):
    p = tmp_path / name
    p.write_text("\n".join(" ".join(map(str, r)) for r in rows) + "\n")
    return p


def _err(fn, *args, **kw):
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    return str(e.value)


def test_empty_file(tmp_path):
    (tmp_path / "e.txt").write_text("")
    assert "empty file" in _err(load_table, tmp_path / "e.txt")


def test_too_few_rows(tmp_path):
    p = _write(tmp_path, exact_table(True)[:200])
    msg = _err(load_table, p)
    assert str(p) in msg and "200 rows, expected 256" in msg


def test_too_many_rows(tmp_path):
    p = _write(tmp_path, np.vstack([exact_table(True), exact_table(True)[:1]]))
    assert f"{p}, line 257: more than 256 rows" in _err(load_table, p)


def test_short_row_names_line(tmp_path):
    rows = [list(r) for r in exact_table(True)]
    rows[11] = rows[11][:255]
    p = _write(tmp_path, rows)
    assert f"{p}, line 12: 255 values, expected 256" in _err(load_table, p)


def test_non_integer_names_line_and_column(tmp_path):
    rows = [list(map(str, r)) for r in exact_table(True)]
    rows[2][16] = "1.5"
    p = _write(tmp_path, rows)
    assert f"{p}, line 3, column 17: '1.5' is not an integer" in _err(load_table, p)


@pytest.mark.parametrize("token, says", [
    ("1e3", "column 17: '1e3' is not an integer"), ("0x10", "column 17: '0x10' is not an integer"),
    ("99999999999999999999", "line 3: value too large"), ("-99999999999999999999", "line 3: value too large"),
    ("\u0663", "not plain decimal integers")])
def test_tokens_the_fast_parser_cannot_read_are_named(tmp_path, token, says):
    rows = [list(map(str, r)) for r in exact_table(True)]
    rows[2][16] = token
    p = _write(tmp_path, rows)
    assert says in _err(load_table, p)


def test_fast_parser_reads_tabs_and_signs_as_the_tokens_say():
    from runner.multipliers.io import parse_text

    table = exact_table(True)
    text = "\n".join("\t".join(f"+{v}" if v > 0 else str(v) for v in row) for row in table)
    assert np.array_equal(parse_text(text, "t")[0], table)


def test_value_out_of_range(tmp_path):
    rows = exact_table(False).copy()
    rows[4, 8] = 70000
    p = _write(tmp_path, rows)
    msg = _err(load_table, p)
    assert f"{p}, line 5, column 9: value 70000 outside" in msg


def test_value_out_of_signed_range(tmp_path):
    rows = exact_table(True).copy()
    rows[0, 0] = 40000  # fine for uint16, not for a signed product
    p = _write(tmp_path, rows)
    assert "line 1, column 1: value 40000 outside the product range [-32768, 32767]" in _err(load_table, p, signed=True)


def test_npy_errors(tmp_path):
    np.save(tmp_path / "shape.npy", np.zeros((255, 256), np.int32))
    assert "shape (255, 256)" in _err(load_table, tmp_path / "shape.npy")
    f = exact_table(True).astype(np.float64)
    f[3, 4] = 0.5
    np.save(tmp_path / "frac.npy", f)
    assert "element [3, 4] = 0.5 is not an integer" in _err(load_table, tmp_path / "frac.npy")
    np.save(tmp_path / "str.npy", np.full((256, 256), "x"))
    assert "expected integers" in _err(load_table, tmp_path / "str.npy")
    np.save(tmp_path / "ok.npy", exact_table(True).astype(np.float32))  # integral floats are fine
    assert load_table(tmp_path / "ok.npy").sha256 == get("exact_s").sha256


def test_bad_gzip_missing_file_and_suffix(tmp_path):
    (tmp_path / "x.txt.gz").write_bytes(b"not gzip at all")
    assert "not a readable gzip file" in _err(load_table, tmp_path / "x.txt.gz")
    assert "no such file" in _err(load_table, tmp_path / "missing.txt")
    (tmp_path / "t.csv").write_text("1,2")
    assert "unsupported table format" in _err(load_table, tmp_path / "t.csv")


def test_raw_byte_order_detected_and_converted(tmp_path, approx_signed):
    raw = np.roll(approx_signed.lut.numpy(), (-128, -128), axis=(0, 1))  # row = A & 0xFF
    assert np.array_equal(raw_bytes_to_offset128(raw), approx_signed.lut.numpy())
    np.save(tmp_path / "raw.npy", raw)
    m = load_table(tmp_path / "raw.npy")
    assert m.params["layout"] == "raw_bytes" and "converted" in m.params["layout_note"]
    assert m.sha256 == approx_signed.sha256


def test_claimed_exact_in_wrong_layout_reports_convention(tmp_path):
    raw = np.roll(exact_table(True), (-128, -128), axis=(0, 1))
    np.save(tmp_path / "exact_raw.npy", raw)
    msg = _err(load_table, tmp_path / "exact_raw.npy", layout="offset128")
    assert "claims to be exact" in msg and "raw two's-complement byte order" in msg
    m = load_table(tmp_path / "exact_raw.npy")  # auto: detected and converted
    assert m.sha256 == get("exact_s").sha256 and metrics_of(m)["ep_pct"] == 0


def test_claimed_exact_but_approximate(tmp_path):
    save_table(get("mul8s_1KV8"), tmp_path / "my_exact.txt")
    assert "exact in no known layout" in _err(load_table, tmp_path / "my_exact.txt")


def test_signedness_contradiction(tmp_path):
    save_table(get("mul8u_NLX"), tmp_path / "u.txt")
    msg = _err(load_table, tmp_path / "u.txt", signed=True)
    assert "declared signed" in msg and "--unsigned" in msg


def test_noise_matches_no_layout(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "noise.npy", rng.integers(-32768, 32767, (256, 256)))
    assert "matches none of the known layouts" in _err(load_table, tmp_path / "noise.npy")


def test_multiplier_validates_shape():
    with pytest.raises(ValueError):
        Multiplier("x", True, torch.zeros(255, 256, dtype=torch.int32))


def test_saved_gzip_is_reproducible(tmp_path):
    m = get("mul8s_1L12")
    a = save_table(m, tmp_path / "a.txt.gz").read_bytes()
    b = save_table(m, tmp_path / "b.txt.gz").read_bytes()
    assert a == b and gzip.decompress(a).decode().count("\n") == 256
