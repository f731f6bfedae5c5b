"""Launcher concerns of the jobs of one command: which GPU a job may use."""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout


@contextmanager
def gpu_lease(lock_dir: Path, n_gpus: int, poll_s: float = 0.2):
    """One job per GPU at a time, across the processes of a parallel launcher: claim the first free GPU
    with its lock file, held until the job ends (also by a crash: the OS drops the lock with the process).
    Yields the GPU index."""
    if n_gpus <= 1:
        yield 0
        return
    lock_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for i in range(n_gpus):
            lock = FileLock(lock_dir / f"gpu{i}.lock")
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue
            try:
                yield i
            finally:
                lock.release()
            return
        time.sleep(poll_s)
