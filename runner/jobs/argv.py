"""The command line: the one place in runner/ that reads (and, for hydra.main, sets) sys.argv, and that
turns a command's arguments into Hydra overrides."""
from __future__ import annotations

import fnmatch
import itertools
import os
import sys
from pathlib import Path

from runner.errors import UserError

_GLOB = set("*?[")


def command_line(argv: list[str] | None = None) -> list[str]:
    """The arguments after the program name: argv when a caller (a test, another command) passes them."""
    return list(sys.argv[1:] if argv is None else argv)


def set_program_argv(command: str, args: list[str]) -> None:
    """hydra.main reads its overrides and its program name (in --help and logs) from sys.argv."""
    sys.argv = [f"approx-run {command}", *args]


def asks_for_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def is_multirun(argv: list[str]) -> bool:
    return any(a in ("-m", "--multirun") for a in argv)


def hydra_flags(argv: list[str]) -> list[str]:
    """--cfg, --info, ...: Hydra's own options (not the multirun switch)."""
    return [a for a in argv if a.startswith("-") and a not in ("-m", "--multirun")]


def override_values(argv: list[str]) -> dict[str, str]:
    """key -> value of the key=value overrides (+key and ~key as key)."""
    keys = {}
    for a in argv:
        key, eq, value = a.partition("=")
        if eq:
            keys[key.lstrip("+~")] = value
    return keys


def wants_cuda(args: list[str]) -> bool:
    """Whether the overrides run this command's work on a GPU, in this process: backend=cuda or device=cuda,
    and no launcher that would run the jobs in other processes."""
    keys = override_values(args)
    if keys.get("hydra/launcher", "basic") != "basic":
        return False
    return "cuda" in keys.get("backend", "") or keys.get("device", "").startswith("cuda")


def is_table_path(spec: str) -> bool:
    """A multiplier spec that names a table or circuit file rather than a registered multiplier."""
    # The table formats are the loader's, matched as it matches them (case-insensitively); imported
    # here because runner.multipliers loads torch, which the CLI's start-up avoids.
    from runner.multipliers.io import SUFFIXES

    return os.sep in spec or "/" in spec or spec.lower().endswith(SUFFIXES)


def unquote(s: str) -> str:
    s = s.strip()
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"" else s


def expand_multipliers(value: str, key: str = "sweep.multipliers") -> list[str]:
    """'mul8s_*', 'a,b', '[a, b]' -> names (globs matched against the registry) and absolute table paths;
    key: the setting it came from, for the messages."""
    from runner.multipliers import get, list_multipliers

    value = unquote(value)
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1]
    items = [unquote(v) for v in value.split(",") if v.strip()]
    if not items:
        raise UserError(f"{key} is empty; give names, globs or table files, e.g. {key}='mul8s_*'.")
    names, known = [], list_multipliers()
    for item in items:
        if is_table_path(item):
            names.append(str(Path(item).expanduser().resolve()))
        elif _GLOB & set(item):
            hits = fnmatch.filter(known, item)
            if not hits:
                raise UserError(f"{key}: {item!r} matches no multiplier. `approx-run lut list` shows them.")
            names += hits
        else:
            get(item)  # an unknown name is a typo: say so now (with suggestions), not after the sweep
            names.append(item)
    return list(dict.fromkeys(names))


def hydra_quote(s: str) -> str:
    """s as a Hydra override value that parses back to s (Hydra's own escaping rules)."""
    from hydra.core.override_parser.types import Quote, QuotedString

    return QuotedString(text=s, quote=Quote.single).with_quotes()


def split_argv(argv: list[str], key: str = "sweep.multipliers"):
    """(Hydra flags, overrides, the value of `key` or None): `key` takes globs, which are not Hydra syntax."""
    overrides, multipliers = [], None
    for a in argv:
        if a.startswith("-"):
            continue
        name = a.split("=", 1)[0].lstrip("+~")
        if name == key:
            multipliers = a.split("=", 1)[1] if "=" in a else ""
        elif name == "sweep.multiplier":
            raise UserError("sweep.multiplier is set per job; use sweep.multipliers=... (a list or a glob).")
        else:
            overrides.append(a)
    return hydra_flags(argv), overrides, multipliers


def expand_jobs(overrides: list[str]) -> list[list[str]]:
    """The job override lists Hydra's basic sweeper launches, in its order (job.num = index): the cartesian
    product of every comma-separated sweep, the last override varying fastest."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:  # noqa: BLE001  (hydra's parse errors have several types)
        raise UserError(f"bad override for `approx-run sweep`: {exc}") from None
    axes = []
    for o in parsed:
        if o.is_hydra_override():
            continue
        key = o.get_key_element()
        if o.is_sweep_override():
            if not o.is_discrete_sweep():
                raise UserError(f"{o.input_line}: `approx-run sweep` takes comma-separated lists or choice(), "
                                "not ranges or intervals.")
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([f"{key}={o.get_value_element_as_str()}"])
    return [list(job) for job in itertools.product(*axes)]


def is_hydra_override(override: str) -> bool:
    return override.lstrip("+~").startswith(("hydra.", "hydra/"))


def launcher_of(overrides: list[str]) -> str:
    """The hydra/launcher option the overrides choose (basic when none)."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("hydra/launcher=")]
    return chosen[-1] if chosen else "basic"
