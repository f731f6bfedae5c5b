"""The token cursor both circuit parsers (C models, Verilog netlists) read with: tokens are
(kind, text, line) tuples ending in one ("eof", "", line); every error names file:line."""
from __future__ import annotations

import re
import time

from ..errors import UserError

# Limits on what a circuit file may ask of the evaluators (docs/multipliers.md states them): a hostile
# or broken file is refused with the limit named, never a RecursionError, MemoryError or a hang. Real
# circuits (EvoApproxLib's largest: a few thousand gates, expressions a few levels deep) stay far below.
MAX_NESTING = 1000        # levels of one expression: parentheses, unary operators, ?:, operator chains
MAX_WIDTH = 65_536        # bits of one Verilog net, constant, replication or concatenation
MAX_NET_BITS = 200_000    # bits of all nets of a flattened Verilog design
MAX_INSTANCES = 100_000   # module instances of a flattened Verilog design
MAX_HIERARCHY = 1000      # levels of modules instantiating modules
MAX_LIVE_SLICES = 100_000  # operand-dependent bits held by a C model's variables at once (8 KiB each)
MAX_SECONDS = 20.0        # evaluating one circuit
_MAX_WORD = 80            # characters of a name or constant quoted in a message


def shorten(message: str) -> str:
    """message with every run of more than _MAX_WORD non-space characters (a million-character name)
    cut to its start and its length."""
    def cut(m):
        word = m.group()
        # the file's own path (a deep temporary directory) stays whole: it is what the user must find
        if "/" in word and len(word) <= 4096:
            return word
        return f"{word[:_MAX_WORD // 2]}...({len(word):,} characters)"

    return re.sub(r"[^\s'\"`]{%d,}" % (_MAX_WORD + 1), cut, message)


class Deadline:
    def __init__(self, where: str):
        self.where, self.end = where, time.perf_counter() + MAX_SECONDS

    def check(self):
        if time.perf_counter() > self.end:
            raise UserError(f"{self.where}: evaluating the circuit takes longer than {MAX_SECONDS:.0f} s, the "
                            f"limit for one circuit (a multiplier's C model or netlist evaluates in about a second)")


class TokenStream:
    def __init__(self, toks: list, where: str):
        self.toks, self.where, self.i = toks, where, 0
        self.depth = 0

    def enter(self):
        """One more level of expression nesting (the parsers recurse once per level)."""
        self.depth += 1
        if self.depth > MAX_NESTING:
            self.fail(f"an expression nested more than {MAX_NESTING} levels deep (parentheses, unary operators, "
                      f"?:), the limit of the circuit importer")

    def peek(self, k=0):
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def next(self):
        t = self.toks[self.i]
        if t[0] != "eof":
            self.i += 1
        return t

    def fail(self, msg, line=None):
        raise UserError(f"{self.where}:{self.peek()[2] if line is None else line}: {msg}")

    def expect(self, s):
        t = self.next()
        if t[1] != s or t[0] == "eof":
            got = "the end of the file (is it truncated?)" if t[0] == "eof" else repr(t[1])
            self.fail(f"expected {s!r}, found {got}", t[2])
        return t

    def conditional(self, combine):
        """`cond ? a : b` (right-associative, as in C and Verilog) over the parser's binary(1) and expression();
        combine(cond, a, b) makes its value; without `?`, the binary expression itself."""
        cond = self.binary(1)
        if self.peek()[1] != "?":
            return cond
        self.next()
        a = self.expression()
        self.expect(":")
        return combine(cond, a, self.expression())
