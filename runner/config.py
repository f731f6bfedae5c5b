"""Where the Hydra configs live, how composing one turns into a user error (exit 2, one message), and
why composing is not interrupted."""
from __future__ import annotations

import re
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

from runner.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

LAUNCHER_HINT = ("\nThe joblib and submitit launchers: pip install hydra-joblib-launcher hydra-submitit-launcher "
                 "(the package's `sweep` extra).")


@contextmanager
def compose_errors(command: str, job: list[str] | None = None, hint_launchers: bool = False):
    """Hydra's and OmegaConf's composition errors as one UserError naming the command (and the sweep job)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except (HydraException, OmegaConfBaseException) as exc:
        where = f" ({' '.join(job)})" if job else ""
        if hint_launchers and "hydra/launcher" in str(exc):
            raise UserError(f"bad override for `approx-run {command}`{where}: {exc}".rstrip() + LAUNCHER_HINT) \
                from None
        raise UserError(f"bad override for `approx-run {command}`{where}: {nearest_names(command, exc)} "
                        f"(`approx-run {command} --help` lists them)") from None


def _close(word: str, pool) -> list[str]:
    import difflib

    from runner.errors import close_names

    pool = list(dict.fromkeys(pool))
    # a key whose last part is the word (multipliers -> sweep.multipliers) before any near name
    same_tail = [k for k in pool if "." in k and k.rpartition(".")[2].lower() == word.lower()]
    close = []
    for cutoff in (0.85, 0.7, 0.55):  # the near ones only, when there are near ones
        close = close_names(word, pool, n=4, cutoff=cutoff)
        if close:
            break
    if same_tail:
        return list(dict.fromkeys(same_tail + close))[:4]
    # a dotted key: also the keys of its section whose last part is close (finetune.epoch -> finetune.epochs)
    if not close and "." in word:
        head, _, tail = word.rpartition(".")
        same = [k for k in pool if k.startswith(head + ".")]
        close = [f"{head}.{k}" for k in difflib.get_close_matches(tail, [k[len(head) + 1:] for k in same], n=4)]
    return close


def nearest_names(command: str, exc: Exception) -> str:
    """One line for a composition error: what was not found and the nearest valid names (Hydra's own
    message lists every option of the group over many lines)."""
    text = str(exc)
    missing = re.search(r"Could not find '([\w/]+)/([^']+)'", text)
    if missing:
        group, option = missing[1], missing[2]
        options = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
        close = _close(option, options)
        names = f"did you mean {', '.join(close)}?" if close else f"choose one of {', '.join(options)}."
        extra = " Any table by name: multiplier=named multiplier.name=NAME." if group == "multiplier" else ""
        return f"no {group} option '{option}' ({group}={option}); {names}{extra}"
    key = re.search(r"Could not (?:override|append to|delete from) '([^']+)'", text) or \
        re.search(r"Key '([^']+)' is not in struct", text)
    if key:
        wanted = key[1]
        groups = [p.name for p in CONFIG_DIR.iterdir() if p.is_dir()]
        if wanted in groups:  # a group another command composes (train has no backend): nothing to suggest
            return f"`approx-run {command}` does not use the {wanted} config group ({wanted}=...); leave it out"
        try:
            from runner.config import config_keys

            pool = config_keys(command) + groups
        except Exception:  # noqa: BLE001  (the suggestion is a courtesy; the message stands without it)
            pool = []
        if wanted in pool:  # a key of another option of its group (model.num_classes of the zoo's models)
            return f"'{wanted}' is not a key of the config you chose (another option of its group has it): " \
                   f"add it with +{wanted}=VALUE"
        close = _close(wanted, pool)
        names = f"did you mean {', '.join(close)}?" if close else "no key or config group of that name."
        if wanted.rpartition(".")[2] == "multipliers" and not any(c.endswith(".multipliers") for c in close):
            names += f" Several multipliers: {SET_HINT}."
        return f"unknown key '{wanted}'; {names} (a new key needs a leading +)"
    return text.strip() or type(exc).__name__


class HeldSignals:
    """SIGINT and SIGTERM that arrive while a config is composed are held and delivered when it is done
    (release(), or the end of a with block). A KeyboardInterrupt inside OmegaConf's flag bookkeeping leaves
    a node half-updated; its clean-up then fails with an AttributeError, which Hydra or Python print as a
    traceback instead of the interruption it was. Outside the main thread (where Python cannot handle
    signals), or with hold=False, nothing is held."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, hold: bool = True):
        self._pending: list[int] = []
        self._previous = {}
        if hold and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._hold) for s in self.SIGNALS}

    def _hold(self, signum, frame):
        self._pending.append(signum)

    def release(self) -> None:
        """Restore the handlers and deliver the first held signal to them (they raise where we are now)."""
        previous, self._previous = self._previous, {}
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: a handler set outside Python
        if previous and self._pending:
            signal.raise_signal(self._pending[0])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


