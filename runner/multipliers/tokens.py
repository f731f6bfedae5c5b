"""The token cursor both circuit parsers (C models, Verilog netlists) read with: tokens are
(kind, text, line) tuples ending in one ("eof", "", line); every error names file:line."""
from __future__ import annotations

from ..errors import UserError


class TokenStream:
    def __init__(self, toks: list, where: str):
        self.toks, self.where, self.i = toks, where, 0

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
