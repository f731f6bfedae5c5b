"""A multiplier's C model, evaluated without compiling or running it.

The subset is what circuit libraries (EvoApproxLib and the like) emit: one function of two integer
parameters holding straight-line code: declarations (stdint types or char/short/int/long with
signed/unsigned/const, optionally initialised), assignments (= and the compound operators), the
operators ~ ! - + * << >> & ^ | && || == != < > <= >= ?: with casts and parentheses, and one final
`return`. The only preprocessor lines allowed are `#include <stdint.h>` and `#include <stdlib.h>`.
Anything else (a call, a loop, a branch, a pointer, an array, division, a macro) is refused with
UserError naming file:line, before or instead of evaluating it: nothing of the file is executed.

C semantics are kept exactly where they matter for the bits: integer promotion to 32-bit int, the
usual arithmetic conversions, truncation and sign extension on assignment and cast, arithmetic
right shift of negative values (what every compiler the libraries use does). A shift by a
negative or too large amount (undefined in C), or by an amount that differs between operand pairs,
is refused. The evaluation runs on all 65,536 operand pairs at once (bitslice.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UserError
from . import bitslice as bs
from .tokens import MAX_LIVE_SLICES, Deadline, TokenStream

ALLOWED_INCLUDES = ("stdint.h", "stdlib.h")

_TOKEN = re.compile(r"""
    (?P<nl>\n) | (?P<ws>[ \t\r\f\v]+) | (?P<lc>//[^\n]*) | (?P<bc>/\*.*?\*/) |
    (?P<num>[0-9][0-9A-Za-z]*) | (?P<id>[A-Za-z_][A-Za-z_0-9]*) |
    (?P<op><<=|>>=|<<|>>|<=|>=|==|!=|&&|\|\||\+\+|--|->|[-+*/%&|^]=|[-+*/%&|^~!=<>?:;,(){}\[\].#])
""", re.X | re.S)


@dataclass(frozen=True)
class CType:
    bits: int
    signed: bool

    def __str__(self):
        return f"{'' if self.signed else 'u'}int{self.bits}_t"


INT, UINT, LONG, ULONG = CType(32, True), CType(32, False), CType(64, True), CType(64, False)
_STDINT = {f"{u}int{n}_t": CType(n, not u) for n in (8, 16, 32, 64) for u in ("", "u")}
_SPECIFIERS = {"signed", "unsigned", "char", "short", "int", "long"}
_QUALIFIERS = {"const", "volatile", "register"}
TYPE_WORDS = set(_STDINT) | _SPECIFIERS | _QUALIFIERS
_REFUSED = {"if", "else", "for", "while", "do", "switch", "case", "default", "goto", "break", "continue",
            "sizeof", "struct", "union", "enum", "typedef", "asm", "__asm__", "float", "double", "void",
            "extern", "_Bool", "bool", "static", "inline", "auto"}
_BINARY = {"||": 1, "&&": 2, "|": 3, "^": 4, "&": 5, "==": 6, "!=": 6, "<": 7, ">": 7, "<=": 7,
           ">=": 7, "<<": 8, ">>": 8, "+": 9, "-": 9, "*": 10, "/": 10, "%": 10}
_COMPOUND = {"=", "|=", "&=", "^=", "+=", "-=", "*=", "<<=", ">>=", "/=", "%="}


@dataclass
class Val:
    type: CType
    bits: list


@dataclass
class CFunction:
    """What evaluating the function gave: its name, parameters and the returned value per pair."""
    name: str
    params: list          # [(name, CType)]
    ret_type: CType
    result: list          # slices of the returned value (ret_type.bits long)
    line: int


def tokenize(text: str, where: str) -> list:
    toks, line, pos, at_line_start = [], 1, 0, True
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            ch = text[pos]
            what = "an unterminated comment" if text.startswith("/*", pos) else (
                "a string or character literal" if ch in "\"'" else f"the character {ch!r}")
            raise UserError(f"{where}:{line}: {what} is outside the supported C subset")
        kind, s = m.lastgroup, m.group()
        pos = m.end()
        if kind == "nl":
            line, at_line_start = line + 1, True
            continue
        if kind in ("ws", "lc"):
            continue
        if kind == "bc":
            line += s.count("\n")
            continue
        if s == "#":
            if not at_line_start:
                raise UserError(f"{where}:{line}: '#' outside a preprocessor line")
            end = text.find("\n", pos)
            directive = text[pos: len(text) if end < 0 else end]
            directive = re.sub(r"//.*|/\*.*?\*/", "", directive).strip()
            inc = re.fullmatch(r"include\s*<\s*([A-Za-z0-9_./]+)\s*>", directive)
            if not inc or inc.group(1) not in ALLOWED_INCLUDES:
                raise UserError(f"{where}:{line}: `#{directive}` is outside the supported C subset (the only "
                                f"preprocessor lines allowed are #include <stdint.h> and #include <stdlib.h>)")
            pos = len(text) if end < 0 else end
            continue
        at_line_start = False
        toks.append((kind, s, line))
    toks.append(("eof", "", line))
    return toks


def _literal(text: str) -> tuple[int, str]:
    m = re.fullmatch(r"(0[xX][0-9a-fA-F]+|0[bB][01]+|0[0-7]*|[1-9][0-9]*)([uU]?[lL]{0,2}|[lL]{1,2}[uU])", text)
    if not m:
        return None, ""
    digits, suffix = m.group(1), m.group(2).lower()
    if len(digits) > 70:  # longer than any 64-bit constant's digits (0b + 64): too large, without int()'s cost
        return 1 << 64, suffix
    if digits[:2].lower() == "0x":
        value = int(digits, 16)
    elif digits[:2].lower() == "0b":
        value = int(digits[2:], 2)
    elif digits.startswith("0") and len(digits) > 1:
        value = int(digits, 8)
    else:
        value = int(digits)
    return value, suffix


class _Evaluator(TokenStream):
    def __init__(self, text: str, where: str, operands: dict, extend_signed: bool = False):
        super().__init__(tokenize(text, where), where)
        self.extend_signed = extend_signed
        self.operands = operands
        self.env: dict = {}
        self.live = 0      # operand-dependent slices held by env: what the evaluation's memory grows with
        self.deadline = Deadline(where)

    def bind(self, name: str, t: CType, bits) -> None:
        live = sum(not isinstance(b, int) for b in bits or ())
        old = self.env.get(name, (None, None))[1]
        self.live += live - sum(not isinstance(b, int) for b in old or ())
        if self.live > MAX_LIVE_SLICES:
            self.fail(f"the variables hold more than {MAX_LIVE_SLICES:,} operand-dependent bits at once, the limit "
                      f"of the circuit importer")
        self.env[name] = (t, bits)

    def refuse_word(self, t):
        if t[1] in _REFUSED:
            what = {"if": "a branch (if)", "for": "a loop (for)", "while": "a loop (while)", "do": "a loop (do)",
                    "switch": "a branch (switch)", "goto": "goto", "float": "floating point",
                    "double": "floating point", "static": "a static declaration"}.get(t[1], f"`{t[1]}`")
            self.fail(f"{what} is outside the supported C subset (straight-line integer code only)", t[2])

    # ------------------------------------------------------------ types
    def at_type(self):
        return self.peek()[0] == "id" and self.peek()[1] in TYPE_WORDS

    def parse_type(self) -> CType:
        words, line = [], self.peek()[2]
        while self.peek()[0] == "id" and self.peek()[1] in TYPE_WORDS | _REFUSED:
            t = self.next()
            self.refuse_word(t)
            if t[1] not in _QUALIFIERS:
                words.append(t[1])
        if self.peek()[1] == "*":
            self.fail("a pointer is outside the supported C subset")
        std = [w for w in words if w in _STDINT]
        if std:
            if len(words) != 1:
                self.fail(f"invalid type {' '.join(words)!r}", line)
            return _STDINT[std[0]]
        if not words:
            self.fail(f"expected a type, found {self.peek()[1]!r}")
        signed = "unsigned" not in words
        rest = [w for w in words if w not in ("signed", "unsigned")]
        if words.count("signed") + words.count("unsigned") > 1 or rest.count("char") + rest.count("short") > 1:
            self.fail(f"invalid type {' '.join(words)!r}", line)
        if "char" in rest:
            bits = 8
        elif "short" in rest:
            bits = 16
        elif "long" in rest:
            bits = 64
        else:
            bits = 32
        if any(w not in ("char", "short", "int", "long") for w in rest) or rest.count("long") > 2:
            self.fail(f"invalid type {' '.join(words)!r}", line)
        return CType(bits, signed)

    # ------------------------------------------------------------ values
    @staticmethod
    def convert(v: Val, t: CType) -> Val:
        return Val(t, bs.resize(v.bits, t.bits, v.type.signed))

    def promote(self, v: Val) -> Val:
        return self.convert(v, INT) if v.type.bits < 32 else v

    @staticmethod
    def common(t1: CType, t2: CType) -> CType:
        if t1 == t2:
            return t1
        if t1.signed == t2.signed:
            return t1 if t1.bits >= t2.bits else t2
        u, s = (t1, t2) if not t1.signed else (t2, t1)
        return u if u.bits >= s.bits else s

    def arith(self, a: Val, b: Val) -> tuple[Val, Val]:
        a, b = self.promote(a), self.promote(b)
        t = self.common(a.type, b.type)
        return self.convert(a, t), self.convert(b, t)

    @staticmethod
    def boolean(slice_) -> Val:
        return Val(INT, [slice_] + [0] * 31)

    def truth(self, v: Val):
        return bs.any_bit(v.bits)

    # ------------------------------------------------------------ expressions
    def _select(self, cond: Val, a: Val, b: Val) -> Val:
        a, b = self.arith(a, b)
        return Val(a.type, bs.mux_word(self.truth(cond), a.bits, b.bits))

    def expression(self) -> Val:
        self.enter()
        try:
            return self.conditional(self._select)
        finally:
            self.depth -= 1

    def binary(self, level: int) -> Val:
        left = self.unary()
        while True:
            op, line = self.peek()[1], self.peek()[2]
            prec = _BINARY.get(op) if self.peek()[0] == "op" else None
            if prec is None or prec < level:
                return left
            self.next()
            right = self.binary(prec + 1)
            left = self.apply(op, left, right, line)

    def apply(self, op, a: Val, b: Val, line) -> Val:
        self.deadline.check()
        if op in ("/", "%"):
            self.fail(f"{'division' if op == '/' else 'remainder'} is outside the supported C subset", line)
        if op == "&&":
            return self.boolean(bs.AND(self.truth(a), self.truth(b)))
        if op == "||":
            return self.boolean(bs.OR(self.truth(a), self.truth(b)))
        if op in ("<<", ">>"):
            a, b = self.promote(a), self.promote(b)
            k = bs.constant_value(b.bits, b.type.signed)
            if k is None:
                self.fail(f"a shift by an amount that depends on the operands is outside the supported C subset", line)
            if not 0 <= k < a.type.bits:
                self.fail(f"shift by {k} of a {a.type.bits}-bit value (undefined behaviour in C)", line)
            if op == "<<":
                return Val(a.type, bs.shift_left(a.bits, k))
            return Val(a.type, bs.shift_right(a.bits, k, a.type.signed))
        a, b = self.arith(a, b)
        if op in ("&", "|", "^"):
            return Val(a.type, bs.bitwise({"&": bs.AND, "|": bs.OR, "^": bs.XOR}[op], a.bits, b.bits))
        if op == "+":
            return Val(a.type, bs.add(a.bits, b.bits))
        if op == "-":
            return Val(a.type, bs.sub(a.bits, b.bits))
        if op == "*":
            return Val(a.type, bs.mul(a.bits, b.bits))
        if op in ("==", "!="):
            eq = bs.equal(a.bits, b.bits)
            return self.boolean(eq if op == "==" else bs.NOT(eq))
        lt = {"<": (a, b), ">": (b, a), "<=": (b, a), ">=": (a, b)}[op]
        r = bs.less(lt[0].bits, lt[1].bits, a.type.signed)
        return self.boolean(r if op in ("<", ">") else bs.NOT(r))

    def unary(self) -> Val:
        kind, s, line = self.peek()
        if kind == "op" and s in ("~", "!", "-", "+"):
            self.next()
            self.enter()
            v = self.promote(self.unary())
            self.depth -= 1
            if s == "~":
                return Val(v.type, bs.invert(v.bits))
            if s == "-":
                return Val(v.type, bs.neg(v.bits))
            if s == "!":
                return self.boolean(bs.NOT(self.truth(v)))
            return v
        if kind == "op" and s in ("++", "--", "*", "&"):
            what = {"++": "increment", "--": "decrement"}.get(s, "a pointer")
            self.fail(f"{what} ({s}) is outside the supported C subset", line)
        if s == "(" and self.peek(1)[0] == "id" and self.peek(1)[1] in TYPE_WORDS | _REFUSED:
            self.next()
            t = self.parse_type()
            self.expect(")")
            self.enter()
            v = self.convert(self.unary(), t)
            self.depth -= 1
            return v
        return self.primary()

    def primary(self) -> Val:
        kind, s, line = self.next()
        if kind == "num":
            value, suffix = _literal(s)
            if value is None:
                self.fail(f"{s!r} is not an integer constant of the supported C subset", line)
            decimal = not s.startswith("0") or s == "0"
            cands = {"": [INT, LONG] if decimal else [INT, UINT, LONG, ULONG], "u": [UINT, ULONG],
                     "l": [LONG] if decimal else [LONG, ULONG], "ll": [LONG] if decimal else [LONG, ULONG]}
            cands.update({"ul": [ULONG], "lu": [ULONG], "ull": [ULONG], "llu": [ULONG]})
            for t in cands.get(suffix, []):
                if value < (1 << (t.bits - 1 if t.signed else t.bits)):
                    return Val(t, bs.const(value, t.bits))
            self.fail(f"integer constant {s} is too large", line)
        if kind == "id":
            self.refuse_word((kind, s, line))
            if self.peek()[1] == "(":
                self.fail(f"a function call ({s}(...)) is outside the supported C subset", line)
            if self.peek()[1] == "[":
                self.fail("an array is outside the supported C subset", line)
            if s not in self.env:
                self.fail(f"{s!r} is not declared", line)
            t, bits = self.env[s]
            if bits is None:
                self.fail(f"{s!r} is read before it is assigned (undefined behaviour in C)", line)
            return Val(t, bits)
        if s == "(":
            v = self.expression()
            self.expect(")")
            return v
        self.fail("unexpected end of the file (is it truncated?)" if kind == "eof" else f"unexpected {s!r}", line)

    # ------------------------------------------------------------ statements
    def declaration(self):
        t = self.parse_type()
        while True:
            kind, name, line = self.next()
            if kind != "id" or name in TYPE_WORDS | _REFUSED:
                self.fail(f"expected a variable name, found {name!r}", line)
            if self.peek()[1] == "[":
                self.fail("an array is outside the supported C subset")
            if self.peek()[1] == "(":
                self.fail("a function declaration inside a function is outside the supported C subset")
            if name in self.env:
                self.fail(f"{name!r} is declared twice", line)
            self.env[name] = (t, None)
            if self.peek()[1] == "=":
                self.next()
                self.bind(name, t, self.convert(self.expression(), t).bits)
            if self.next()[1] == ";":
                return
            if self.toks[self.i - 1][1] != ",":
                self.fail(f"expected ',' or ';' in a declaration, found {self.toks[self.i - 1][1]!r}",
                          self.toks[self.i - 1][2])

    def assignment(self):
        kind, name, line = self.next()
        op = self.next()
        if op[1] not in _COMPOUND:
            if op[1] == "(":
                self.fail(f"a function call ({name}(...)) is outside the supported C subset", line)
            if op[1] in ("++", "--", "["):
                self.fail(f"{op[1]!r} is outside the supported C subset", line)
            self.fail(f"expected an assignment to {name!r}, found {op[1]!r}", op[2])
        if name not in self.env:
            self.fail(f"{name!r} is not declared", line)
        t, bits = self.env[name]
        value = self.expression()
        if op[1] != "=":
            if bits is None:
                self.fail(f"{name!r} is read before it is assigned (undefined behaviour in C)", line)
            value = self.apply(op[1][:-1], Val(t, bits), value, line)
        self.bind(name, t, self.convert(value, t).bits)
        self.expect(";")

    def function(self) -> CFunction:
        if self.peek()[0] == "eof":
            self.fail("no function found (empty or truncated file?)")
        while self.peek()[1] in ("static", "inline"):
            self.next()
        ret = self.parse_type()
        kind, fname, line = self.next()
        if kind != "id":
            self.fail(f"expected a function name, found {fname!r}", line)
        self.expect("(")
        params = []
        while True:
            pt = self.parse_type()
            k, pname, pline = self.next()
            if k != "id":
                self.fail(f"expected a parameter name, found {pname!r}", pline)
            params.append((pname, pt))
            if self.peek()[1] == ",":
                self.next()
                continue
            self.expect(")")
            break
        if len(params) != 2:
            self.fail(f"{fname} takes {len(params)} parameters; a multiplier takes two operands", line)
        if params[0][0] == params[1][0]:
            self.fail(f"both parameters are named {params[0][0]!r}", line)
        for pname, pt in params:
            # an 8-bit operand reaches a wider parameter as its value: sign-extended for a signed multiplier
            self.env[pname] = (pt, bs.resize(self.operands[pname], pt.bits, self.extend_signed))
        self.expect("{")
        while True:
            kind, s, sline = self.peek()
            if kind == "eof":
                self.fail(f"the function {fname} is not closed (is the file truncated?)", sline)
            if s == "return":
                self.next()
                value = self.convert(self.expression(), ret)
                self.expect(";")
                if self.peek()[1] != "}":
                    self.fail("code after `return` is outside the supported C subset")
                self.next()
                break
            if s == "}":
                self.fail(f"{fname} ends without `return`", sline)
            if s == ";":
                self.next()
            elif s == "{":
                self.fail("a nested block is outside the supported C subset", sline)
            elif kind == "id" and (s in TYPE_WORDS):
                self.declaration()
            elif kind == "id":
                self.refuse_word(self.peek())
                self.assignment()
            else:
                self.fail(f"unexpected {s!r}", sline)
        if self.peek()[0] != "eof":
            self.fail("more than one function, or code after the function: outside the supported C subset "
                      "(one multiplier function per file)")
        return CFunction(fname, params, ret, value.bits, line)


def parameters(text: str, where: str) -> tuple[str, list, int]:
    """(function name, [(parameter name, CType)], line) read from the head of the single function."""
    ev = _Evaluator(text, where, {})
    while ev.peek()[1] in ("static", "inline"):
        ev.next()
    ev.parse_type()
    kind, fname, line = ev.next()
    if kind != "id" or ev.peek()[1] != "(":
        ev.fail("expected one function `TYPE NAME(TYPE A, TYPE B) { ... }`", line)
    ev.next()
    params = []
    while ev.peek()[0] != "eof":
        pt = ev.parse_type()
        k, pname, _ = ev.next()
        params.append((pname, pt))
        if ev.next()[1] != ",":
            break
    return fname, params, line


def evaluate(text: str, where: str, operands: dict, *, extend_signed: bool = False) -> CFunction:
    """Evaluate the single function; operands maps each parameter name to its 8 operand-code slices,
    extended into wider parameters with sign (extend_signed) or zeros."""
    return _Evaluator(text, where, operands, extend_signed).function()
