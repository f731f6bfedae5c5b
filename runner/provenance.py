"""What a result needs to be reproduced: git commit, versions, device, and atomic file writes."""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from runner.gpus import visible_gpu_ids

REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info() -> dict:
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": sha, "git_dirty": bool(status) if status is not None else None}


def resolve_device(name: str) -> torch.device:
    from runner.errors import UserError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda was asked for, but torch sees no CUDA device. Use device=cpu or device=auto.")
    if name not in ("cpu", "cuda"):
        raise UserError(f"device={name} is not one of auto, cpu, cuda.")
    return torch.device(name)


def host_device(device: torch.device | str) -> str:
    """The device as the host numbers it: a worker that sees one GPU through CUDA_VISIBLE_DEVICES calls it
    cuda:0, and rows from several workers must still say which card ran them."""
    device = torch.device(device)
    ids = visible_gpu_ids()
    if device.type != "cuda" or ids is None:
        return str(device)
    index = device.index or 0
    return f"cuda:{ids[index]}" if index < len(ids) and ids[index].isdigit() else str(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    import runner

    return {
        **git_info(),
        "approx_run_version": runner.__version__,
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "device": host_device(device),
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "hostname": platform.node(),
    }


# A temp file this old belongs to a writer that was killed (SIGKILL, power loss): writes take
# milliseconds, so nobody is still writing it, and the next write of the same file removes it.
STALE_TEMP_S = 3600


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the data reaches the disk before the rename can: a crash leaves old or new
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _remove_stale_temps(path)


def _remove_stale_temps(path: Path) -> None:
    for old in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        try:
            if time.time() - old.stat().st_mtime > STALE_TEMP_S:
                old.unlink()
        except OSError:  # another writer removed it first
            pass


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def write_config_yaml(path: Path, cfg) -> None:
    """The composed config as YAML, resolved, written atomically. libyaml's emitter where PyYAML has it:
    OmegaConf.to_yaml's pure-Python one took longer than a sweep job's evaluation on a GPU."""
    import yaml
    from omegaconf import OmegaConf

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    text = yaml.dump(OmegaConf.to_container(cfg, resolve=True), Dumper=dumper, sort_keys=False,
                     default_flow_style=False, allow_unicode=True)
    atomic_write_bytes(Path(path), text.encode())


@functools.lru_cache(maxsize=64)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_key(path) -> tuple[str, int, int]:
    """(resolved path, size, mtime_ns): what says a file is unchanged, for the per-process caches of its hash
    (file_sha256) and of its decoded contents (runner.data.mnist.decoded_idx). OSError where it is missing."""
    path = Path(path)
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def file_sha256(path) -> str:
    """sha256 of a file's bytes, computed once per process for each (path, size, mtime): data sets and weight
    files are hashed by every job of a sweep. OSError where it cannot be read."""
    return _sha256_of(*file_key(path))
