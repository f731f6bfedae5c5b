"""Which GPU a job of a command may use: leases for the processes of a parallel launcher, and the one
GPU a process of the worker pool serves (runner.workers)."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

def visible_gpu_ids() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as its entries (host indices or UUIDs); None where it is unset or empty."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [v.strip() for v in visible.split(",")] if visible else None


# The GPU this process serves for a worker pool, while `pinned` holds it; None: lease one per job.
_pinned: int | None = None


@contextmanager
def pinned(index: int):
    """Jobs run in this process use GPU `index` without leasing: a worker pool gave this process that GPU
    (its spawned workers see one GPU each and need no lease either)."""
    global _pinned
    before, _pinned = _pinned, index
    try:
        yield index
    finally:
        _pinned = before


@contextmanager
def gpu_lease(lock_dir: Path, n_gpus: int, poll_s: float = 0.2):
    """One job per GPU at a time, across the processes of a parallel launcher: claim the first free GPU
    with its lock file, held until the job ends (also by a crash: the OS drops the lock with the process).
    Yields the GPU index."""
    if _pinned is not None:
        yield _pinned
        return
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


def check_cuda_environment() -> None:
    """The settings the CUDA kernels read from the environment, checked before a GPU command does any work: a
    typo is one line and exit 2 here, where the kernels (which check it too, for the Python API) would stop the
    run at its first CUDA call with a traceback."""
    from runner.errors import UserError

    value = os.environ.get("APPROX_RUN_TABLE_CACHE_MB")
    if value is None:
        return
    try:
        mb = float(value) if value == value.strip() else float("nan")
    except ValueError:
        mb = float("nan")
    if not 1 <= mb <= 2**40:
        raise UserError(f"APPROX_RUN_TABLE_CACHE_MB={value!r}: expected the CUDA table cache's size in MiB, a number "
                        "from 1 (unset it for the default, an eighth of the device's memory)")


def warm_up_cuda():
    """Start the GPU's libraries in a background thread while this thread composes configs, reads tables,
    loads data and calibrates on the CPU. The CUDA context, cuDNN's and cuBLAS's first calls are a
    large share of a short GPU sweep (benchmarks/cuda_first_calls.py times them); torch releases the GIL inside its ops, so most of it overlaps. Any
    failure is left to the first real use, which reports it. Returns the thread (None when switched off
    with APPROX_RUN_NO_WARMUP=1)."""
    if os.environ.get("APPROX_RUN_NO_WARMUP") == "1":  # to measure what it saves
        return None
    import threading

    import torch

    def work():
        try:
            if not torch.cuda.is_available():
                return
            x = torch.zeros(4, 1, 8, 8, device="cuda")
            y = torch.nn.functional.conv2d(x, torch.zeros(2, 1, 3, 3, device="cuda"))
            torch.nn.functional.linear(y.flatten(1), torch.zeros(3, y[0].numel(), device="cuda"))
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass

    thread = threading.Thread(target=work, name="approx-run-cuda-warm-up", daemon=True)
    thread.start()
    return thread