# how to run one job per multiplier, for the commands that take no multiplier set
SET_HINT = "approx-run sweep 'sweep.multipliers=[exact,mul8s_1L2J]' (one job each; names, globs or files)"
# the multiplier set of the commands that take one
SET_KEYS = {"sweep": "sweep.multipliers", "sensitivity": "sensitivity.multipliers", "search": "search.multipliers"}
# keys that take a list although their default is one word or number (auto, 1)
LIST_KEYS = ("sweep.devices", "sensitivity.devices", "train.devices", "finetune.devices", "eval.devices")


def refuse_lists(command: str, overrides=()) -> None:
    """UserError for a [list] given to a config group or to a key that takes one value. Hydra merges the
    options of a group list into one node (multiplier=[exact,mul8s_1L2J] runs one job, a table named
    mul8s_1L2J of family exact) and passes a list on to keys that then misread it, both without a word."""
    from contextlib import nullcontext

    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001  (a malformed override: the composition reports it)
        return
    lists = [o for o in parsed if not o.key_or_group.startswith("hydra.") and not o.is_delete()
             and not o.is_sweep_override() and isinstance(o.value(), list)]
    if not lists:
        return
    groups = {p.name for p in CONFIG_DIR.iterdir() if p.is_dir()}
    defaults = None
    for o in lists:
        key = o.key_or_group
        items = ",".join(str(v) for v in o.value())
        multi = key == "multiplier" or key == "multiplier.name"
        if multi:
            fix = f"approx-run {command} '{SET_KEYS[command]}=[{items}]'" if command in SET_KEYS else SET_HINT
            what = "one job per multiplier"
        elif command == "sweep":
            fix, what = f"{key}={items} (no brackets)", "one job per value"
        else:
            fix, what = f"approx-run sweep {key}={items}", "one job per value"
        if key in groups or "/" in key:
            raise UserError(f"{o.input_line}: the {key} config group takes one option (a list would merge the "
                            f"options into one {key}); {what}: {fix}.")
        if key in LIST_KEYS or o.is_add():
            continue
        if defaults is None:
            plain = [p.input_line for p in parsed if not p.is_sweep_override() and p not in lists]
            init = nullcontext() if GlobalHydra.instance().is_initialized() else \
                initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name=command)
            try:
                with init:
                    defaults = hydra_compose(config_name=command, overrides=plain)
            except Exception:  # noqa: BLE001  (the real composition reports a bad override)
                return
        raw = OmegaConf.to_container(defaults, resolve=False)  # an interpolation (${data.x}) is one value too
        for part in key.split("."):
            raw = raw.get(part) if isinstance(raw, dict) else None
        if isinstance(raw, (str, int, float, bool)):
            raise UserError(f"{o.input_line}: {key} takes one value, not a list; {what}: {fix}.")


