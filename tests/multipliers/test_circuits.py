"""The C and Verilog circuit evaluators: semantics against numpy, generality beyond EvoApproxLib's
files, and refusal of everything outside the subset (exit 2, nothing run, nothing registered)."""

import builtins
import ctypes
import os
import subprocess

import numpy as np
import pytest

from runner.errors import UserError
from runner.multipliers import bitslice as bs
from runner.multipliers import families, get, netlist
from runner.multipliers.circuits import load_circuit
from runner.multipliers.cli import main
from runner.multipliers.core import exact_table
from runner.multipliers.registry import user_names

A = np.arange(256)[:, None].repeat(256, 1)   # operand codes: row = activation, column = weight
B = A.T


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def _guard(*a, **k):
    raise AssertionError("the importer tried to compile, execute or start something")


GUARDED = ((builtins, "exec"), (builtins, "eval"), (builtins, "compile"), (os, "system"), (os, "popen"),
           (subprocess, "Popen"), (ctypes, "CDLL"))


def _import_guarded(*argv) -> int:
    """`lut import` with every way of compiling, executing or starting something made to fail the test."""
    with pytest.MonkeyPatch.context() as mp:
        for mod, attr in GUARDED:
            mp.setattr(mod, attr, _guard)
        return main(["import", *map(str, argv)])


