"""data=imagefolder: any ImageFolder tree (ImageNet's layout), decoded once into a uint8 cache on disk.

    <data.root>/<data.train_split>/<class>/<image>   (optional)
    <data.root>/<data.val_split>/<class>/<image>

Classes are the sorted folder names of the split, labels 0..C-1 (torchvision's ImageFolder rule: for
ImageNet the sorted synset folders n01440764 ... n15075141 are the indices of torchvision's pretrained
weights). Images are every file PIL opens, converted to RGB (grayscale, CMYK, palette, alpha), found as
ImageFolder finds them (recursively, sorted).

Transform, once, at decode time (torchvision's Resize and CenterCrop on the PIL image, replicated: the pixels equal
transforms.Compose([Resize(resize), CenterCrop(crop)]) bit for bit):
    val    short side to data.resize (bilinear, antialiased), centre crop data.crop: stored [N, 3, crop, crop]
    train  short side to data.resize, centre crop data.resize: stored [N, 3, resize, resize]. Reading it without
           augmentation (calibration, evaluation on training images) takes the centre data.crop of that, which
           is exactly the val transform (centre crops compose); shuffled training batches instead get
           RandomResizedCrop(data.crop) + horizontal flip from a seeded generator, per batch
           (runner.data.dataset.RandomResizedCropFlip). Cropping from the data.resize square rather than the
           whole decoded image keeps the cache one fixed size and decoding once; the crops see the central
           square of each training image (on ImageNet's 4:3 photos, 75 % of the image).

Cache (runner.data.cache): keyed by the sha256 of the split's file list (paths relative to the root, sizes,
mtimes, labels), data.limit/data.limit_seed and the transform; at data.cache_dir (default under
paths.checkpoints, since the data root may be read-only). Decoded in parallel over data.workers processes
(default: every CPU) with a progress bar. A damaged image stops the build naming its path (exit 2), or with
data.skip_bad=true is left out, counted and listed (in the log and the cache's meta.json)."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import time
import warnings
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

from runner.console import console, progress_bar
from runner.data import cache
from runner.data.dataset import Dataset, Images
from runner.errors import UserError, config_number

# torchvision's ImageNet normalisation (every pretrained classification model's weights expect it)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CHUNK = 64  # images a worker decodes per task: progress granularity vs. task overhead


@functools.lru_cache(maxsize=1)
def image_extensions() -> tuple[str, ...]:
    """Every file extension PIL can open (torchvision's IMG_EXTENSIONS and more)."""
    from PIL import Image

    Image.init()
    return tuple(sorted(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN))


def scan(root: Path, split: str) -> tuple[list[str], list[tuple[str, int, int, int]]]:
    """(classes, [(path relative to root, label, size, mtime_ns)]) of one split folder, in ImageFolder's order."""
    folder = root / split
    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir(follow_symlinks=True))
    if not classes:
        raise UserError(f"{folder} has no class folders: data=imagefolder reads <data.root>/<split>/<class>/<image> "
                        "(ImageNet's layout).")
    exts = image_extensions()
    files = []
    # strings, not Paths: ImageNet's 1.3 million files made Path objects and relative_to most of a scan (pathlib's
    # parsing, about 0.2 ms a file on a 16-core host: 23 s for 50,000 images scanned twice)
    head = len(os.path.join(str(root), ""))
    for label, name in enumerate(classes):
        for dirpath, dirnames, filenames in sorted(os.walk(os.path.join(folder, name), followlinks=True)):
            dirnames.sort()
            rel = dirpath[head:]
            for fname in sorted(filenames):
                if fname.lower().endswith(exts):
                    st = os.stat(os.path.join(dirpath, fname))
                    files.append((f"{rel}/{fname}", label, st.st_size, st.st_mtime_ns))
    if not files:
        raise UserError(f"{folder} has class folders but no images PIL can open ({', '.join(exts[:8])}, ...).")
    return classes, files


