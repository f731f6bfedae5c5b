"""A multiplier's structural / gate-level Verilog netlist, evaluated without a simulator.

The subset is what circuit libraries emit: modules with input/output/wire declarations ([msb:lsb]
ranges, optionally `signed`; ANSI or classic port lists), continuous `assign` with the operators
~ ! & | ^ ~^ ~& ~| + - * << >> <<< >>> == != < > <= >= && || ?: (and reductions), bit and part selects,
concatenation and replication, sized and unsized constants, instances of modules defined in the same
file with named or positional ports, and the gate primitives and/or/nand/nor/xor/xnor/not/buf.
EvoApproxLib's standard cells (PDKGENHAX1, PDKGENFAX1, PDKGENAND2X1 and the other PDKGEN gates its
releases define: NAND2, OR2, NOR2, XOR2, XNOR2, INV, BUF, NAND3, NOR3, AOI21, OAI21, MUX2) are built in
for files that use them without defining them; a file's own definition takes precedence. Anything else (always blocks,
registers, parameters, x/z values, an unknown module) is refused with UserError naming file:line.

The design is flattened and ordered by its bit-level dependencies: a bit driven twice, a
combinational cycle, or an output (or a bit it depends on) that nothing drives is refused. Expression
widths and signedness follow the Verilog rules (context-determined operands, sign extension only when
every operand is signed). The evaluation runs on all 65,536 operand pairs at once (bitslice.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import UserError
from . import bitslice as bs
from .tokens import MAX_NESTING, MAX_WIDTH, TokenStream

# EvoApproxLib's standard cells, as the library's own files define them; a file's definition wins.
BUILTIN_CELLS = """
module PDKGENHAX1( input A, input B, output YS, output YC );
    assign YS = A ^ B;
    assign YC = A & B;
endmodule
module PDKGENFAX1( input A, input B, input C, output YS, output YC );
    assign YS = (A ^ B) ^ C;
    assign YC = (A & B) | (B & C) | (A & C);
