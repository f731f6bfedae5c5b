"""Hostile circuit files (deep nesting, huge widths and constants, exponential hierarchies, giant names):
each imports or is refused with one short message (exit 0 or 2), quickly and within bounded memory."""
import resource
import subprocess
import sys
import time

import pytest

from runner.multipliers.cli import main

C_HEAD = "#include <stdint.h>\nuint16_t mul8u_H(uint8_t A, uint8_t B) {\n"
V_HEAD = "module mul8u_H(input [7:0] A, input [7:0] B, output [15:0] O);\n"


def _c(body: str) -> str:
    return C_HEAD + body + "\n}\n"


def _v(expr: str, decls: str = "", after: str = "") -> str:
    return V_HEAD + decls + f"assign O = {expr};\nendmodule\n" + after


def _chain(n: int) -> str:
    mods = [f"module m{i}(input [7:0] A, input [7:0] B, output [15:0] O); m{i + 1} u(.A(A), .B(B), .O(O)); endmodule"
            for i in range(n - 1)]
    mods.append(f"module m{n - 1}(input [7:0] A, input [7:0] B, output [15:0] O); assign O = A * B; endmodule")
    return V_HEAD + "m0 u(.A(A), .B(B), .O(O));\nendmodule\n" + "\n".join(mods) + "\n"


def _doubling(levels: int) -> str:
    """levels modules, each instantiating the one below twice: 2**levels leaf instances from a tiny file."""
    mods = ["module l0(input a, input b, output y); assign y = a & b; endmodule"]
    for i in range(1, levels + 1):
        mods.append(f"module l{i}(input a, input b, output y); wire t; l{i - 1} p(a, b, t); l{i - 1} q(t, b, y); "
                    "endmodule")
    return V_HEAD + f"wire y; l{levels} u(A[0], B[0], y);\nassign O = A * B + y;\nendmodule\n" + "\n".join(mods) + "\n"


NAME = "x" * 1_000_000
CASES = {
    "c_parens_250": _c("return " + "(" * 250 + "A * B" + ")" * 250 + ";"),
    "c_ternary_1000": _c("return " + "A ? " * 1000 + "A * B" + " : B" * 1000 + ";"),
    "c_ternary_else_1000": _c("return " + "A == 1 ? B : " * 1000 + "A * B;"),
    "c_tilde_1000": _c("return " + "~" * 1000 + "(A * B);"),
    "c_minus_1000": _c("return " + "- " * 1000 + "(A * B);"),
    "c_flat_500": _c("return A * B" + " + A" * 500 + ";"),
    "c_const_4001": _c("return A * B + " + "9" * 4001 + ";"),
    "c_const_4301": _c("return A * B + " + "9" * 4301 + ";"),
    "c_const_hex_100000": _c("return A * B + 0x" + "f" * 100_000 + ";"),
    "c_long_name": _c(f"uint16_t {NAME} = A * B; return {NAME}[0];"),
    "c_long_undeclared": _c(f"return {NAME};"),
    "v_parens_250": _v("(" * 250 + "A * B" + ")" * 250),
    "v_ternary_1000": _v("A[0] ? " * 1000 + "A * B" + " : B" * 1000),
    "v_ternary_else_1000": _v("A[0] ? B : " * 1000 + "A * B"),
    "v_tilde_1000": _v("~" * 1000 + "(A * B)"),
    "v_flat_500": _v("A * B" + " + A" * 500),
    "v_chain_1000": _chain(1000),
    "v_wide_wire": _v("A * B", "wire [1000000000:0] w;\n"),
    "v_wide_const": _v("A * B + 1000000000'd1"),
    "v_replication": _v("A * B + {1000000000{A[0]}}"),
    "v_const_4301": _v("A * B + " + "9" * 4301),
    "v_index_4301": _v("A * B", "wire [" + "9" * 4301 + ":0] w;\n"),
    "v_doubling_20": _doubling(20),
    "v_long_name": _v(NAME),
    "v_long_module": V_HEAD + f"{NAME} u(.A(A), .B(B), .O(O));\nendmodule\n",
    "v_concat": _v("A * B + {" + ", ".join(["65000'd0"] * 3) + "}"),
    # at the limits: these evaluate, through recursion as deep as the limits allow
    "c_tilde_998": _c("return " + "~" * 998 + "(A * B);"),
    "c_ternary_999": _c("return " + "A == 1 ? B : " * 999 + "A * B;"),
    "v_tilde_998": _v("~" * 998 + "(A * B)"),
    "v_ternary_990": _v("A == 1 ? B : " * 990 + "A * B"),
    "v_chain_999": _chain(999),
}
IMPORTS = {"c_parens_250", "v_parens_250", "c_tilde_998", "c_ternary_999", "v_tilde_998", "v_ternary_990",
           "v_chain_999"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_circuit_imports_or_is_refused(tmp_path, capsys, case):
    path = tmp_path / f"mul8u_H{'.c' if case.startswith('c_') else '.v'}"
    path.write_text(CASES[case])
    start = time.perf_counter()
    rc = main(["import", str(path), "--name", "hostile"])
    seconds = time.perf_counter() - start
    out = capsys.readouterr()
    assert rc == (0 if case in IMPORTS else 2), out.err[:300]
    assert "Traceback" not in out.err and len(out.err) < 1000, out.err[:300]
    if rc == 0:
        assert "exact" in out.out   # each of these computes a*b
    assert seconds < 10, seconds


@pytest.mark.slow
def test_worst_cases_within_6_gb_and_30_s(tmp_path):
    """The cases that allocated without bound before the limits, in a process that may not take more."""
    for case in ("v_doubling_20", "v_wide_wire", "v_replication", "c_const_4301"):
        path = tmp_path / f"mul8u_H{'.c' if case.startswith('c_') else '.v'}"
        path.write_text(CASES[case])
        out = subprocess.run(
            [sys.executable, "-c", "import sys; from runner.multipliers.cli import main; sys.exit(main(sys.argv[1:]))",
             "import", str(path)], capture_output=True, text=True, timeout=60,
            env={**__import__("os").environ, "APPROX_RUN_HOME": str(tmp_path / case)},
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)))
        assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr) < 1000, out.stderr[-500:]