def stratified_subset(labels: list[int], n: int, seed: int) -> np.ndarray:
    """Positions of n of the items, seeded, as evenly over the classes as their sizes allow (class counts
    differ by at most one where every class has enough), in their original order."""
    if n >= len(labels):
        return np.arange(len(labels))
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    ranked = []  # (rank within its class, tie-break between classes, position)
    tie = rng.permutation(int(labels.max()) + 1)
    for c in np.unique(labels):
        pos = rng.permutation(np.flatnonzero(labels == c))
        ranked.extend((k, tie[c], p) for k, p in enumerate(pos))
    ranked.sort()
    return np.sort(np.array([p for _, _, p in ranked[:n]], dtype=np.int64))


def transform_settings(cfg, train: bool) -> dict:
    resize = config_number(cfg.get("resize", 256), "data.resize", minimum=1)
    crop = config_number(cfg.get("crop", 224), "data.crop", minimum=1)
    if crop > resize:
        raise UserError(f"data.crop={crop} is larger than data.resize={resize}: the centre crop is taken from the "
                        "image resized to data.resize on its short side.")
    return {"resize": resize, "crop": crop, "stored": resize if train else crop, "interpolation": "bilinear",
            "antialias": True}


def decode(path: str, resize: int, stored: int) -> np.ndarray:
    """uint8 [3, stored, stored]: PIL's RGB image, short side to `resize` and centre-cropped to `stored`,
    exactly as torchvision's Resize(resize) and CenterCrop(stored) do it on a PIL image (the same sizes, PIL's
    antialiased bilinear resize, the same rounding of the crop's offsets; tested equal), without importing
    torchvision (seconds per worker process)."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL's palette-with-transparency and EXIF notes
        with open(path, "rb") as f:
            img = Image.open(f)
            img = img.convert("RGB")  # loads the pixels: a damaged file fails here, as torchvision's loader does
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    size = (resize, int(resize * long / short)) if w <= h else (int(resize * long / short), resize)
    if size != (w, h):
        img = img.resize(size, Image.BILINEAR)
    top, left = int(round((size[1] - stored) / 2.0)), int(round((size[0] - stored) / 2.0))
    img = img.crop((left, top, left + stored, top + stored))
    return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)


def _decode_chunk(npy: str, root: str, items: list[tuple[int, str]], resize: int, stored: int):
    """Decode items [(position, relative path)] into the cache array at npy; [(relative path, error)] of the
    damaged ones (their slots stay zero)."""
    images = np.load(npy, mmap_mode="r+")
    bad = []
    for pos, rel in items:
        try:
            images[pos] = decode(os.path.join(root, rel), resize, stored)
        except Exception as exc:  # noqa: BLE001  (PIL raises OSError, SyntaxError, ValueError, ... on bad files)
            bad.append((rel, f"{type(exc).__name__}: {exc}"))
    images.flush()
    return len(items), bad


def _fill(npy: Path, root: Path, files: list, t: dict, workers: int, skip_bad: bool, label: str) -> dict:
    items = [(i, f[0]) for i, f in enumerate(files)]
    chunks = [items[i:i + CHUNK] for i in range(0, len(items), CHUNK)]
    bad: list = []
    t0 = time.perf_counter()

    def stop_if_bad():
        if bad and not skip_bad:
            listed = "; ".join(f"{root / r} ({e})" for r, e in bad[:5])
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise UserError(f"damaged image{'s' if len(bad) > 1 else ''}: {listed}{more}. Replace or remove "
                            f"{'them' if len(bad) > 1 else 'it'}, or pass data.skip_bad=true to leave damaged "
                            "images out (counted and listed). Nothing was cached.")

    with progress_bar(f"decoding {label}", total=len(items)) as advance:
        if workers <= 1 or len(chunks) == 1:
            for chunk in chunks:
                n, b = _decode_chunk(str(npy), str(root), chunk, t["resize"], t["stored"])
                bad.extend(b)
                stop_if_bad()
                advance(n)
        else:
            import multiprocessing

            # fork: the workers need no re-import of torch (seconds each); they only run PIL
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                pending = {pool.submit(_decode_chunk, str(npy), str(root), c, t["resize"], t["stored"])
                           for c in chunks}
                try:
                    while pending:
                        done, pending = wait(pending, return_when=FIRST_EXCEPTION, timeout=0.5)
                        for fut in done:
                            n, b = fut.result()
                            bad.extend(b)
                            advance(n)
                        stop_if_bad()
                except BaseException:
                    for fut in pending:
                        fut.cancel()
                    raise
    bad.sort()
    return {"bad": [{"path": r, "error": e} for r, e in bad], "decode_s": round(time.perf_counter() - t0, 3)}


def _split(cfg, root: Path, split: str, train: bool, cache_dir: Path, workers: int, limit, seed: int):
    """(classes, Images, labels, info) of one split, from its cache (built when missing)."""
    classes, files = scan(root, split)
    chosen = stratified_subset([f[1] for f in files], limit, seed) if limit else np.arange(len(files))
    files = [files[i] for i in chosen]
    t = transform_settings(cfg, train)
    key = {"files": files, "classes": classes, "transform": t, "limit": limit, "limit_seed": seed if limit else None}
    digest = hashlib.sha256(json.dumps(key, separators=(",", ":")).encode()).hexdigest()
    labels = np.array([f[1] for f in files], dtype=np.int64)
    skip_bad = bool(cfg.get("skip_bad", False))
    label = f"{split} ({len(files):,} images, {workers} worker{'s' * (workers > 1)})"
    images, labels, meta, built = cache.obtain(
        cache_dir, split, digest, labels, (3, t["stored"], t["stored"]),
        lambda npy: _fill(npy, root, files, t, workers, skip_bad, label),
        {"root": str(root), "split": split, "classes": classes, "transform": t, "limit": limit, "digest": digest,
         "skip_bad": skip_bad})
    where = cache.entry_dir(cache_dir, split, digest)
    bad = meta.get("bad", [])
    if bad and not skip_bad:  # built earlier with skip_bad: these files are still damaged
        raise UserError(f"{len(bad)} damaged image(s) in {root / split} (first: {root / bad[0]['path']}: "
                        f"{bad[0]['error']}); pass data.skip_bad=true to leave them out, or replace them.")
    if built:
        console.print(f"decoded {len(labels):,} {split} images into {where} in {meta.get('decode_s', 0):.1f} s",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"using cache {where} ({len(labels):,} images, decoded nothing)", highlight=False, soft_wrap=True)
    if bad:
        console.print(f"[yellow]skipped {len(bad)} damaged {split} image(s)[/] (data.skip_bad=true; listed in "
                      f"{where / 'meta.json'}): " + ", ".join(b["path"] for b in bad[:10])
                      + (" ..." if len(bad) > 10 else ""), highlight=False, soft_wrap=True)
    bad_paths = {b["path"] for b in bad}
    keep = np.array([i for i, f in enumerate(files) if f[0] not in bad_paths], dtype=np.int64)
    # file names for the images measured (data.exclude_images, search's confirmation); train/'s 1.28 M would
    # keep ~150 MB of strings that nothing reads
    names = None if train else [f[0] for f in files]
    x = Images(images, None if len(keep) == len(files) else keep, crop=t["crop"], names=names)
    y = torch.from_numpy(np.asarray(labels)[keep])
    return classes, x, y, {"cache": str(where), "images": len(keep), "bad": [b["path"] for b in bad],
                           "built": built, "digest": digest}


def split_names(cfg) -> tuple[str, str]:
    return str(cfg.get("train_split", "train")), str(cfg.get("val_split", "val"))


def root_of(cfg) -> Path:
    if not cfg.get("root"):
        raise UserError("data=imagefolder needs data.root=DIR: a folder with val/ (and optionally train/) class "
                        "folders, as ImageNet is laid out.")
    root = Path(str(cfg.root)).expanduser()
    train, val = split_names(cfg)
    if not (root / val).is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else None
        raise UserError(f"data=imagefolder: no {root / val} folder" +
                        (f" (found {', '.join(found[:6]) or 'no folders'})" if found is not None else
                         f" ({root} is not a directory)") +
                        f". Pass data.root=DIR holding {val}/ and optionally {train}/ class folders, or name the "
                        "split folders with data.val_split / data.train_split.")
    return root


def default_cache_dir(cfg, root: Path) -> Path:
    return Path(str(cfg.cache_dir)).expanduser() if cfg.get("cache_dir") else root / ".approx-run-cache"


def load_imagefolder(cfg) -> Dataset:
    root = root_of(cfg)
    train_name, val_name = split_names(cfg)
    workers = config_number(cfg.get("workers") or os.cpu_count() or 1, "data.workers", minimum=1)
    limit, train_limit = limits(cfg)
    seed = config_number(cfg.get("limit_seed", 0), "data.limit_seed")
    cache_dir = default_cache_dir(cfg, root)
    classes, test_x, test_y, val_info = _split(cfg, root, val_name, False, cache_dir, workers, limit, seed)
    info = {val_name: val_info}
    has_train = (root / train_name).is_dir()
    if has_train:
        train_classes, train_x, train_y, info[train_name] = _split(cfg, root, train_name, True, cache_dir, workers,
                                                                    train_limit, seed)
        if train_classes != classes:
            only = sorted(set(train_classes) ^ set(classes))
            raise UserError(f"{root / train_name} and {root / val_name} have different class folders "
                            f"({len(train_classes)} and {len(classes)}; e.g. {', '.join(only[:5])}): a label "
                            "would mean a different class in each.")
    else:
        crop = int(transform_settings(cfg, False)["crop"])
        train_x = Images(np.zeros((0, 3, crop, crop), dtype=np.uint8))
        train_y = torch.zeros(0, dtype=torch.int64)
    return Dataset("imagefolder", train_x, train_y, test_x, test_y, IMAGENET_MEAN, IMAGENET_STD, str(root),
                   augment=bool(cfg.get("augment", True)), classes=tuple(classes), has_train=has_train, info=info)


def digest(cfg) -> str:
    """What the data is, without decoding: the sha256 of each split's file list (paths, sizes, mtimes, labels),
    its data.limit subset and transform. Hashing the bytes of ImageNet's 150 GB would take longer than a study.
    Listed once per process and setting (a sweep plans every job's keys: 1.3 million stats each time otherwise);
    a command started after a file changed sees the change."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    return _digest(json.dumps(plain, sort_keys=True, default=str))


@functools.lru_cache(maxsize=16)
def _digest(settings: str) -> str:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(json.loads(settings))
    root = root_of(cfg)
    limit, train_limit = limits(cfg)
    seed = config_number(cfg.get("limit_seed", 0), "data.limit_seed")
    h = hashlib.sha256()
    train_name, val_name = split_names(cfg)
    for name, train, n in ((val_name, False, limit), (train_name, True, train_limit)):
        if not (root / name).is_dir():
            continue
        classes, files = scan(root, name)
        chosen = stratified_subset([f[1] for f in files], n, seed) if n else range(len(files))
        h.update(json.dumps([name, classes, [files[i] for i in chosen], transform_settings(cfg, train)]).encode())
    if cfg.get("exclude_images"):  # other images measured: other data (runner.train.left_out)
        h.update(json.dumps(["exclude_images", sorted(excluded_names(cfg))]).encode())
    return h.hexdigest()


def limits(cfg) -> tuple[int | None, int | None]:
    """(data.limit of the val split, of the train split): data.train_limit, when set, replaces data.limit for the
    training images, so a run can measure the whole val split while calibrating on a small part of train/
    (search's confirmation keeps its estimate's training images: decoding ImageNet's 1.28 M is hours)."""
    limit = config_number(cfg.get("limit"), "data.limit", minimum=1, optional=True)
    train_limit = config_number(cfg.get("train_limit"), "data.train_limit", minimum=1, optional=True)
    return limit, train_limit if train_limit is not None else limit


def excluded_names(cfg) -> set[str]:
    """The images data.exclude_images lists (paths relative to data.root, one a line)."""
    path = Path(str(cfg.exclude_images)).expanduser()
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UserError(f"data.exclude_images={path}: cannot read it ({exc.strerror or exc}); give a text file of "
                        "image paths relative to data.root, one a line.") from None
    return {line.strip() for line in lines if line.strip()}
