"""TFApprox .bin and C-header tables: import, `lut export` in all four formats, bad files."""

import numpy as np
import pytest

from runner.multipliers import get, load_table
from runner.multipliers.cli import main
from runner.multipliers.io import raw_bytes_to_offset128
from runner.multipliers.peers import export, header_text
from runner.multipliers.registry import user_names


def _refused(capsys, *argv, match):
    assert main(list(map(str, argv))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err, err
    assert user_names() == []


@pytest.mark.parametrize("fmt, suffix", [("txt", ".txt"), ("txt", ".txt.gz"), ("npy", ".npy"), ("bin", ".bin"),
                                         ("h", ".h")])
@pytest.mark.parametrize("name", ["mul8s_1KVM", "mul8u_17MN", "mul8u_ZB3", "approx"])
def test_export_round_trips(tmp_path, approx_signed, fmt, suffix, name):
    # 1KVM is not commutative; 17MN has an MAE of 8 %; approx is signed without a mul8s_ name
    m = approx_signed if name == "approx" else get(name)
    out = export(m, fmt, tmp_path / f"{m.name}{suffix}")
    back = load_table(out)
    assert back.signed == m.signed and back.sha256 == m.sha256


def test_export_cli_then_import(tmp_path, capsys):
    out = tmp_path / "kvm.h"
    assert main(["export", "mul8s_1KVM", "--format", "h", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["import", str(out), "--name", "kvm", "--signed"]) == 0
    assert "raw two's-complement byte order" in capsys.readouterr().out
    assert get("kvm").sha256 == get("mul8s_1KVM").sha256


def test_bin_layout_is_tfapprox(tmp_path):
    """Entry a*256 + b, little-endian uint16; a signed product as its 16-bit pattern at raw byte codes."""
    u = get("mul8u_17C8")
    raw = np.frombuffer(export(u, "bin", tmp_path / "u.bin").read_bytes(), dtype="<u2")
    assert raw.size == 65536 and raw[3 * 256 + 200] == u.product(3, 200)
    s = get("mul8s_1KVM")
    raw = np.frombuffer(export(s, "bin", tmp_path / "s.bin").read_bytes(), dtype="<u2")
    assert raw[(-3 & 0xFF) * 256 + 5] == s.product(-3, 5) & 0xFFFF
    assert raw[7 * 256 + (-100 & 0xFF)] == s.product(7, -100) & 0xFFFF


def test_header_from_another_tool(tmp_path):
    """An AdaPT-style header: guards, a comment, `const int16_t` in raw byte order, hex and negative values."""
    a = np.arange(256)
    codes = np.where(a < 128, a, a - 256)
    table = np.outer(codes, codes)
    table[1, 2] += 1                                      # 1*2 -> 3: an approximate multiplier
    rows = ",\n".join("{" + ", ".join(hex(v) if v >= 0 else str(v) for v in r) + "}" for r in table.tolist())
    text = f"#ifndef LUT_H\n#define LUT_H\n/* made elsewhere */\nconst int16_t lut[256][256] = {{\n{rows}\n}};\n#endif\n"
    (tmp_path / "lut.h").write_text(text)
    m = load_table(tmp_path / "lut.h")
    assert m.signed and m.params["layout"] == "raw_bytes"
    assert m.product(1, 2) == 3 and m.product(-128, -128) == 16384 and m.product(5, -7) == -35
    assert np.array_equal(m.lut.numpy(), raw_bytes_to_offset128(table))


def test_bad_bin_and_header_files(tmp_path, capsys):
    (tmp_path / "short.bin").write_bytes(b"\0" * 131070)
    _refused(capsys, "import", tmp_path / "short.bin", match="131,070 bytes; a TFApprox table holds 65,536")
    (tmp_path / "long.bin").write_bytes(b"\0" * 131074)
    _refused(capsys, "import", tmp_path / "long.bin", match="131,074 bytes")
    good = header_text(get("mul8u_17C8"))
    (tmp_path / "shape.h").write_text(good.replace("[256][256]", "[255][256]"))
    _refused(capsys, "import", tmp_path / "shape.h", match="has shape [255][256], expected [256][256]")
    (tmp_path / "row.h").write_text(good.replace("{0, 0, 0, ", "{0, 0, ", 1))
    _refused(capsys, "import", tmp_path / "row.h", match="row 0 has 255 values")
    (tmp_path / "cut.h").write_text(good[: len(good) // 2])
    _refused(capsys, "import", tmp_path / "cut.h", match="not closed (is the file truncated?)")
    (tmp_path / "none.h").write_text("#define X 3\n")
    _refused(capsys, "import", tmp_path / "none.h", match="no array initialiser")
    (tmp_path / "two.h").write_text(good + good.replace("mul8u_17C8[", "other["))
    _refused(capsys, "import", tmp_path / "two.h", match="2 arrays")
    (tmp_path / "word.h").write_text(good.replace("{0, 0, 0, ", "{0, x, 0, ", 1))
    _refused(capsys, "import", tmp_path / "word.h", match="'x' is not an integer")
    np.save(tmp_path / "flat.npy", np.zeros(65536, dtype=np.int16))
    _refused(capsys, "import", tmp_path / "flat.npy", "--name", "flat", match="array shape (65536,)")


def test_flags_that_do_not_apply(tmp_path, capsys):
    export(get("mul8u_17C8"), "bin", tmp_path / "u.bin")
    _refused(capsys, "import", tmp_path / "u.bin", "--activation-operand", "A", match="applies to circuits")
    _refused(capsys, "export", "mul8u_17C8", "--format", "txt", "--out", tmp_path / "x.csv", match="ends in .txt")


def test_unsigned_header_of_a_signed_table(tmp_path):
    """A uint16_t array holding a signed multiplier's products as bit patterns, told by --signed or the name."""
    s = get("mul8s_1KVM")
    raw = raw_bytes_to_offset128(s.lut.numpy().astype(np.int64)) & 0xFFFF
    rows = ",\n".join("{" + ", ".join(map(str, r)) + "}" for r in raw.tolist())
    (tmp_path / "mul8s_pat.h").write_text(f"static const uint16_t t[256][256] = {{\n{rows}\n}};\n")
    m = load_table(tmp_path / "mul8s_pat.h")
    assert m.sha256 == s.sha256
    assert "two's-complement" in " ".join(m.params["notes"])
