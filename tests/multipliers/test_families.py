import numpy as np
import pytest

from runner.errors import UserError
from runner.multipliers import build_family, exact_table, get, metrics_of
from runner.multipliers.families import FAMILIES, family_name, parse_family_name

# (family, params, signed, a, b, expected product), worked out by hand from each definition.
CASES = [
    # operand truncation, k=2: 7 -> 4, 9 -> 8
    ("optrunc", {"k": 2}, False, 7, 9, 32),
    ("optrunc", {"k": 2}, True, -7, 9, -32),
    ("optrunc", {"k": 3}, False, 255, 255, 248 * 248),
    # product truncation, k=4: 63 = 0b111111 -> 0b110000; signed truncates the magnitude
    ("prodtrunc", {"k": 4}, False, 7, 9, 48),
    ("prodtrunc", {"k": 4}, True, 7, -9, -48),
    ("prodtrunc", {"k": 8}, False, 255, 255, 65025 & ~255),
    # DRUM-4: 200 = 1100_1000 -> segment 1100, LSB set -> 1101 = 13, shift 4; 5 fits in 4 bits
    ("drum", {"k": 4}, False, 200, 5, (13 * 5) << 4),
    ("drum", {"k": 4}, False, 255, 255, (15 * 15) << 8),
    # 16 = 1_0000 -> 1000 -> 1001 = 9, shift 1; 15 kept exactly
    ("drum", {"k": 4}, False, 15, 16, (15 * 9) << 1),
    # |-100| = 110_0100 -> 1100 -> 1101 = 13, shift 3; 37 = 10_0101 -> 1001 (LSB already 1), shift 2
    ("drum", {"k": 4}, True, -100, 37, -((13 * 9) << 5)),
    ("drum", {"k": 4}, True, -128, -128, (9 * 9) << 8),
    ("drum", {"k": 3}, False, 6, 7, 42),
    # Mitchell: 3*3: log 1.5+1.5 = 3 -> 2^3 = 8; 5*6: 2.25+2.5 = 4.75 -> 16*1.75 = 28;
    # 7*9: 2.75+3.125 = 5.875 -> 32*1.875 = 60; 255*255: 7.9921875*2 -> 2^15*(1.984375) = 65024
    ("mitchell", {}, False, 3, 3, 8),
    ("mitchell", {}, False, 5, 6, 28),
    ("mitchell", {}, False, 7, 9, 60),
    ("mitchell", {}, False, 255, 255, 65024),
    ("mitchell", {}, False, 2, 3, 6),
    ("mitchell", {}, False, 0, 77, 0),
    ("mitchell", {}, True, -5, 6, -28),
    # BAM: cells x_i*y_j dropped for rows j < hbl and columns i+j < vbl
    ("bam", {"hbl": 2, "vbl": 0}, False, 7, 7, 28),      # only row j=2 of y=111 survives: 7*4
    ("bam", {"hbl": 2, "vbl": 0}, False, 5, 6, 20),      # y=110: row 2 -> 5*4 (row 1 dropped)
    ("bam", {"hbl": 2, "vbl": 0}, False, 6, 5, 24),      # y=101: row 2 -> 6*4: not commutative
    ("bam", {"hbl": 1, "vbl": 4}, False, 5, 6, 16),      # only x_2*y_2 (weight 16) survives
    ("bam", {"hbl": 0, "vbl": 8}, False, 255, 255, 65025 - 1793),  # dropped sum_{s<8} (s+1) 2^s
    ("bam", {"hbl": 1, "vbl": 4}, True, -5, 6, -16),
]


@pytest.mark.parametrize("family,params,signed,a,b,expected", CASES)
def test_hand_computed(family, params, signed, a, b, expected):
    assert build_family(family, signed, **params).product(a, b) == expected


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("pick", [0, 1])
def test_sign_magnitude_and_range(family, signed, pick):
    params = {p: bounds[pick] for p, bounds in FAMILIES[family].items()}
    m = build_family(family, signed, **params)
    t = m.lut.numpy().astype(np.int64)
    assert m.name == family_name(family, signed, params)
    assert parse_family_name(m.name) == (family, signed, params)
    assert get(m.name) is m  # names resolve to the cached instance
    if signed:
        # P(-a, b) = -P(a, b) for |a| <= 127
        assert np.array_equal(t[1:128][::-1], -t[129:256]) and (t[128] == 0).all()
        lo, hi = -32768, 32767
    else:
        lo, hi = 0, 65535
    assert t.min() >= lo and t.max() <= hi


def test_full_precision_is_exact():
    for fam, params in [("drum", {"k": 8}), ("optrunc", {"k": 0}), ("prodtrunc", {"k": 0}),
                        ("bam", {"hbl": 0, "vbl": 0})]:
        for s in (True, False):
            assert np.array_equal(build_family(fam, s, **params).lut.numpy(), exact_table(s))


def test_mitchell_never_overestimates_and_worst_case_is_one_ninth():
    m = build_family("mitchell", False)
    err = m.error_table()
    assert err.max() == 0
    assert metrics_of(m)["wcre_pct"] == pytest.approx(100 / 9)


def test_drum_unbiased_relative_to_truncation():
    # Setting the LSB centres the error: mean relative error well under plain truncation's.
    d = metrics_of(build_family("drum", False, k=4))
    assert abs(d["mean_error"]) < d["error_std"] / 5


@pytest.mark.parametrize("family,params,msg", [
    ("drum", {}, "parameter k is required"),
    ("drum", {"k": 0}, "must be an integer in 3..8"),
    ("drum", {"k": 2.5}, "must be an integer"),
    ("bam", {"hbl": 1, "vbl": 17}, "vbl=17"),
    ("mitchell", {"k": 3}, "unknown parameter(s) k"),
    ("booth", {}, "unknown multiplier family"),
])
def test_param_errors(family, params, msg):
    with pytest.raises(UserError, match=None) as e:
        build_family(family, True, **params)
    assert msg in str(e.value)
