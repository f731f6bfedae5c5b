"""Where multipliers come from: shipped tables, generated families, the user's imports.

Shipped: the 50 EvoApproxLib v2022 8x8 tables in data/, rebuilt from the library's C and Verilog
files by build_library.py (manifest.json holds provenance and published figures). User imports
(`approx-run lut import`) live outside the package, in
$APPROX_RUN_HOME/multipliers/ (default ~/.approx-run/multipliers/): NAME.json with its metadata,
naming the table file NAME.<hash>.txt.gz (NAME.txt.gz in older stores).

A multiplier config (configs/multiplier/*.yaml) is one of
    {name: mul8s_1L2J}                                   shipped or imported table by name
    {name: drum, family: drum, k: 4, signed: true}       generated family (name is derived)
    {name: file, path: /x/y.txt, signed: null}           a table file, validated on load
optionally with `layers: {conv1: <spec>, fc3: <spec>}` giving some layers another multiplier.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
from filelock import FileLock

from ..errors import UserError, close_names
from ..provenance import atomic_write_bytes
from . import families
from .core import Multiplier, table_sha256
from .io import check_range, read_values, save_table, stem
from .peers import load_file, load_table

DATA = Path(__file__).parent / "data"
ALIASES = {"exact": "exact_s", "exact_signed": "exact_s", "exact_unsigned": "exact_u"}
_NAME_OK = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
_SPEC_KEYS = {"name", "family", "signed", "path", "layers", "power_mw"}


# ---------------------------------------------------------------- shipped

@lru_cache(maxsize=1)
def manifest() -> dict:
    with open(DATA / "manifest.json") as f:
        return json.load(f)


def shipped_entries() -> dict:
    """Name -> manifest entry of every table shipped with the package."""
    return {e["name"]: e for e in manifest()["multipliers"]}


def shipped_names() -> list[str]:
    return list(shipped_entries())


@lru_cache(maxsize=None)
def _shipped(name: str) -> Multiplier:
    e = shipped_entries()[name]
    values, _ = read_values(DATA / e["file"])
    m = Multiplier(name, e["signed"], values.astype(np.int32),
                   source=e["source"], published=dict(e["published"]),
                   params={"library": "EvoApproxLib v2022", "license": "MIT"})
    if m.sha256 != e["sha256"]:
        raise UserError(f"{DATA / e['file']}: package data corrupted (sha256 {m.sha256} != manifest); reinstall")
    return m


# ---------------------------------------------------------------- user registry

def user_dir() -> Path:
    home = os.environ.get("APPROX_RUN_HOME") or os.path.join(os.path.expanduser("~"), ".approx-run")
    return Path(home) / "multipliers"


def user_names() -> list[str]:
    d = user_dir()
    if not d.is_dir():
        return []
    return sorted(p.name[: -len(".json")] for p in d.glob("*.json") if not p.name.startswith("."))


def _user(name: str) -> Multiplier:
    d = user_dir()
    try:
        meta = json.loads((d / f"{name}.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{d / (name + '.json')}: unreadable registry entry ({e})") from None
    values, where = read_values(d / meta.get("table", f"{name}.txt.gz"))
    check_range(values, meta["signed"], where)
    m = Multiplier(name, meta["signed"], values.astype(np.int32), source=meta.get("source", ""),
                   published=meta.get("published", {}), params=meta.get("params", {}))
    if m.sha256 != meta.get("sha256"):
        raise UserError(f"{d / (name + '.txt.gz')}: table changed since import (sha256 mismatch); "
                        f"re-import it with `approx-run lut import FILE --name {name} --force`")
    return m


def _power(value) -> dict:
    """The `published` entry a user-given power figure (mW) becomes."""
    if value is None:
        return {}
    try:
        mw = float(value)
    except (TypeError, ValueError):
        mw = float("nan")
    if not mw > 0 or mw == float("inf"):
        raise UserError(f"power_mw={value!r}: give the circuit's power in mW, a number > 0")
    return {"pwr": f"{mw:g}"}


def import_table(path, name: str | None = None, signed: bool | None = None, *, transpose: bool = False,
                 layout: str = "auto", force: bool = False, power_mw: float | None = None,
                 activation: str | None = None) -> Multiplier:
    """Validate a user's table or circuit file, convert it to our layout and register it under name
    (default: the file's stem). A file that reproduces the shipped table of its own name registers
    nothing: the result's params["shipped"] names it."""
    power = _power(power_mw)
    path = Path(os.path.expanduser(str(path)))
    name = name or stem(path)
    if not _NAME_OK.match(name or ""):
        raise UserError(f"invalid name {name!r}: use letters, digits, '_', '-', '.', starting with a letter"
                        f"{'; choose one with --name' if name == stem(path) else ''}")
    taken = name in shipped_names() or name in ALIASES or families.parse_family_name(name) or name in families.FAMILIES
    if not taken and name in user_names() and not force:
        raise UserError(f"{name!r} is already imported ({user_dir()}); pass --force to replace it")
    claims_exact = "exact" in name.lower() or "exact" in path.name.lower()
    loaded = load_file(path, signed, layout=layout, transpose=transpose, activation=activation, name=name,
                       expect_exact=claims_exact)
    values = loaded.values
    sha = table_sha256(values)
    shipped_sha = {e["sha256"]: n for n, e in shipped_entries().items()}
    if taken:
        if shipped_sha.get(sha) == name:
            m = _shipped(name)
            return dataclasses.replace(m, params={**m.params, "shipped": name, "layout_note": loaded.layout_note,
                                                  "notes": loaded.notes},
                                       published={**loaded.published, **m.published})
        raise UserError(f"name {name!r} is taken by a shipped or generated multiplier; choose another with --name")
    sha_t = table_sha256(values.T.copy())
    if sha_t != sha and sha_t in shipped_sha:
        raise UserError(f"{path}: this is the shipped table {shipped_sha[sha_t]} transposed (rows hold the "
                        f"weight operand B); rows must be the activation A. Pass "
                        f"{'--activation-operand' if path.suffix.lower() in ('.c', '.v') else '--transpose'} to "
                        f"import it the right way round")
    note = loaded.layout_note + (f"; identical to shipped {shipped_sha[sha]}" if sha in shipped_sha else "")
    if transpose:
        note += "; transposed on import"
    m = Multiplier(name, loaded.signed, values.astype(np.int32), source=f"imported from {path.resolve()}",
                   published={**loaded.published, **power},
                   params={"layout": loaded.layout, "layout_note": note, **({"notes": loaded.notes} if loaded.notes else {})})
    _store(m)
    return m


def _store(m: Multiplier) -> None:
    """Write the table to a file named by its hash, then the JSON entry naming it: replacing the entry is
    the one commit point, so a kill at any moment leaves the old entry or the new one whole, never the
    new table under the old metadata. The lock keeps two imports of one name from crossing."""
    d = user_dir()
    d.mkdir(parents=True, exist_ok=True)
    entry = d / f"{m.name}.json"
    table = f"{m.name}.{m.sha256[:16]}.txt.gz"
    with FileLock(str(d / ".import.lock")):
        try:
            old = json.loads(entry.read_text()).get("table", f"{m.name}.txt.gz")
        except (OSError, ValueError):
            old = None
        tmp = d / f".{m.name}.{os.getpid()}.tmp.txt.gz"
        save_table(m, tmp)
        os.replace(tmp, d / table)
        meta = {"name": m.name, "signed": m.signed, "sha256": m.sha256, "table": table, "source": m.source,
                "published": m.published, "params": m.params,
                "imported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        atomic_write_bytes(entry, json.dumps(meta, indent=1).encode())
        if old and old != table:
            (d / old).unlink(missing_ok=True)


# ---------------------------------------------------------------- lookup

def list_multipliers() -> list[str]:
    """Names of every available multiplier: generated defaults, shipped tables, user imports."""
    gen = [families.family_name(f, s, p) for f, s, p in families.DEFAULT_INSTANCES]
    shipped = shipped_names()
    # an import made before a table of its name shipped is shadowed by the shipped one (get() prefers it)
    return gen + shipped + [n for n in user_names() if n not in gen and n not in shipped]


def _unknown(name) -> UserError:
    pool = list_multipliers() + list(ALIASES) + list(families.FAMILIES)
    close = close_names(str(name), pool, n=5, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return UserError(f"unknown multiplier {name!r}.{hint} `approx-run lut list` shows all; generated "
                     f"names look like drum4_s, optrunc2_u, bam_h0v8_s.")


def get(name: str) -> Multiplier:
    name = ALIASES.get(name, name)
    if name in shipped_entries():
        return _shipped(name)
    parsed = families.parse_family_name(name)
    if parsed:
        family, signed, params = parsed
        return families.build(family, signed, **params)
    if name in user_names():
        return _user(name)
    raise _unknown(name)


@lru_cache(maxsize=1)
def _canonical_names() -> dict:
    """(table sha256, signed) -> the one name results record that table under: the generated exact
    tables' names first (exact_s, exact_u), then the shipped tables' in manifest order."""
    names = {}
    for signed in (True, False):
        m = families.build("exact", signed)
        names[(m.sha256, signed)] = m.name
    for e in manifest()["multipliers"]:
        names.setdefault((e["sha256"], bool(e["signed"])), e["name"])
    return names


def canonical_name(m: Multiplier) -> str:
    """The name a table is recorded under, chosen by its content: every alias, a shipped circuit that equals
    a generated one (mul8s_1KV6 is the exact signed product: exact_s) and an import of a shipped table give
    one name, so results never hold one table under two names."""
    return _canonical_names().get((m.sha256, bool(m.signed)), m.name)


def _to_dict(spec) -> dict:
    if isinstance(spec, str):
        return {"name": spec}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(spec, DictConfig):
            spec = OmegaConf.to_container(spec, resolve=True)
    except ImportError:  # the GPU image has no omegaconf; plain dicts still work
        pass
    if not isinstance(spec, dict):
        raise UserError(f"a multiplier spec must be a name or a mapping, got {type(spec).__name__}")
    return dict(spec)


def resolve(spec) -> Multiplier:
    """The Multiplier a config node (see the module docstring) describes; `layers` is ignored here. A
    `power_mw` key gives (or replaces) the circuit's power figure for energy estimates."""
    d = _to_dict(spec)
    d.pop("layers", None)
    power = _power(d.pop("power_mw", None))
    m = _resolve(d)
    return dataclasses.replace(m, published={**m.published, **power}) if power else m


def _resolve(d: dict) -> Multiplier:
    signed = d.get("signed")
    if signed is not None and not isinstance(signed, bool):
        raise UserError(f"multiplier.signed must be true, false or null, got {signed!r}")
    family = d.get("family")
    if family:
        params = {k: v for k, v in d.items() if k not in _SPEC_KEYS}
        return families.build(str(family), True if signed is None else signed, **params)
    extra = set(d) - _SPEC_KEYS
    if extra:
        raise UserError(f"multiplier config: unknown key(s) {', '.join(sorted(extra))} "
                        f"(only generated families take parameters)")
    if "path" in d:
        path = d["path"]
        if path in (None, "", "???"):
            raise UserError("multiplier=file needs a table: multiplier.path=/path/to/table.txt "
                            "(.txt, .txt.gz, .npy, .bin, .h: 256 x 256 products, row = activation A; or a "
                            "circuit, .c or .v)")
        name = d.get("name")
        return load_table(path, signed, name=None if name in (None, "file") else str(name))
    name = d.get("name")
    if not name or name == "???":
        raise UserError("multiplier config needs a name: multiplier=mul8s_1L2J, or multiplier=named "
                        "multiplier.name=NAME (`approx-run lut list` shows the names), or a path")
    m = get(str(name))
    if signed is not None and signed != m.signed:
        raise UserError(f"multiplier {m.name} is {'signed' if m.signed else 'unsigned'}, "
                        f"but the config says signed={signed}")
    return m


def resolve_per_layer(spec, layer_names) -> dict[str, Multiplier]:
    """Multiplier of each layer: `layers.<name>` where given, else the top-level multiplier."""
    d = _to_dict(spec)
    layers = d.pop("layers", None) or {}
    if not isinstance(layers, dict):
        raise UserError("multiplier.layers must map layer names to multiplier specs")
    layer_names = list(layer_names)
    unknown = [n for n in layers if n not in layer_names]
    if unknown:
        raise UserError(f"multiplier.layers names unknown layer(s) {', '.join(map(str, unknown))}; "
                        f"the model's layers are {', '.join(layer_names)}")
    top = resolve(d)
    return {n: resolve(layers[n]) if n in layers else top for n in layer_names}