def _refused(path, capsys, *flags, match):
    assert _import_guarded(path, *flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err, err
    assert user_names() == []
    return err


# ---------------------------------------------------------------- a circuit in another style

def _array_multiplier_c(vbl: int) -> str:
    """Broken-array multiplier (partial products x_i y_j with i + j < vbl dropped) as a C model in the
    style of EvoApproxLib's older releases: 64-bit operands, B declared first, compound assignments."""
    lines = [f"acc += (((A >> {i}) & 1) & ((B >> {j}) & 1)) << {i + j};"
             for i in range(8) for j in range(8) if i + j >= vbl]
    return ("/* a truncated array multiplier */\n#include <stdint.h>\n\n"
            "uint64_t arraymul(const uint64_t B, const uint64_t A)\n{\n  uint64_t acc = 0;\n  "
            + "\n  ".join(lines) + "\n  return acc;\n}\n")


def _array_multiplier_v(vbl: int) -> str:
    """The same circuit as a netlist of its own cell library (ripple-carry rows of full adders built from
    gate primitives, an AND cell with other port names), positional and named connections."""
    out = ["module FADD (X, Y, CI, S, CO);", "  input X, Y, CI;", "  output S, CO;", "  wire t, c1, c2;",
           "  xor (t, X, Y);", "  xor g1 (S, t, CI);", "  and (c1, X, Y);", "  and (c2, t, CI);",
           "  or (CO, c1, c2);", "endmodule", "",
           "module AN2 (input A1, input A2, output Z);", "  nand (zn, A1, A2);", "  not (Z, zn);", "endmodule", "",
           "module arraymul(A, B, O);", "  input [7:0] A;", "  input [7:0] B;", "  output [15:0] O;"]
    out += [f"  wire [15:0] acc{j};" for j in range(9)] + [f"  wire [16:0] c{j};" for j in range(8)]
    out += ["  assign acc0 = 16'h0000;"]
    for j in range(8):
        out.append(f"  assign c{j}[0] = 1'b0;")
        for k in range(16):
            i = k - j
            if 0 <= i < 8 and i + j >= vbl:
                out.append(f"  AN2 p_{i}_{j} (.A1(A[{i}]), .A2(B[{j}]), .Z(pp_{i}_{j}));")
                bit = f"pp_{i}_{j}"
            else:
                bit = "1'b0"
            out.append(f"  FADD fa_{j}_{k} (acc{j}[{k}], {bit}, c{j}[{k}], acc{j + 1}[{k}], c{j}[{k + 1}]);")
    out += ["  assign O = acc8;", "endmodule"]
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("ext", [".c", ".v"])
def test_other_style_circuit_matches_an_independent_model(tmp_path, capsys, ext):
    text = _array_multiplier_c(4) if ext == ".c" else _array_multiplier_v(4)
    path = _write(tmp_path, f"arraymul{ext}", text)
    assert main(["import", str(path)]) == 0
    out = capsys.readouterr().out
    assert "decided from the values" in out and "operand order" in out
    m = get("arraymul")
    assert not m.signed
    assert np.array_equal(m.lut.numpy(), families.build("bam", False, hbl=0, vbl=4).lut.numpy())


def test_builtin_cells_of_other_releases():
    """Every built-in PDKGEN gate against its definition: output bit k of the test module is gate k."""
    gates = {"AND2X1": lambda a, b, c: a & b, "NAND2X1": lambda a, b, c: 1 - (a & b),
             "OR2X1": lambda a, b, c: a | b, "NOR2X1": lambda a, b, c: 1 - (a | b),
             "XOR2X1": lambda a, b, c: a ^ b, "XNOR2X1": lambda a, b, c: 1 - (a ^ b),
             "INVX1": lambda a, b, c: 1 - a, "BUFX2": lambda a, b, c: a,
             "NAND3X1": lambda a, b, c: 1 - (a & b & c), "NOR3X1": lambda a, b, c: 1 - (a | b | c),
             "AOI21X1": lambda a, b, c: 1 - ((a & b) | c), "OAI21X1": lambda a, b, c: 1 - ((a | b) & c),
             "MUX2X1": lambda a, b, s: np.where(s == 1, b, a)}
    arity = {"INVX1": 1, "BUFX2": 1, "NAND3X1": 3, "NOR3X1": 3, "AOI21X1": 3, "OAI21X1": 3, "MUX2X1": 3}
    lines = ["module cells(input [7:0] A, input [7:0] B, output [15:0] O);"]
    for k, cell in enumerate(gates):
        n = arity.get(cell, 2)
        names = "ABS" if cell == "MUX2X1" else "ABC"
        nets = (f"A[{k % 8}]", f"B[{k % 8}]", f"A[{(k + 3) % 8}]")
        ports = ", ".join(f".{p}({x})" for p, x in zip(names[:n], nets[:n]))
        lines.append(f"  PDKGEN{cell} g{k} ({ports}, .Y(O[{k}]));")
    lines += ["  assign O[15:13] = 3'b0;", "endmodule"]
    design = netlist.load("\n".join(lines) + "\n", "cells.v")
    out = bs.to_codes(design.run({"A": bs.operand_bits(0), "B": bs.operand_bits(1)})).reshape(256, 256)
    for k, (cell, fn) in enumerate(gates.items()):
        want = fn((A >> k % 8) & 1, (B >> k % 8) & 1, (A >> (k + 3) % 8) & 1)
        assert np.array_equal((out >> k) & 1, want), cell


def test_other_names_need_the_activation_operand(tmp_path):
    path = _write(tmp_path, "g.c", "#include <stdint.h>\nint16_t g(int8_t x, int8_t y)\n"
                                   "{\n  int32_t p = x * (y & ~1);\n  return (int16_t) p;\n}\n")
    with pytest.raises(UserError, match="--activation-operand x"):
        load_circuit(path)
    by_x, by_y = load_circuit(path, activation="x"), load_circuit(path, activation="y")
    a = np.arange(256)[:, None] - 128
    assert by_x.signed and np.array_equal(by_x.values, a * (a.T & ~1))
    assert np.array_equal(by_y.values, by_x.values.T)
    assert "signed: parameters declared int8_t" in by_x.notes


def test_wide_parameters_take_the_operand_value(tmp_path):
    """An 8-bit operand in an `int` parameter is its value: -128..127 signed, 0..255 unsigned."""
    body = "#include <stdint.h>\nuint16_t {}(int A, int B) {{ return A * B; }}\n"
    u = load_circuit(_write(tmp_path, "mul8u_w.c", body.format("mul8u_w")))
    assert not u.signed and np.array_equal(u.values, exact_table(False))
    assert "codes 0..255 zero-extended" in " ".join(u.notes)
    s = load_circuit(_write(tmp_path, "mul8s_w.c", body.format("mul8s_w")))
    assert s.signed and np.array_equal(s.values, exact_table(True))
    anon = _write(tmp_path, "w.c", body.format("w"))
    with pytest.raises(UserError, match="pass --signed or --unsigned"):    # exact both ways: nothing decides
        load_circuit(anon)
    assert np.array_equal(load_circuit(anon, signed=True).values, exact_table(True))


def test_c_semantics_promotion_truncation_shifts(tmp_path):
    cases = {
        # uint8_t truncation of a promoted ~, then a shift of the 8-bit value
        "uint16_t f(uint8_t A, uint8_t B) { uint8_t x = ~A; return (x >> 4) * B; }": ((255 - A) >> 4) * B,
        # comparison, ternary, logical operators, hex and unsigned constants
        "uint16_t f(uint8_t A, uint8_t B) { return (A < B && B != 0x10u) ? A * B : (A | B) ^ 0x5; }":
            np.where((A < B) & (B != 16), A * B, (A | B) ^ 5),
        # 16-bit wrap-around of an unsigned product written through a narrower variable
        "uint16_t f(uint8_t A, uint8_t B) { uint16_t p = A * B; p -= A; p += A; return p; }": A * B,
    }
    for src, want in cases.items():
        p = _write(tmp_path, "mul8u_t.c", "#include <stdint.h>\n" + src + "\n")
        assert np.array_equal(load_circuit(p).values, want), src
    # arithmetic right shift of a negative int8_t, signed result
    p = _write(tmp_path, "mul8s_t.c", "#include <stdint.h>\nint16_t f(int8_t A, int8_t B) { return (A >> 2) * B; }\n")
    a = np.arange(256)[:, None] - 128
    assert np.array_equal(load_circuit(p).values, (a >> 2) * a.T)


def test_verilog_semantics_signed_ports_selects_concat(tmp_path):
    signed = _write(tmp_path, "sm.v", "module sm(input signed [7:0] A, input signed [7:0] B, output signed [15:0] O);\n"
                                      "  assign O = A * B;\nendmodule\n")
    got = load_circuit(signed)
    assert got.signed and np.array_equal(got.values, exact_table(True))   # sign-extended by Verilog's rules
    plain = _write(tmp_path, "um.v", "module um(input [7:0] A, input [7:0] B, output [15:0] O);\n"
                                     "  wire [7:0] hi;\n  wire [15:0] p;\n  assign hi = {A[7:4], B[3:0]};\n"
                                     "  assign p = A * B;\n"
                                     "  assign O = {p[15:4], hi[3:0]} ^ {14'b0, {2{&A[1:0]}}};\nendmodule\n")
    want = ((A * B) >> 4 << 4 | B & 15) ^ np.where((A & 3) == 3, 3, 0)
    assert np.array_equal(load_circuit(plain, signed=False).values, want)


# ---------------------------------------------------------------- refusals

GOOD_C = "#include <stdint.h>\n#include <stdlib.h>\nint16_t mul8s_x(int8_t A, int8_t B)\n{\n  int16_t P = A * B;\n{bad}  return P;\n}\n"


@pytest.mark.parametrize("bad, match", [
    ("  abort();\n", "mul8s_x.c:6: a function call (abort(...))"),
    ("  P = labs(P);\n", "mul8s_x.c:6: a function call (labs(...))"),
    ("  for (;;) P = 0;\n", "mul8s_x.c:6: a loop (for)"),
    ("  if (A) P = 0;\n", "mul8s_x.c:6: a branch (if)"),
    ("  P = P / 2;\n", "mul8s_x.c:6: division"),
    ("  int16_t *q;\n", "mul8s_x.c:6: a pointer"),
    ("  int16_t t[2];\n", "mul8s_x.c:6: an array"),
    ("  P = P << 40;\n", "mul8s_x.c:6: shift by 40 of a 32-bit value"),
    ("  P = Q;\n", "'Q' is not declared"),
    ("  int16_t u; P = u;\n", "read before it is assigned"),
])
def test_c_outside_the_subset_is_refused(tmp_path, capsys, bad, match):
    _refused(_write(tmp_path, "mul8s_x.c", GOOD_C.replace("{bad}", bad)), capsys, match=match)


@pytest.mark.parametrize("header, match", [
    ("#include <stdio.h>\n", "mul8s_x.c:1: `#include <stdio.h>`"),
    ('#include "evil.h"\n', "mul8s_x.c:1: `#include \"evil.h\"`"),
    ("#define P 3\n", "mul8s_x.c:1: `#define P 3`"),
])
def test_c_foreign_preprocessor_lines_are_refused(tmp_path, capsys, header, match):
    _refused(_write(tmp_path, "mul8s_x.c", header + GOOD_C.replace("{bad}", "")), capsys, match=match)


def test_good_c_imports_under_the_guard(tmp_path):
    assert _import_guarded(_write(tmp_path, "mul8s_x.c", GOOD_C.replace("{bad}", ""))) == 0
    assert np.array_equal(get("mul8s_x").lut.numpy(), exact_table(True))


V_TOP = "module m(A, B, O);\n  input [7:0] A;\n  input [7:0] B;\n  output [15:0] O;\n{body}endmodule\n"


@pytest.mark.parametrize("body, match", [
    ("  wire s, c;\n  XYZHAX1 U1 (.A(A[0]), .B(B[0]), .YS(s), .YC(c));\n  assign O = {14'b0, c, s};\n",
     "m.v:6: unknown module XYZHAX1"),
    ("  wire x, y;\n  assign x = y ^ A[0];\n  assign y = x;\n  assign O = {15'b0, y};\n", "combinational cycle"),
    ("  assign O[14:0] = A * B;\n", "output O[15] is never driven"),
    ("  wire w;\n  assign O = {15'b0, w};\n", "w is read but nothing drives it"),
    ("  assign O = {15'b0, typo};\n", "m.v:5: 'typo' is not declared in module m"),
    ("  assign O = A * B;\n  assign O[3] = 1'b0;\n", "O[3] is driven twice"),
    ("  wire s, c;\n  PDKGENHAX1 U1 (.A(A[1:0]), .B(B[0]), .YS(s), .YC(c));\n  assign O = {14'b0, c, s};\n",
     "port A of PDKGENHAX1 is 1 bit(s) wide, but instance U1 connects 2"),
    ("  wire s;\n  PDKGENHAX1 U1 (.A(A[0]), .B(B[0]), .YS(s), .Q(s));\n  assign O = {15'b0, s};\n",
     "PDKGENHAX1 has no port Q"),
    ("  reg r;\n  assign O = A * B;\n", "`reg` is outside the supported Verilog subset"),
    ("  always @(A) O = A;\n", "`always` is outside"),
    ("  assign O = {8'bx, A};\n", "x/z bits"),
    ("  assign O = A / B;\n", "operator / is outside"),
])
def test_verilog_outside_the_subset_is_refused(tmp_path, capsys, body, match):
    _refused(_write(tmp_path, "m.v", V_TOP.replace("{body}", body)), capsys, "--unsigned", match=match)


def test_verilog_wrong_top_ports(tmp_path, capsys):
    narrow = V_TOP.replace("[7:0] A", "[6:0] A").replace("{body}", "  assign O = A * B;\n")
    _refused(_write(tmp_path, "m.v", narrow), capsys, match="m.v:2: input A of m is 7 bit(s) wide")
    short = V_TOP.replace("[15:0] O", "[11:0] O").replace("{body}", "  assign O = A * B;\n")
    _refused(_write(tmp_path, "m.v", short), capsys, match="output O of m is 12 bit(s) wide")


def test_truncated_empty_and_oversized_files(tmp_path, capsys, monkeypatch):
    c = GOOD_C.replace("{bad}", "")
    _refused(_write(tmp_path, "mul8s_x.c", c[: len(c) - 14]), capsys, match="truncated")
    v = _array_multiplier_v(0)
    _refused(_write(tmp_path, "mul8u_v.v", v[: len(v) // 2]), capsys, match="mul8u_v.v:")
    _refused(_write(tmp_path, "mul8u_e.v", "\n"), capsys, match="empty file")
    _refused(_write(tmp_path, "mul8u_b.c", "\0\1\2"), capsys, match="not a text file")
    monkeypatch.setattr("runner.multipliers.circuits.MAX_SOURCE_BYTES", 100)
    _refused(_write(tmp_path, "mul8s_x.c", c), capsys, match="bytes; a multiplier circuit is far smaller")


def test_header_figures_checked_and_kept(tmp_path, capsys):
    from runner.energy import power_mw

    head = "// MAE% = 0.00 %\n// WCE% = 5.0 %\n// EP% = 0.00 %\n// PDK45_PWR = 0.5 mW\n"
    path = _write(tmp_path, "mul8s_h.c", head + GOOD_C.replace("{bad}", ""))
    assert main(["import", str(path)]) == 0
    out = capsys.readouterr().out
    assert "header figures reproduced: MAE%, EP%" in out
    assert "MISMATCH with the header: WCE% published 5.0, computed 0" in out
    m = get("mul8s_h")
    assert m.published["pwr"] == "0.5" and power_mw(m) == 0.5


def test_shipped_circuit_under_its_own_name_registers_nothing(tmp_path, capsys):
    text = "// MAE% = 0.00 %\n#include <stdint.h>\nint16_t mul8s_1KV6(int8_t A, int8_t B) { return A * B; }\n"
    assert main(["import", str(_write(tmp_path, "mul8s_1KV6.c", text))]) == 0
    assert "identical to the shipped table mul8s_1KV6" in capsys.readouterr().out
    assert user_names() == []
    wrong = text.replace("return A * B", "return A * B + 1")
    _refused(_write(tmp_path, "mul8s_1KV6.c", wrong), capsys, match="taken by a shipped")


def test_signedness_contradicting_the_values_is_refused(tmp_path):
    p = _write(tmp_path, "mul8u_s.c", "#include <stdint.h>\nint16_t f(int8_t A, int8_t B) { return A * B; }\n")
    with pytest.raises(UserError, match="the name says unsigned"):
        load_circuit(p)
    with pytest.raises(UserError, match="fit a signed multiplier far better"):
        load_circuit(p, signed=False)
    assert load_circuit(p, signed=True).signed


# ---------------------------------------------------------------- every gate primitive against its truth table

_GATES = {  # name -> (inputs, truth function on 0/1 arrays)
    "and": (2, lambda a, b: a & b), "or": (2, lambda a, b: a | b), "nand": (2, lambda a, b: 1 - (a & b)),
    "nor": (2, lambda a, b: 1 - (a | b)), "xor": (2, lambda a, b: a ^ b), "xnor": (2, lambda a, b: 1 - (a ^ b)),
    "not": (1, lambda a: 1 - a), "buf": (1, lambda a: a),
    "and3": (3, lambda a, b, c: a & b & c), "or3": (3, lambda a, b, c: a | b | c),
    "nand3": (3, lambda a, b, c: 1 - (a & b & c)), "nor3": (3, lambda a, b, c: 1 - (a | b | c)),
    "xor3": (3, lambda a, b, c: a ^ b ^ c), "xnor3": (3, lambda a, b, c: 1 - (a ^ b ^ c)),
}
_C_EXPR = {"and": "a & b", "or": "a | b", "nand": "~(a & b)", "nor": "~(a | b)", "xor": "a ^ b", "xnor": "~(a ^ b)",
           "not": "~a", "buf": "a", "and3": "a & b & c", "or3": "a | b | c", "nand3": "~(a & b & c)",
           "nor3": "~(a | b | c)", "xor3": "a ^ b ^ c", "xnor3": "~(a ^ b ^ c)"}


def _gate_expected():
    a, b, c = A & 1, B & 1, (A >> 1) & 1
    out = np.zeros_like(A)
    for bit, (_, (n, fn)) in enumerate(_GATES.items()):
        out |= fn(*(a, b, c)[:n]) << bit
    return out


def test_every_gate_primitive_against_its_truth_table():
    ins = ["A[0]", "B[0]", "A[1]"]
    lines = ["module gates(input [7:0] A, input [7:0] B, output [15:0] O);", "  assign O[15:14] = 2'b00;"]
    for bit, (name, (n, _)) in enumerate(_GATES.items()):
        lines.append(f"  {name.rstrip('3')} g{bit} (O[{bit}], {', '.join(ins[:n])});")
    design = netlist.load("\n".join(lines + ["endmodule"]) + "\n", "gates.v")
    got = bs.to_codes(design.run({"A": bs.operand_bits(0), "B": bs.operand_bits(1)})).reshape(256, 256)
    assert np.array_equal(got, _gate_expected())


def test_every_gate_in_c_against_its_truth_table():
    from runner.multipliers import csource

    body = ["uint32_t a = A & 1, b = B & 1, c = (A >> 1) & 1;", "uint32_t r = 0;"]
    body += [f"r |= (({_C_EXPR[name]}) & 1) << {bit};" for bit, name in enumerate(_GATES)]
    text = "#include <stdint.h>\nuint16_t gates(uint8_t A, uint8_t B) {\n" + "\n".join(body) + "\nreturn r;\n}\n"
    result = csource.evaluate(text, "gates.c", {"A": bs.operand_bits(0), "B": bs.operand_bits(1)}).result
    assert np.array_equal(bs.to_codes(result[:16]).reshape(256, 256), _gate_expected())
