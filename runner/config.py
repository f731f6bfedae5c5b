"""Where the Hydra configs live and how composing one turns into a user error (exit 2, one message)."""
from __future__ import annotations

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


def compose(command: str, overrides=()):
    """The config `approx-run <command> <overrides>` runs with (no hydra section)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name=command):
        with compose_errors(command):
            return hydra_compose(config_name=command, overrides=list(overrides))
