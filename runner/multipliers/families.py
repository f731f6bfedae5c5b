"""Multipliers generated from published designs, with their parameters exposed.

Each design is defined on unsigned 8-bit magnitudes x (operand A, activation) and y (operand
B, weight) and evaluated for all 65,536 pairs at once. Signed variants use sign-magnitude:
P(a, b) = sign(a) sign(b) f(|a|, |b|), with |a| <= 128 still fitting the 8-bit core.

  exact                 x * y
  optrunc(k)            operand truncation: the k low bits of each operand are zeroed
  prodtrunc(k)          product truncation: the k low bits of the exact product are zeroed
  drum(k)               DRUM-k, Hashemi, Bahar & Reda, ICCAD 2015
  mitchell              Mitchell's logarithmic multiplier, IRE Trans. Electron. Comput. 1962
  bam(hbl, vbl)         broken-array multiplier, Mahdiani et al., IEEE TCAS-I 57(4) 2010

Generated names encode the parameters, e.g. drum4_s, bam_h2v8_u, so a name alone resolves.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

from ..errors import UserError
from .core import SIZE, Multiplier, operands

# family -> {param: (min, max)}
FAMILIES = {
    "exact": {},
    "optrunc": {"k": (0, 8)},
    "prodtrunc": {"k": (0, 16)},
    "drum": {"k": (3, 8)},  # k < 3 overflows the signed 16-bit product (|-128| rounds up to 192)
    "mitchell": {},
    "bam": {"hbl": (0, 8), "vbl": (0, 16)},
}

REFERENCES = {
    "exact": "exact product",
    "optrunc": "operand truncation (k low bits of each operand zeroed)",
    "prodtrunc": "product truncation (k low bits of the product zeroed)",
    "drum": "DRUM-k: S. Hashemi, R. I. Bahar, S. Reda, 'DRUM: A Dynamic Range Unbiased Multiplier "
            "for Approximate Applications', ICCAD 2015",
    "mitchell": "J. N. Mitchell, 'Computer Multiplication and Division Using Binary Logarithms', "
                "IRE Trans. Electronic Computers EC-11(4), 1962",
    "bam": "broken-array multiplier: H. R. Mahdiani, A. Ahmadi, S. M. Fakhraie, C. Lucas, 'Bio-Inspired "
           "Imprecise Computational Blocks for Efficient VLSI Implementation of Soft-Computing "
           "Applications', IEEE TCAS-I 57(4), 2010",
}

# Instances listed by `approx-run lut list` (the config group's defaults).
DEFAULT_INSTANCES = [
    ("exact", True, {}), ("exact", False, {}),
    ("optrunc", True, {"k": 2}), ("prodtrunc", True, {"k": 8}),
    ("drum", True, {"k": 4}), ("drum", False, {"k": 4}),
    ("mitchell", True, {}), ("mitchell", False, {}),
    ("bam", True, {"hbl": 0, "vbl": 8}), ("bam", False, {"hbl": 0, "vbl": 8}),
]


def _bit_length(x: np.ndarray) -> np.ndarray:
    n = np.zeros_like(x)
    for i in range(9):
        n += (x >> i) > 0
    return n


def exact(x, y):
    return x * y


def optrunc(x, y, k):
    mask = ~((1 << k) - 1)
    return (x & mask) * (y & mask)


def prodtrunc(x, y, k):
    return (x * y) & ~((1 << k) - 1)


def _drum_operand(x, k):
    # Keep k bits from the leading one; set the kept segment's LSB to 1 when bits were
    # dropped, which centres the truncation error (the paper's unbiasing step).
    shift = np.maximum(_bit_length(x) - k, 0)
    seg = x >> shift
    seg = np.where(shift > 0, seg | 1, seg)
    return seg, shift


def drum(x, y, k):
    sx, hx = _drum_operand(x, k)
    sy, hy = _drum_operand(y, k)
    return (sx * sy) << (hx + hy)


def mitchell(x, y):
    # log2(x) ~ k1 + f1 with x = 2^k1 (1 + f1); antilog of the sum is
    # 2^(k1+k2) (1 + f1 + f2) if f1 + f2 < 1, else 2^(k1+k2+1) (f1 + f2).
    # Scaled by 2^(k1+k2) both cases are integers, so no rounding choice arises.
    k1 = np.maximum(_bit_length(x) - 1, 0)
    k2 = np.maximum(_bit_length(y) - 1, 0)
    frac = ((x - (1 << k1)) << k2) + ((y - (1 << k2)) << k1)   # (f1 + f2) 2^(k1+k2)
    one = 1 << (k1 + k2)
    p = np.where(frac < one, one + frac, frac << 1)
    return np.where((x == 0) | (y == 0), 0, p)


def bam(x, y, hbl, vbl):
    # Array multiplier with the partial-product cells x_i y_j (weight 2^(i+j)) removed for
    # rows j < hbl (low bits of operand B) and columns i + j < vbl.
    p = np.zeros(np.broadcast_shapes(x.shape, y.shape), dtype=np.int64)
    for j in range(hbl, 8):
        for i in range(8):
            if i + j >= vbl:
                p += (((x >> i) & 1) * ((y >> j) & 1)) << (i + j)
    return p


FUNCS = {"exact": exact, "optrunc": optrunc, "prodtrunc": prodtrunc, "drum": drum,
         "mitchell": mitchell, "bam": bam}


def family_name(family: str, signed: bool, params: dict) -> str:
    sfx = "s" if signed else "u"
    if family == "bam":
        return f"bam_h{params['hbl']}v{params['vbl']}_{sfx}"
    return f"{family}{''.join(str(params[p]) for p in FAMILIES[family])}_{sfx}"


_NAME_RE = re.compile(r"^(?:(exact|mitchell)|(optrunc|prodtrunc|drum)(\d+)|(bam)_h(\d+)v(\d+))_([su])$")


def parse_family_name(name: str):
    """(family, signed, params) for a generated name such as drum4_s, or None."""
    m = _NAME_RE.match(name)
    if not m:
        return None
    signed = m.group(7) == "s"
    if m.group(1):
        return m.group(1), signed, {}
    if m.group(2):
        return m.group(2), signed, {"k": int(m.group(3))}
    return "bam", signed, {"hbl": int(m.group(5)), "vbl": int(m.group(6))}


def check_params(family: str, params: dict) -> dict:
    if family not in FAMILIES:
        raise UserError(f"unknown multiplier family {family!r}; families: {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    extra = set(params) - set(spec)
    if extra:
        raise UserError(f"family {family}: unknown parameter(s) {', '.join(sorted(extra))}; "
                        f"it takes {', '.join(spec) or 'no parameters'}")
    out = {}
    for p, (lo, hi) in spec.items():
        if params.get(p) is None:
            raise UserError(f"family {family}: parameter {p} is required ({lo}..{hi})")
        v = params[p]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
            raise UserError(f"family {family}: {p}={v!r} must be an integer in {lo}..{hi}")
        out[p] = int(v)
    return out


def generate_table(family: str, signed: bool, params: dict) -> np.ndarray:
    """int64 [256, 256] table of a family in our layout (row = A, column = B)."""
    a = operands(signed)
    x, y = np.abs(a)[:, None], np.abs(a)[None, :]
    p = FUNCS[family](x, y, **params)
    if signed:
        p = p * (np.sign(a)[:, None] * np.sign(a)[None, :])
    return np.broadcast_to(p, (SIZE, SIZE)).astype(np.int64)


@lru_cache(maxsize=None)
def _build(family: str, signed: bool, items: tuple) -> Multiplier:
    params = dict(items)
    return Multiplier(
        name=family_name(family, signed, params),
        signed=signed,
        lut=generate_table(family, signed, params).astype(np.int32),
        source=f"generated: {REFERENCES[family]}" + ("; signed by sign-magnitude" if signed else ""),
        params={"family": family, **params},
    )


def build(family: str, signed: bool = True, **params) -> Multiplier:
    params = check_params(family, params)
    if not isinstance(signed, bool):
        raise UserError(f"family {family}: signed must be true or false, got {signed!r}")
    return _build(family, signed, tuple(sorted(params.items())))
