"""CIFAR-10 from its official binary distribution (the pickled python version is refused, never unpickled)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runner.data.dataset import NORMALIZATION, Dataset
from runner.errors import UserError

CIFAR10_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST = ("test_batch.bin",)
CIFAR10_RECORD = 1 + 3 * 32 * 32  # label byte, then 1024 red, 1024 green, 1024 blue pixel bytes (row-major)


def read_cifar10_bin(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One file of the CIFAR-10 binary version: records of 1 label byte (0..9) + 3,072 pixel bytes (the red,
    green, blue 32x32 planes). Returns (uint8 [N, 3, 32, 32], int64 [N])."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"Could not read CIFAR-10 file {path}: {exc}.") from exc
    if not data or len(data) % CIFAR10_RECORD:
        raise UserError(f"{path} is not a CIFAR-10 binary batch: its {len(data):,} bytes are not a whole number of "
                        f"{CIFAR10_RECORD:,}-byte records (1 label byte + 3,072 pixel bytes).")
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, CIFAR10_RECORD)
    labels = records[:, 0].astype(np.int64)
    if labels.max() > 9:
        raise UserError(f"{path} is malformed: labels must be 0..9, found {labels.max()} (is it CIFAR-100?).")
    return records[:, 1:].reshape(-1, 3, 32, 32), labels


def cifar10_folder(root: Path) -> Path | None:
    for folder in (root, root / "cifar-10-batches-bin"):
        if all((folder / f).exists() for f in CIFAR10_TRAIN + CIFAR10_TEST):
            return folder
    return None


def load_cifar10(root: str | Path) -> Dataset:
    """CIFAR-10's binary version (data_batch_1.bin .. data_batch_5.bin, test_batch.bin) from root or
    root/cifar-10-batches-bin. The pickled "python version" is refused, never unpickled: a pickle can run code."""
    root = Path(root).expanduser()
    folder = cifar10_folder(root)
    if folder is None:
        pickled = [p for p in (root / "data_batch_1", root / "cifar-10-batches-py" / "data_batch_1") if p.exists()]
        found = f"found the pickled \"python version\" ({pickled[0]}), which approx-run does not read (unpickling a " \
                "file can run arbitrary code). " if pickled else f"no {', '.join(CIFAR10_TRAIN + CIFAR10_TEST)} in " \
                f"{root} or {root / 'cifar-10-batches-bin'}. "
        raise UserError(f"Data set 'cifar10' not found: {found}Use the binary version, cifar-10-binary.tar.gz from "
                        "https://www.cs.toronto.edu/~kriz/cifar.html (folder cifar-10-batches-bin with "
                        "data_batch_1.bin ... data_batch_5.bin and test_batch.bin), and pass data.root=DIR.")
    arrays = {}
    for split, names in (("train", CIFAR10_TRAIN), ("test", CIFAR10_TEST)):
        parts = [read_cifar10_bin(folder / n) for n in names]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        arrays[split] = (torch.from_numpy(images.astype(np.float32) / 255.0), torch.from_numpy(labels))
    mean, std = NORMALIZATION["cifar10"]
    return Dataset("cifar10", *arrays["train"], *arrays["test"], mean, std, str(folder), augment=True)

