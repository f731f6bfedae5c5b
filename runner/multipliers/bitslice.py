"""Bit-sliced integer arithmetic over all 65,536 operand pairs at once, for the circuit evaluators.

A value of w bits is a list of w slices, least significant first. A slice holds one bit for every
operand pair: either the constant 0 or 1 (a Python int), or a packed array of 1,024 uint64 words
(bit k of word j belongs to pair 64*j + k, pair = a_code*256 + b_code). A gate on two packed slices
is one numpy operation on 8 KiB, so a netlist of thousands of gates evaluates in milliseconds,
and constants fold away (most bits of a C model's 64-bit variables are constant zeros).
Two's-complement wrap-around is the natural behaviour of the slices, as in C and Verilog.
"""

from __future__ import annotations

import numpy as np

PAIRS = 1 << 16


def pack(bits: np.ndarray):
    """A bool/0-1 array of PAIRS entries as a slice (a constant where every pair agrees)."""
    if not bits.any():
        return 0
    if bits.all():
        return 1
    return np.packbits(bits.astype(bool), bitorder="little").view("<u8")


def unpack(s) -> np.ndarray:
    if isinstance(s, int):
        return np.full(PAIRS, s, dtype=np.uint8)
    return np.unpackbits(s.view(np.uint8), bitorder="little")


def operand_bits(which: int, width: int = 8) -> list:
    """Slices of operand code a (which=0, pair // 256) or b (which=1, pair % 256)."""
    pair = np.arange(PAIRS, dtype=np.int64)
    code = pair >> 8 if which == 0 else pair & 0xFF
    return [pack((code >> i) & 1 == 1) for i in range(width)]


def to_codes(bits: list) -> np.ndarray:
    """The unsigned value of each pair (int64; at most 63 bits are combined)."""
    out = np.zeros(PAIRS, dtype=np.int64)
    for i, s in enumerate(bits):
        if not (isinstance(s, int) and not s):
            out |= unpack(s).astype(np.int64) << i
    return out


def same(x, y) -> bool:
    return x is y or (isinstance(x, int) and isinstance(y, int) and x == y)


# ---------------------------------------------------------------- gates on single slices

def NOT(x):
    return 1 - x if isinstance(x, int) else ~x


def AND(x, y):
    if isinstance(x, int):
        return y if x else 0
    if isinstance(y, int):
        return x if y else 0
    return x if x is y else x & y


def OR(x, y):
    if isinstance(x, int):
        return 1 if x else y
    if isinstance(y, int):
        return 1 if y else x
    return x if x is y else x | y


def XOR(x, y):
    if isinstance(x, int):
        return NOT(y) if x else y
    if isinstance(y, int):
        return NOT(x) if y else x
    return 0 if x is y else x ^ y


def MUX(s, a, b):
    """a where s is 1, else b."""
    if isinstance(s, int):
        return a if s else b
    if same(a, b):
        return a
    return OR(AND(s, a), AND(NOT(s), b))


# ---------------------------------------------------------------- words

def const(value: int, width: int) -> list:
    return [(value >> i) & 1 for i in range(width)]


def constant_value(bits: list, signed: bool = False) -> int | None:
    """The value when every slice is constant, else None."""
    if not all(isinstance(s, int) for s in bits):
        return None
    v = sum(s << i for i, s in enumerate(bits))
    if signed and bits and bits[-1]:
        v -= 1 << len(bits)
    return v


def resize(bits: list, width: int, signed: bool) -> list:
    if len(bits) >= width:
        return bits[:width]
    fill = bits[-1] if signed and bits else 0
    return bits + [fill] * (width - len(bits))


def bitwise(op, x: list, y: list) -> list:
    return [op(a, b) for a, b in zip(x, y)]


def invert(x: list) -> list:
    return [NOT(a) for a in x]


def fold(s):
    """A packed slice that is the same for every pair as that constant (keeps folding going, e.g. along
    the carry chain of a 64-bit C addition whose upper bits are all zero)."""
    if isinstance(s, int):
        return s
    if not s.any():
        return 0
    return 1 if (~s).any() == 0 else s


def add(x: list, y: list, carry=0) -> list:
    out = []
    for a, b in zip(x, y):
        t = XOR(a, b)
        out.append(XOR(t, carry))
        carry = fold(OR(AND(a, b), AND(carry, t)))
    return out


def carry_out(x: list, y: list, carry=0):
    for a, b in zip(x, y):
        t = XOR(a, b)
        carry = fold(OR(AND(a, b), AND(carry, t)))
    return carry


def sub(x: list, y: list) -> list:
    return add(x, invert(y), 1)


def neg(x: list) -> list:
    return add([0] * len(x), invert(x), 1)


def mul(x: list, y: list) -> list:
    """x * y modulo 2^len(x) (both of the same width)."""
    w = len(x)
    acc = [0] * w
    for j, b in enumerate(y):
        if isinstance(b, int) and not b:
            continue
        partial = [0] * j + [AND(a, b) for a in x[: w - j]]
        acc = add(acc, partial)
    return acc


def any_bit(x: list):
    r = 0
    for a in x:
        r = OR(r, a)
    return r


def equal(x: list, y: list):
    return NOT(any_bit(bitwise(XOR, x, y)))


def less(x: list, y: list, signed: bool):
    """x < y: no carry out of x + ~y + 1 (x >= y unsigned produces one); signed flips the sign bits."""
    if signed:
        x = x[:-1] + [NOT(x[-1])]
        y = y[:-1] + [NOT(y[-1])]
    return NOT(carry_out(x, invert(y), 1))


def shift_left(x: list, k: int) -> list:
    w = len(x)
    return ([0] * k + x)[:w]


def shift_right(x: list, k: int, arithmetic: bool) -> list:
    fill = x[-1] if arithmetic and x else 0
    return (x[k:] + [fill] * k)[: len(x)] if k < len(x) else [fill] * len(x)


def mux_word(s, a: list, b: list) -> list:
    return [MUX(s, p, q) for p, q in zip(a, b)]
