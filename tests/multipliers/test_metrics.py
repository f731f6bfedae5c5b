import gzip
import hashlib

import numpy as np
import pytest

from runner.multipliers import Multiplier, compute_metrics, exact_table, get, list_multipliers, manifest, metrics_of
from runner.multipliers.circuits import compare_published
from runner.multipliers.metrics import matches_published, published_convention
from runner.multipliers.registry import DATA

SHIPPED = [e["name"] for e in manifest()["multipliers"]]


def test_fifty_tables_shipped():
    assert len(SHIPPED) == 50
    assert sum(n.startswith("mul8s_") for n in SHIPPED) == 13
    assert sum(n.startswith("mul8u_") for n in SHIPPED) == 37
    assert set(SHIPPED) <= set(list_multipliers())


@pytest.mark.parametrize("name", SHIPPED)
def test_published_figures_reproduced(name):
    m = get(name)
    # MAE% follows the header's printed MAE (rounded: 1.25 -> "1.2") or the unrounded MAE, circuit by circuit
    ours = published_convention(metrics_of(m), m.published)
    for key in ("mae%", "wce%", "ep%", "mre%", "wcre%"):
        assert matches_published(ours[key], m.published[key]), (name, key, ours[key], m.published[key])
    ok, bad = compare_published(m.lut.numpy(), m.signed, m.published)
    assert {"mae%", "wce%", "ep%", "mre%", "wcre%", "mae", "wce", "mse"} - set(ok) <= {"mae"}, (name, bad)


def test_mae_convention_follows_the_header():
    # 0.875 is printed "0.88" and MAE% derives from it (round(., 1) would give 0.9 -> 0.0014)
    met = metrics_of(get("mul8u_27Y"))
    assert met["mae"] == 0.875 and get("mul8u_27Y").published["mae"] == "0.88"
    assert matches_published(published_convention(met, get("mul8u_27Y").published)["mae%"], "0.0013")
    # and mul8u_874 from the unrounded MAE
    m = get("mul8u_874")
    assert matches_published(published_convention(metrics_of(m), m.published)["mae%"], m.published["mae%"])


def test_mae_convention_is_needed():
    # EvoApproxLib derives MAE% from MAE rounded to 0.1: 1.25 -> 1.2 -> "0.0018", not 0.0019.
    met = metrics_of(get("mul8s_1KV8"))
    assert met["mae"] == 1.25
    assert not matches_published(met["mae_pct"], "0.0018")
    assert matches_published(published_convention(met)["mae%"], "0.0018")


@pytest.mark.parametrize("name", SHIPPED)
def test_package_data_matches_source_provenance(name):
    e = {x["name"]: x for x in manifest()["multipliers"]}[name]
    text = gzip.decompress((DATA / e["file"]).read_bytes())
    assert hashlib.sha256(text).hexdigest() == e["text_sha256"]
    assert get(name).sha256 == e["sha256"]
    assert e["source"].startswith("EvoApproxLib")


def test_manifest_keeps_license_and_citation():
    man = manifest()
    assert "MIT" in man["license"] and any("Mrazek" in c for c in man["citation"])


@pytest.mark.parametrize("name", ["exact_s", "exact_u", "mul8s_1KV6", "mul8u_1JJQ", "drum8_s", "optrunc0_u",
                                  "prodtrunc0_s", "bam_h0v0_u"])
def test_exact_tables_have_zero_error(name):
    met = metrics_of(get(name))
    assert all(met[k] == 0 for k in ("mae", "wce", "ep_pct", "mre_pct", "mean_error", "error_std", "mse"))


def test_hand_computed_metrics():
    t = exact_table(True).copy()
    t[128 + 3, 128 + 4] += 6      # 3*4 = 12 -> 18: +6, relative 50%
    t[128 + 0, 128 + 5] -= 2      # 0*5 = 0 -> -2: counted in EP/MAE, not in MRE
    met = compute_metrics(t, True)
    n = 65536
    assert met["mae"] == 8 / n and met["mae_pct"] == 8 / n / n * 100
    assert met["wce"] == 6 and met["wce_pct"] == 6 / n * 100
    assert met["ep_pct"] == 2 / n * 100
    nonzero = np.count_nonzero(exact_table(True))
    assert met["mre_pct"] == pytest.approx(0.5 / nonzero * 100)
    assert met["wcre_pct"] == pytest.approx(50.0)
    assert met["mean_error"] == 4 / n
    errs = np.zeros(n)
    errs[:2] = [6, -2]
    assert met["error_std"] == pytest.approx(errs.std()) and met["mse"] == 40 / n


def test_metrics_cached_and_copied():
    m = get("mul8s_1L2J")
    a = metrics_of(m)
    a["mae"] = -1
    assert metrics_of(m)["mae"] != -1
    assert set(metrics_of(m)) >= {"mae", "mae_pct", "wce_pct", "ep_pct", "mre_pct", "mean_error", "error_std"}


def test_unsigned_multiplier_product_lookup():
    m = get("mul8u_1JJQ")
    assert m.product(200, 100) == 20000 and m.activation_dtype.is_signed is False
    s = Multiplier("x", True, exact_table(True).astype(np.int32))
    assert s.product(-128, 127) == -16256
