"""The `Multiplier` record shared by every part of the library.

Table layout (the contract with the kernels; their reference is runner/reference.py):
  lut is torch.int32 [256, 256], row = operand A (the activation), column = operand B (the
  weight). Approximate multipliers are often not commutative, so the two axes are not
  interchangeable.
    signed:   A = row - 128, B = col - 128 (offset-128 rows, ApproxTorch's text layout)
    unsigned: A = row,       B = col       (0..255)

sha256 identifies a table independently of the file it came from: the hex SHA-256 of the
table as little-endian int32 in row-major order, i.e.
    hashlib.sha256(lut.numpy().astype("<i4").tobytes()).hexdigest()
"""

from __future__ import annotations

import hashlib
import functools
from dataclasses import dataclass, field

import numpy as np
import torch

SIZE = 256
TWO16 = 1 << 16
# Value range a table may hold: an 8x8 multiplier has a 16-bit product.
SIGNED_RANGE = (-(1 << 15), (1 << 15) - 1)
UNSIGNED_RANGE = (0, (1 << 16) - 1)


def operands(signed: bool) -> np.ndarray:
    """Operand value of each row (and column) index."""
    idx = np.arange(SIZE, dtype=np.int64)
    return idx - 128 if signed else idx


def exact_table(signed: bool) -> np.ndarray:
    a = operands(signed)
    return np.outer(a, a)


def exact_lut(signed: bool) -> torch.Tensor:
    """The exact 8-bit multiplier in the ops' LUT layout (int32 [256, 256])."""
    return torch.from_numpy(exact_table(signed).astype(np.int32))


def table_sha256(values) -> str:
    arr = values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    return hashlib.sha256(np.ascontiguousarray(arr, dtype="<i4").tobytes()).hexdigest()


def value_range(signed: bool) -> tuple[int, int]:
    return SIGNED_RANGE if signed else UNSIGNED_RANGE


@dataclass(eq=False)
class Multiplier:
    name: str
    signed: bool
    lut: torch.Tensor
    sha256: str = ""
    source: str = ""
    published: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        lut = torch.as_tensor(self.lut)
        if lut.shape != (SIZE, SIZE):
            raise ValueError(f"multiplier {self.name}: table shape {tuple(lut.shape)}, expected (256, 256)")
        self.lut = lut.to(torch.int32).contiguous()
        self.signed = bool(self.signed)
        if not self.sha256:
            self.sha256 = table_sha256(self.lut)

    @functools.cached_property
    def value_bounds(self) -> tuple[int, int]:
        """(smallest, largest) product in the table; asked once per layer a table is put in, and a
        reduction over the table each time was a noticeable part of a sweep job."""
        return int(self.lut.min()), int(self.lut.max())

    @property
    def operand_range(self) -> tuple[int, int]:
        return (-128, 127) if self.signed else (0, 255)

    @property
    def activation_dtype(self) -> torch.dtype:
        """dtype of activation codes this table is indexed with (see runner/reference.py)."""
        return torch.int8 if self.signed else torch.uint8

    def product(self, a: int, b: int) -> int:
        """The table's product for operand values a (activation) and b (weight)."""
        off = 128 if self.signed else 0
        lo, hi = self.operand_range
        if not (lo <= a <= hi and lo <= b <= hi):
            raise ValueError(f"operands ({a}, {b}) outside {self.operand_range}")
        return int(self.lut[a + off, b + off])

    def error_table(self) -> np.ndarray:
        """lut - exact product, int64 [256, 256] in the same layout as lut."""
        return self.lut.numpy().astype(np.int64) - exact_table(self.signed)

    def __repr__(self) -> str:
        return (f"Multiplier(name={self.name!r}, signed={self.signed}, sha256={self.sha256[:12]}..., "
                f"source={self.source!r})")
