"""Where the Hydra configs live, how composing one turns into a user error (exit 2, one message), and
why composing is not interrupted."""
from __future__ import annotations

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
        hint = LAUNCHER_HINT if hint_launchers and "hydra/launcher" in str(exc) else \
            f"\nSee `approx-run {command} --help` for the config groups and their options."
        raise UserError(f"bad override for `approx-run {command}`{where}: {exc}".rstrip() + hint) from None


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


def compose(command: str, overrides=()):
    """The config `approx-run <command> <overrides>` runs with (no hydra section)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with HeldSignals(), initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name=command):
        with compose_errors(command):
            return hydra_compose(config_name=command, overrides=list(overrides))
