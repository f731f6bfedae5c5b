"""Rebuild the shipped EvoApproxLib tables from the library's circuit files.

    python -m runner.multipliers.build_library /path/to/evoapproxlib-v2022-8x8   # a folder of NAME.c + NAME.v

Every NAME.c is evaluated by the C evaluator and NAME.v by the Verilog evaluator (no flags: operand
order, signedness and figures come from the files); the two tables must be identical and reproduce the
header's MAE%, WCE% and EP%, else nothing is written. Writes runner/multipliers/data/NAME.txt.gz
(reproducible gzip), data/manifest.json (provenance: the sources' sha256, published figures) and
configs/multiplier/NAME.yaml for each circuit. A table whose gzip already holds the same values is
left untouched.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import sys
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..provenance import atomic_write_bytes
from .circuits import compare_published, load_circuit
from .core import Multiplier, table_sha256
from .io import read_values, save_table

PACKAGE_DATA = Path(__file__).parent / "data"
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "multiplier"
REQUIRED = ("mae%", "wce%", "ep%")
ABOUT = ("8x8 multipliers of EvoApproxLib (branch v2022, MIT License; cite V. Mrazek et al., EvoApproxLib). Each "
         "table was produced by approx-run's circuit evaluators from the library's C model and, independently, from "
         "its Verilog netlist (identical tables), on all 65,536 operand pairs; rebuild with `python -m "
         "runner.multipliers.build_library SOURCES`. Layout (same as ApproxTorch's LUT text format): 256 rows x 256 "
         "whitespace-separated integers; row i is operand A (activation), column j is operand B (weight). Signed "
         "(mul8s_*): A = i-128, B = j-128, value = A*B approximated (int16 range). Unsigned (mul8u_*): A = i, "
         "B = j (0..255), value in 0..65535. These circuits are not always commutative. 'published' holds the "
         "figures of each circuit's header: mae%/wce% relative to 2^16 (mae% derived from MAE rounded to 0.1); "
         "ep% = share of pairs with any error; mre%/wcre% = mean/worst relative error over pairs whose exact "
         "product is non-zero; mae, wce, mse absolute; pwr in mW, area in um^2, delay in ns (PDK 45 nm).")
CITATIONS = [
    "V. Mrazek, R. Hrbacek, Z. Vasicek, L. Sekanina, 'EvoApprox8b: Library of Approximate Adders and Multipliers "
    "for Circuit Design and Benchmarking of Approximation Methods', DATE 2017, pp. 258-261.",
    "V. Mrazek, Z. Vasicek, L. Sekanina, H. Jiang, J. Han, 'Scalable Construction of Approximate Multipliers With "
    "Formally Guaranteed Worst Case Error', IEEE TVLSI 26(11), pp. 2572-2576, 2018, doi:10.1109/TVLSI.2018.2856362.",
]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _library_path(name: str, text: str, signed: bool) -> str:
    """Where the circuit lives in the library: its header names the Pareto set, which is its folder
    (multiplers/8x8_signed/pareto_pwr_ep/, the library's spelling)."""
    m = re.search(r"pareto optimal circuits with respect to the (\w+) and (\w+) parameters", text)
    folder = f"pareto_{m.group(1)}_{m.group(2)}/" if m else ""
    return f"multiplers/8x8_{'signed' if signed else 'unsigned'}/{folder}{name}"


def build_one(c_file: Path) -> dict:
    v_file = c_file.with_suffix(".v")
    if not v_file.is_file():
        raise UserError(f"{c_file}: no Verilog netlist {v_file.name} beside it")
    from_c, from_v = load_circuit(c_file), load_circuit(v_file)
    if from_c.signed != from_v.signed or not np.array_equal(from_c.values, from_v.values):
        raise UserError(f"{c_file.stem}: the C model and the Verilog netlist give different tables")
    missing = [k for k in REQUIRED if k not in from_c.published]
    ok, bad = compare_published(from_c.values, from_c.signed, from_c.published)
    if missing or any(k in REQUIRED for k in (b.split()[0].lower() for b in bad)):
        raise UserError(f"{c_file.stem}: header figures missing ({missing}) or not reproduced ({bad})")
    return {"name": c_file.stem, "signed": from_c.signed, "values": from_c.values, "published": from_c.published,
            "path": _library_path(c_file.stem, c_file.read_text(), from_c.signed), "c_sha256": _sha(c_file), "v_sha256": _sha(v_file),
            "checked": ok, "not_reproduced": bad, "seconds": [from_c.seconds, from_v.seconds]}


def _yaml(e: dict) -> str:
    p = e["published"]
    return (f"# EvoApproxLib {e['name']} ({'signed' if e['signed'] else 'unsigned'}): published MAE% {p['mae%']}, "
            f"WCE% {p['wce%']}, EP% {p['ep%']}, power {p.get('pwr', '?')} mW, area {p.get('area', '?')} um2.\n"
            f"# Per-layer: +multiplier.layers={{conv1: {{name: mul8s_1KV6}}}} (layers not named use this multiplier)\n"
            f"name: {e['name']}\n")


def build(sources: Path, data: Path = PACKAGE_DATA, configs: Path = CONFIGS) -> list[dict]:
    c_files = sorted(sources.glob("mul8*.c"))
    if not c_files:
        raise UserError(f"{sources}: no mul8*.c circuits")
    entries = [build_one(c) for c in c_files]        # everything is checked before anything is written
    data.mkdir(parents=True, exist_ok=True)
    manifest = {"about": ABOUT,
                "license": "EvoApproxLib is distributed under The MIT License (stated in the header of every circuit "
                           "file of the library). The tables here are derived from its C models and Verilog netlists, "
                           "unchanged in value.",
                "citation": CITATIONS, "url": "https://github.com/ehw-fit/evoapproxlib (branch v2022)",
                "sha256_note": "sha256 = SHA-256 of the table as little-endian int32, row-major "
                               "(runner.multipliers.core.table_sha256); text_sha256 = SHA-256 of the decompressed text "
                               "file; c_sha256 / v_sha256 = SHA-256 of the circuit files the table was built from",
                "multipliers": []}
    for e in entries:
        target = data / f"{e['name']}.txt.gz"
        sha = table_sha256(e["values"])
        if not (target.is_file() and table_sha256(read_values(target)[0]) == sha):
            save_table(Multiplier(e["name"], e["signed"], e["values"].astype(np.int32)), target)
        manifest["multipliers"].append({
            "name": e["name"], "signed": e["signed"], "file": target.name,
            "operand_range": [-128, 127] if e["signed"] else [0, 255],
            "source": f"EvoApproxLib branch v2022, {e['path']}.c",
            "sources": [f"{e['path']}.c", f"{e['path']}.v"],
            "sha256": sha, "text_sha256": hashlib.sha256(gzip.decompress(target.read_bytes())).hexdigest(),
            "c_sha256": e["c_sha256"], "v_sha256": e["v_sha256"],
            "published": e["published"],
            "header_check": {"reproduced": e["checked"], "not_reproduced": e["not_reproduced"]}})
        atomic_write_bytes(configs / f"{e['name']}.yaml", _yaml(e).encode())
    atomic_write_bytes(data / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
    return entries


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m runner.multipliers.build_library", description=__doc__.split("\n\n")[0])
    p.add_argument("sources", help="folder holding the circuits as NAME.c and NAME.v")
    args = p.parse_args(argv)
    try:
        entries = build(Path(args.sources))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    slow = max(max(e["seconds"]) for e in entries)
    print(f"built {len(entries)} tables ({sum(e['signed'] for e in entries)} signed) into {PACKAGE_DATA}; "
          f"slowest circuit evaluation {slow:.2f} s")
    for e in entries:
        if e["not_reproduced"]:
            print(f"  {e['name']}: header figures not reproduced: {'; '.join(e['not_reproduced'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
