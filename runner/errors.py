"""User-facing errors: the CLI turns these into a short message and exit code 2."""
import argparse
import math


class UserError(Exception):
    """Bad input the user can fix (a missing file, a malformed table, an impossible config).

    The message is shown as is, without a traceback, so it must say what was tried and how
    to fix it."""

    exit_code = 2


def config_number(value, key: str, *, minimum=None, kind=int, optional: bool = False):
    """A numeric config value as `kind`, or UserError naming the key: a typo such as train.epochs=3O or
    eval.limit=-5 stops the run with one message before any work instead of a traceback (or a silent
    slice from the end) later. No setting is infinite: train.lr=inf would train to chance level."""
    if value is None and optional:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        number = kind(value)
        if kind is int and float(value) != number:      # 2.5 is not an integer setting
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        what = "an integer" if kind is int else "a number"
        raise UserError(f"{key}={value!r} is not {what}{' (or null)' if optional else ''}.") from None
    if kind is float and not math.isfinite(number):
        raise UserError(f"{key}={value} is not a finite number.")
    if minimum is not None and not number >= minimum:   # `not >=` also refuses NaN
        raise UserError(f"{key}={value} must be >= {minimum}{' (or null)' if optional else ''}.")
    return number


def close_names(word: str, pool, n: int = 4, cutoff: float = 0.6) -> list[str]:
    """The names of pool nearest to word (difflib), a name differing from it in case only first: difflib
    ranks mul8s_1L2J below mul8s_1L2L for mul8s_1l2j."""
    import difflib

    pool = list(dict.fromkeys(pool))
    same = [p for p in pool if p.lower() == str(word).lower()]
    return list(dict.fromkeys(same + difflib.get_close_matches(str(word), pool, n=n, cutoff=cutoff)))[:n]


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the flag commands (results, lut, info): a mistake is one UserError line (exit 2) naming
    the nearest options, not argparse's usage block."""

    def error(self, message):
        import difflib
        import re

        hint = ""
        unknown = re.search(r"unrecognized arguments: (.*)", message)
        if unknown:
            options = [o for action in self._actions for o in action.option_strings]
            close = [c for word in unknown[1].split() if word.startswith("-")
                     for c in difflib.get_close_matches(word.split("=", 1)[0], options, n=3, cutoff=0.6)]
            if close:
                hint = f"; did you mean {', '.join(dict.fromkeys(close))}?"
        raise UserError(f"{self.prog}: {message}{hint} (`{self.prog} --help` lists the options)")
