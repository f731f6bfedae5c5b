"""A decoded image set on disk, built once and shared by every later job and command: a directory
<cache_dir>/<name>-<digest> holding images.npy (uint8 [N, C, S, S], read as a numpy memmap), labels.npy and
meta.json. The digest names what was decoded (the caller's key: file list, sizes, mtimes, transform), so a
changed file is another directory and a stale cache is never read.

Atomic: the directory is filled under a temporary name beside it (files fsynced) and renamed into place
last, so a build that dies leaves no directory under the final name; only a complete one is trusted. A
lock (runner.store.locked) makes a second command building the same cache wait for the first and then
use its result instead of decoding again."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from runner.errors import UserError
from runner.provenance import atomic_write_json
from runner.store import locked

FORMAT = 1  # bumped when the layout changes: older caches are then another name, never misread


def entry_dir(cache_dir: Path, name: str, digest: str) -> Path:
    return Path(cache_dir) / f"{name}-{digest[:20]}"


def open_entry(path: Path):
    """(images memmap, labels, meta) of a complete cache directory, else None."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        images = np.load(path / "images.npy", mmap_mode="r")
        labels = np.load(path / "labels.npy")
    except (OSError, ValueError):
        return None
    if meta.get("format") != FORMAT or tuple(images.shape) != tuple(meta.get("shape", ())) or \
            len(labels) != len(images):
        return None
    return images, labels, meta


def writable_dir(cache_dir: Path) -> Path:
    """cache_dir, created; UserError naming data.cache_dir when it cannot be (a read-only data root)."""
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        probe = Path(cache_dir) / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write the decoded-image cache to {cache_dir} ({exc.strerror or exc}); "
                        "pass data.cache_dir=DIR on a writable disk with room for the decoded images.") from None
    return Path(cache_dir)


def obtain(cache_dir: Path, name: str, digest: str, labels: np.ndarray, image_shape: tuple, fill, meta: dict):
    """(images memmap, labels, meta, built) of the cache `name`/`digest`, built when missing:
    fill(images_npy_path) writes every image into the preallocated uint8 array at that path and returns extra
    metadata (what it could not decode); an exception from it leaves nothing behind."""
    final = entry_dir(cache_dir, name, digest)
    hit = open_entry(final)
    if hit is not None:
        return (*hit, False)
    writable_dir(cache_dir)
    with locked(final.parent / f".{final.name}.build", timeout=None,
                waiting=f"another approx-run is decoding {final.name}; using its cache when done"):
        hit = open_entry(final)  # built by the holder we waited for
        if hit is not None:
            return (*hit, False)
        # under the lock no one else builds this name: a temporary left here was a build that died
        for old in final.parent.glob(f".tmp-{final.name}-*"):
            shutil.rmtree(old, ignore_errors=True)
        if final.exists():  # incomplete or of another format: never trusted, rebuilt
            shutil.rmtree(final)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir()
        try:
            images = np.lib.format.open_memmap(tmp / "images.npy", mode="w+", dtype=np.uint8,
                                               shape=(len(labels), *image_shape))
            del images  # the workers open it themselves
            extra = fill(tmp / "images.npy")
            np.save(tmp / "labels.npy", np.asarray(labels, dtype=np.int64))
            for f in ("images.npy", "labels.npy"):
                with open(tmp / f, "rb+") as fh:
                    os.fsync(fh.fileno())
            atomic_write_json(tmp / "meta.json", {**meta, **extra, "format": FORMAT,
                                                  "shape": [len(labels), *image_shape]})
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    hit = open_entry(final)
    if hit is None:
        raise UserError(f"the decoded-image cache {final} could not be read back after building it.")
    return (*hit, True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