endmodule
module PDKGENAND2X1(input A, input B, output Y ); assign Y = A & B; endmodule
module PDKGENNAND2X1(input A, input B, output Y ); assign Y = ~(A & B); endmodule
module PDKGENOR2X1(input A, input B, output Y ); assign Y = A | B; endmodule
module PDKGENNOR2X1(input A, input B, output Y ); assign Y = ~(A | B); endmodule
module PDKGENXOR2X1(input A, input B, output Y ); assign Y = A ^ B; endmodule
module PDKGENXNOR2X1(input A, input B, output Y ); assign Y = ~(A ^ B); endmodule
module PDKGENINVX1(input A, output Y ); assign Y = ~A; endmodule
module PDKGENBUFX2(input A, output Y ); assign Y = A; endmodule
module PDKGENNAND3X1(input A, input B, input C, output Y ); assign Y = ~((A & B) & C); endmodule
module PDKGENNOR3X1(input A, input B, input C, output Y ); assign Y = ~((A | B) | C); endmodule
module PDKGENAOI21X1( input A, input B, input C, output Y ); assign Y = ~((A & B) | C); endmodule
module PDKGENOAI21X1( input A, input B, input C, output Y ); assign Y = ~((A | B) & C); endmodule
module PDKGENMUX2X1( input A, input B, input S, output Y ); assign Y = (A & ~S) | (B & S); endmodule
"""
BUILTIN_WHERE = "<built-in EvoApproxLib cells>"
PRIMITIVES = {"and": bs.AND, "or": bs.OR, "xor": bs.XOR, "nand": bs.AND, "nor": bs.OR, "xnor": bs.XOR,
              "not": None, "buf": None}
_REFUSED = {"reg", "always", "initial", "function", "task", "generate", "parameter", "localparam", "genvar",
            "integer", "specify", "supply0", "supply1", "tri", "inout", "real", "defparam", "event", "time",
            "fork", "wait", "force", "primitive", "table", "wand", "wor", "trireg", "tri0", "tri1", "triand",
            "trior", "bufif0", "bufif1", "notif0", "notif1", "pullup", "pulldown", "cmos", "nmos", "pmos"}
_KEYWORDS = {"module", "endmodule", "input", "output", "wire", "assign", "signed"} | _REFUSED | set(PRIMITIVES)

_TOKEN = re.compile(r"""
    (?P<nl>\n) | (?P<ws>[ \t\r\f\v]+) | (?P<lc>//[^\n]*) | (?P<bc>/\*.*?\*/) |
    (?P<dir>`[A-Za-z_]+[^\n]*) |
    (?P<num>(?:[0-9][0-9_]*)?\s*'[sS]?[bBoOdDhH]\s*[0-9a-zA-Z_?]+ | [0-9][0-9_]*) |
    (?P<id>[A-Za-z_][A-Za-z0-9_$]* | \\[^\s]+) |
    (?P<op><<<|>>>|===|!==|<<|>>|==|!=|<=|>=|&&|\|\||~&|~\||~\^|\^~|\*\*|\(\*|[()\[\]{},;.:=~&|^!+\-*/%?<>\#@])
""", re.X | re.S)
_BINARY = {"||": 1, "&&": 2, "|": 3, "^": 4, "~^": 4, "^~": 4, "&": 5, "==": 6, "!=": 6, "<": 7, ">": 7,
           "<=": 7, ">=": 7, "<<": 8, ">>": 8, "<<<": 8, ">>>": 8, "+": 9, "-": 9, "*": 10}


@dataclass
class Net:
    name: str
    width: int
    msb: int
    lsb: int
    signed: bool = False
    direction: str = ""      # "input", "output" or "" for a wire
    line: int = 0
    base: int = -1           # first global bit id once elaborated

    def offset(self, index: int) -> int | None:
        off = index - self.lsb if self.msb >= self.lsb else self.lsb - index
        return off if 0 <= off < self.width else None


@dataclass
class Module:
    name: str
    where: str
    line: int
    ports: list = field(default_factory=list)
    nets: dict = field(default_factory=dict)
    assigns: list = field(default_factory=list)     # (lhs, rhs, line)
    instances: list = field(default_factory=list)   # (cell, inst, conns: dict | list, line)


def tokenize(text: str, where: str) -> list:
    toks, line, pos = [], 1, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            what = "an unterminated comment" if text.startswith("/*", pos) else f"the character {text[pos]!r}"
            raise UserError(f"{where}:{line}: {what} is outside the supported Verilog subset")
        kind, s = m.lastgroup, m.group()
        pos = m.end()
        if kind == "nl":
            line += 1
        elif kind == "bc":
            line += s.count("\n")
        elif kind == "dir":
            if not s.startswith("`timescale"):
                raise UserError(f"{where}:{line}: compiler directive {s.split()[0]} is outside the supported "
                                f"Verilog subset (only `timescale is accepted)")
        elif kind == "op" and s == "(*":
            raise UserError(f"{where}:{line}: attributes (* ... *) are outside the supported Verilog subset")
        elif kind not in ("ws", "lc"):
            toks.append((kind, s[1:] if s.startswith("\\") else s, line))
    toks.append(("eof", "", line))
    return toks


def _number(s: str, fail) -> tuple:
    """('num', width or None, value, signed)."""
    s = s.replace("_", "")
    if len(s) > 2 * MAX_WIDTH:
        fail(f"a constant of {len(s):,} characters; at most {MAX_WIDTH:,} bits are supported")
    if "'" not in s:
        if len(s) > 40:  # an unsized constant is 32 bits: anything longer is far out of range
            fail(f"the unsized constant {s} does not fit 32 bits")
        return ("num", None, int(s), True)
    size, rest = s.split("'", 1)
    rest = rest.strip()
    signed = rest[:1] in "sS"
    if signed:
        rest = rest[1:]
    base, digits = {"b": 2, "o": 8, "d": 10, "h": 16}[rest[0].lower()], rest[1:].strip()
    if re.search(r"[xXzZ?]", digits):
        fail(f"the constant {s} holds x/z bits, outside the supported Verilog subset")
    try:
        if len(digits) > MAX_WIDTH:
            raise ValueError
        value = int(digits, base)
    except ValueError:
        fail(f"{s!r} is not a valid constant")
    if len(size.strip()) > 9:
        fail(f"{s!r} is wider than {MAX_WIDTH:,} bits, the limit of the circuit importer")
    width = int(size) if size.strip() else None
    if width is not None:
        if width == 0:
            fail(f"{s!r} has zero width")
        if width > MAX_WIDTH:
            fail(f"{s!r} is wider than {MAX_WIDTH:,} bits, the limit of the circuit importer")
        value &= (1 << width) - 1
    return ("num", width, value, signed)


class Parser(TokenStream):
    def __init__(self, text: str, where: str):
        super().__init__(tokenize(text, where), where)

    def ident(self, what="a name"):
        t = self.next()
        if t[0] != "id" or t[1] in _KEYWORDS:
            self.fail(f"expected {what}, found {'the end of the file' if t[0] == 'eof' else repr(t[1])}", t[2])
        return t[1]

    def const_int(self):
        t = self.next()
        if t[0] != "num" or "'" in t[1]:
            self.fail(f"expected a constant index, found {t[1]!r}", t[2])
        digits = t[1].replace("_", "")
        if len(digits) > 9:
            self.fail(f"the index {digits} is out of range (nets of at most {MAX_WIDTH:,} bits are supported)", t[2])
        return int(digits)

    # ------------------------------------------------------------ modules
    def modules(self) -> dict:
        mods = {}
        while self.peek()[0] != "eof":
            t = self.peek()
            if t[1] != "module":
                self.fail(f"expected `module`, found {t[1]!r}" + (" (outside the supported Verilog subset)"
                                                                  if t[1] in _REFUSED else ""))
            m = self.module()
            if m.name in mods:
                self.fail(f"module {m.name} is defined twice", m.line)
            mods[m.name] = m
        return mods

    def declare(self, m: Module, name, width, msb, lsb, signed, direction, line):
        old = m.nets.get(name)
        if old is None:
            m.nets[name] = Net(name, width, msb, lsb, signed, direction, line)
            return
        # `output [15:0] O; wire [15:0] O;` declares one net twice, legally
        if (old.direction and direction) or not (old.direction or direction) or (old.msb, old.lsb) != (msb, lsb):
            self.fail(f"{name!r} is declared twice" + ("" if (old.msb, old.lsb) == (msb, lsb) else
                                                        " with different ranges"), line)
        old.direction = old.direction or direction
        old.signed = old.signed or signed

    def range_(self):
        if self.peek()[1] != "[":
            return 1, 0, 0
        self.next()
        msb = self.const_int()
        self.expect(":")
        lsb = self.const_int()
        self.expect("]")
        if abs(msb - lsb) + 1 > MAX_WIDTH:
            self.fail(f"[{msb}:{lsb}] is {abs(msb - lsb) + 1:,} bits wide; nets of at most {MAX_WIDTH:,} bits are "
                      f"supported")
        return abs(msb - lsb) + 1, msb, lsb

    def module(self) -> Module:
        line = self.expect("module")[2]
        m = Module(self.ident("a module name"), self.where, line)
        if self.peek()[1] == "#":
            self.fail("module parameters are outside the supported Verilog subset")
        if self.peek()[1] == "(":
            self.next()
            direction = None
            while self.peek()[1] != ")":
                t = self.peek()
                if t[1] in ("input", "output", "inout"):
                    if t[1] == "inout":
                        self.fail("inout ports are outside the supported Verilog subset")
                    direction = self.next()[1]
                    if self.peek()[1] == "wire":
                        self.next()
                    signed = self.peek()[1] == "signed" and bool(self.next())
                    width, msb, lsb = self.range_()
                    attrs = (width, msb, lsb, signed)
                name = self.ident("a port name")
                if direction:
                    self.declare(m, name, *attrs, direction, self.toks[self.i - 1][2])
                m.ports.append(name)
                if self.peek()[1] == ",":
                    self.next()
                elif self.peek()[1] != ")":
                    self.fail(f"expected ',' or ')' in the port list, found {self.peek()[1]!r}")
            self.next()
        self.expect(";")
        while True:
            kind, s, line = self.peek()
            if kind == "eof":
                self.fail(f"module {m.name} has no `endmodule` (is the file truncated?)")
            if s == "endmodule":
                self.next()
                break
            if s in _REFUSED:
                self.fail(f"`{s}` is outside the supported Verilog subset (structural netlists only)")
            if s in ("input", "output", "wire"):
                self.declaration(m)
            elif s == "assign":
                self.next()
                while True:
                    lhs = self.expression()
                    self.expect("=")
                    m.assigns.append((lhs, self.expression(), line))
                    if self.next()[1] == ";":
                        break
                    if self.toks[self.i - 1][1] != ",":
                        self.fail("expected ',' or ';' after an assignment", self.toks[self.i - 1][2])
            elif kind == "id":
                self.instance(m)
            else:
                self.fail(f"unexpected {s!r} in module {m.name}")
        for p in m.ports:
            if p not in m.nets or not m.nets[p].direction:
                self.fail(f"port {p} of module {m.name} has no input/output declaration", m.line)
        return m

    def declaration(self, m: Module):
        kind = self.next()[1]
        direction = "" if kind == "wire" else kind
        if direction and self.peek()[1] == "wire":
            self.next()
        signed = self.peek()[1] == "signed" and bool(self.next())
        width, msb, lsb = self.range_()
        while True:
            name, line = self.ident("a net name"), self.toks[self.i - 1][2]
            if direction and name not in m.ports:
                self.fail(f"{name} is declared {direction} but is not in the port list of {m.name}", line)
            self.declare(m, name, width, msb, lsb, signed, direction, line)
            if self.peek()[1] == "=":
                self.next()
                m.assigns.append((("id", name, line), self.expression(), line))
            t = self.next()
            if t[1] == ";":
                return
            if t[1] != ",":
                self.fail(f"expected ',' or ';' in a declaration, found {t[1]!r}", t[2])

    def instance(self, m: Module):
        cell, line = self.next()[1], self.toks[self.i - 1][2]
        if self.peek()[1] == "#":
            self.fail("instance parameters are outside the supported Verilog subset")
        while True:
            inst = None
            if self.peek()[0] == "id":
                inst = self.ident("an instance name")
                if self.peek()[1] == "[":
                    self.fail("instance arrays are outside the supported Verilog subset")
            elif cell not in PRIMITIVES:
                self.fail(f"expected an instance name after {cell}, found {self.peek()[1]!r}")
            self.expect("(")
            conns: dict | list = {} if self.peek()[1] == "." else []
            while self.peek()[1] != ")":
                if isinstance(conns, dict):
                    self.expect(".")
                    port = self.ident("a port name")
                    self.expect("(")
                    if port in conns:
                        self.fail(f"port {port} of {inst} is connected twice")
                    conns[port] = None if self.peek()[1] == ")" else self.expression()
                    self.expect(")")
                else:
                    conns.append(self.expression())
                if self.peek()[1] == ",":
                    self.next()
                elif self.peek()[1] != ")":
                    self.fail(f"expected ',' or ')' in the connections of {inst or cell}, found {self.peek()[1]!r}")
            self.next()
            m.instances.append((cell, inst or f"{cell}_{len(m.instances)}", conns, line))
            t = self.next()
            if t[1] == ";":
                return
            if t[1] != ",":
                self.fail(f"expected ';' after the instance {inst}, found {t[1]!r}", t[2])

    # ------------------------------------------------------------ expressions
    def expression(self):
        self.enter()
        try:
            e = self._expression()
        finally:
            self.depth -= 1
        if self.depth == 0 and _depth(e) > MAX_NESTING:  # a long operator chain nests as deeply as parentheses
            self.fail(f"an expression nested more than {MAX_NESTING} levels deep (counting each operator of a "
                      f"chain), the limit of the circuit importer")
        return e

    def _expression(self):
        return self.conditional(lambda cond, a, b: ("tern", cond, a, b))

    def binary(self, level):
        left = self.unary()
        while True:
            op = self.peek()[1] if self.peek()[0] == "op" else None
            if op in ("/", "%", "**", "===", "!=="):
                self.fail(f"the operator {op} is outside the supported Verilog subset")
            prec = _BINARY.get(op)
            if prec is None or prec < level:
                return left
            self.next()
            left = ("bin", op, left, self.binary(prec + 1))

    def unary(self):
        s = self.peek()[1]
        if self.peek()[0] == "op" and s in ("~", "!", "-", "+", "&", "|", "^", "~&", "~|", "~^", "^~"):
            self.next()
            self.enter()
            e = ("un", s, self.unary())
            self.depth -= 1
            return e
        return self.primary()

    def primary(self):
        kind, s, line = self.next()
        if kind == "num":
            return _number(s, lambda msg: self.fail(msg, line))
        if kind == "id":
            if s in _KEYWORDS:
                self.fail(f"unexpected keyword {s!r}", line)
            if self.peek()[1] == "(":
                self.fail(f"a function call ({s}(...)) is outside the supported Verilog subset", line)
            if self.peek()[1] != "[":
                return ("id", s, line)
            self.next()
            hi = self.const_int()
            if self.peek()[1] in ("+:", "-:"):
                self.fail("indexed part-selects are outside the supported Verilog subset")
            if self.peek()[1] == ":":
                self.next()
                lo = self.const_int()
                self.expect("]")
                return ("part", s, hi, lo, line)
            self.expect("]")
            return ("part", s, hi, hi, line)
        if s == "(":
            e = self.expression()
            self.expect(")")
            return e
        if s == "{":
            first = self.expression()
            if self.peek()[1] == "{":      # replication {n{...}}
                self.next()
                parts = [self.expression()]
                while self.peek()[1] == ",":
                    self.next()
                    parts.append(self.expression())
                self.expect("}")
                self.expect("}")
                if first[0] != "num":
                    self.fail("a replication count must be a constant", line)
                if first[2] * len(parts) > MAX_WIDTH:
                    self.fail(f"a replication of {first[2]:,} copies; at most {MAX_WIDTH:,} bits are supported", line)
                return ("concat", parts * first[2])
            parts = [first]
            while self.peek()[1] == ",":
                self.next()
                parts.append(self.expression())
            self.expect("}")
            return ("concat", parts)
        self.fail("unexpected end of the file (is it truncated?)" if kind == "eof" else f"unexpected {s!r}", line)


def _depth(e) -> int:
    """How deeply an expression tree nests (without recursing: the tree may be deep)."""
    deepest, stack = 0, [(e, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        for child in (node[1] if node[0] == "concat" else node[1:]):
            if isinstance(child, tuple):
                stack.append((child, d + 1))
    return deepest


def parse(text: str, where: str) -> dict:
    return Parser(text, where).modules()


def builtin_cells() -> dict:
    return parse(BUILTIN_CELLS, BUILTIN_WHERE)