def compose(command: str, overrides=()):
    """The config `approx-run <command> <overrides>` runs with (no hydra section)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    refuse_lists(command, overrides)
    with HeldSignals(), initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name=command):
        with compose_errors(command):
            return hydra_compose(config_name=command, overrides=list(overrides))


# ---------------------------------------------------------------- what each key means (for --help)

_KEY_LINE = re.compile(r"^(\s*)([A-Za-z_][\w]*):(.*)$")


def yaml_comments(path: Path) -> dict[str, str]:
    """{dotted key: its comment} of one config file: the comment on the key's line, else the comment lines
    right above it. The configs' comments are the keys' documentation: --help shows them, so they cannot
    drift from a list kept elsewhere."""
    comments, stack, above = {}, [], []
    for line in path.read_text().splitlines():
        text = line.strip()
        if text.startswith("#"):
            if not text.startswith("# @package"):
                above.append(text.lstrip("#").strip())
            continue
        m = _KEY_LINE.match(line)
        if not m or text.startswith("-"):
            above = []
            continue
        indent, key, rest = len(m[1]), m[2], m[3]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        inline = re.search(r"\s#\s?(.*)$", rest)
        note = inline[1].strip() if inline else " ".join(above)
        if note:
            comments[".".join(k for _, k in stack)] = note
        above = []
    return comments


# config groups whose keys a validated dataclass checks: its fields' comments are their lines where the
# yaml has none
DATACLASSES = {"quant": ("quant.py", "QuantConfig"), "finetune": ("finetune.py", "FinetuneConfig")}


def dataclass_comments() -> dict[str, str]:
    """{group.field: the comment on the field's line} of the DATACLASSES, read from their source (importing
    them would import torch: seconds, for a --help)."""
    comments = {}
    for group, (module, cls) in DATACLASSES.items():
        text = (Path(__file__).parent / module).read_text()
        body = text.split(f"class {cls}", 1)[-1].split("\n\n", 1)[0]
        for m in re.finditer(r"^    (\w+): [^#\n]+#\s*(.+)$", body, flags=re.M):
            comments[f"{group}.{m[1]}"] = m[2].strip()
    return comments


def _primary_chain(name: str) -> list[Path]:
    """The command's config file after the primary configs its defaults list names (common, compare)."""
    path = CONFIG_DIR / f"{name}.yaml"
    chain = []
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*-\s*([A-Za-z_]\w*)\s*$", line)
        if m and (CONFIG_DIR / f"{m[1]}.yaml").is_file():
            chain += _primary_chain(m[1])
    return chain + [path]


def key_help(command: str, overrides=()) -> list[tuple[str, object, str]]:
    """(dotted key, default, one line) for every key `approx-run <command>` takes, in config order; the line
    comes from the comments of the group options and config files the command composes."""
    from contextlib import nullcontext

    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    # inside another composition (a suggestion for its error) Hydra is initialised already, on CONFIG_DIR
    init = nullcontext() if GlobalHydra.instance().is_initialized() else \
        initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name=command)
    with HeldSignals(), init:
        with compose_errors(command):
            cfg = hydra_compose(config_name=command, overrides=list(overrides), return_hydra_config=True)
    comments = dataclass_comments()
    comments.update(yaml_comments(CONFIG_DIR / "compare.yaml"))  # eval.* etc.: finetune's mean the same
    for group, option in cfg.hydra.runtime.choices.items():
        path = CONFIG_DIR / str(group) / f"{option}.yaml"
        if "/" not in str(group) and path.is_file() and not str(group).startswith("hydra"):
            glob = path.read_text().startswith("# @package _global_")
            comments.update({k if glob else f"{group}.{k}": v for k, v in yaml_comments(path).items()})
    for path in _primary_chain(command):
        comments.update(yaml_comments(path))
    values = OmegaConf.to_container(cfg, resolve=False)
    values.pop("hydra", None)
    values.pop("command", None)  # which command the config is for: not a setting
    out = []

    def walk(node, prefix):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v:
                walk(v, key + ".")
            else:
                out.append((key, v, comments.get(key, "")))

    walk(values, "")
    return sorted(out, key=lambda item: "." in item[0])  # the top-level keys first, then by section


def config_keys(command: str) -> list[str]:
    """Every dotted key of the command's config (hydra's own excepted)."""
    return [k for k, _, _ in key_help(command)]
