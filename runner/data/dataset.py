"""The Dataset every command takes, the lazily read image array of the large sets (Images), and the
augmentation hooks (CropFlip for CIFAR, RandomResizedCropFlip for ImageFolder).

Interface (what every loader returns; the model side relies on it):
    name, source            str: the set's name, where its files are
    train_x, test_x         float32 [N, C, H, W] in [0, 1] (pixel / 255): a torch.Tensor for the small sets,
                            an `Images` for data=imagefolder (a uint8 memmap read per batch; it supports
                            len(), .shape, x[i:j] (a lazy view), x[index tensor] and x[i:j].to(device)
                            (float32 tensors), x.take(idx) (a lazy view); never call .to() on a whole large set);
                            x.names(): the file of each image (an ImageFolder's val split; None otherwise)
    train_y, test_y         int64 [N] tensors (always in memory)
    mean, std               the normalisation the model's first layer applies (a float or one per channel)
    num_classes             int: len(classes) where the set names them, else 10
    classes                 tuple of class names, index = label (ImageFolder: sorted folder names, as
                            torchvision's ImageFolder); () for the sets whose labels are digits 0..9
    has_train               False when the set has no training split (an ImageFolder with val/ only): then
                            train_x / train_y hold 0 images and the caller carves what it calibrates on from
                            the test split (carve("test", fraction, seed))
    input_shape             (C, H, W) of one image as the model sees it
    validation_split(f, s)  training images split stratified and seeded into train / validation (test)
    carve(split, f, s)      the same from either split: (rest, carved part) as a Dataset whose test_* is the
                            carved part and train_* the rest
    loader(split, bs, shuffle, seed)  a DataLoader of float32 batches (augmented only for shuffled training)
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    classes: tuple = ()    # class names by label where the set has them (ImageFolder's sorted folder names)
    has_train: bool = True  # False: no training split (train_x holds 0 images)
    info: dict = field(default_factory=dict, compare=False)  # how it was read (ImageFolder: caches, bad files)

    @property
    def num_classes(self) -> int:
        return len(self.classes) if self.classes else 10

    @property
    def input_shape(self) -> tuple:
        return tuple((self.test_x if len(self.test_x) else self.train_x).shape[1:])

    def carve(self, split: str, fraction: float, seed: int = 0) -> "Dataset":
        """`fraction` of each class of `split` (seeded, stratified) as the test split of a copy whose training
        split is the rest of `split`: tuning and selection look at the carved part, never at the real test
        set (split="train"); or a calibration part held apart from the images measured (split="test")."""
        x, y = (self.train_x, self.train_y) if split == "train" else (self.test_x, self.test_y)
        if not len(y):
            raise UserError(f"data={self.name} has no {split} images to hold a part of apart (an ImageFolder tree "
                            "without its train/ folder: carve from the test split instead).")
        gen = torch.Generator().manual_seed(seed)
        val = []
        for c in torch.unique(y):
            idx = torch.nonzero(y == c).flatten()
            val.append(idx[torch.randperm(len(idx), generator=gen)[: max(1, round(fraction * len(idx)))]])
        val = torch.sort(torch.cat(val)).values
        keep = torch.ones(len(y), dtype=torch.bool)
        keep[val] = False
        keep = torch.nonzero(keep).flatten()
        return Dataset(f"{self.name}-val", _take(x, keep), y[keep], _take(x, val), y[val], self.mean, self.std,
                       self.source, augment=self.augment, classes=self.classes, has_train=True, info=self.info)

    def validation_split(self, fraction: float = 0.2, seed: int = 0) -> "Dataset":
        """A copy whose training images lose `fraction` of each class (seeded) to a validation set, which takes
        the place of the test set: tuning and selection look at it, never at the real test set."""
        return self.carve("train", fraction, seed)

    def loader(self, split: str, batch_size: int, shuffle: bool = False, seed: int = 0, shift: int = 0) -> DataLoader:
        """shift > 0: shuffled training batches are moved by up to `shift` pixels each way (a training recipe's
        augmentation, train.shift, for data sets without their own)."""
        x, y = (self.train_x, self.train_y) if split == "train" else (self.test_x, self.test_y)
        gen = torch.Generator().manual_seed(seed)
        # augmentation belongs to training only: shuffled training batches, never evaluation or calibration
        augment = self.augment and split == "train" and shuffle
        shift = shift if split == "train" and shuffle else 0
        if shift and (augment or isinstance(x, Images)):
            raise ValueError(f"{self.name} has its own training augmentation (data.augment)")
        if isinstance(x, Images):
            # one memmap read per batch (the dataset's __getitems__), never the whole set in memory
            aug = RandomResizedCropFlip(x.crop_size, seed) if augment else None
            return DataLoader(_ImageBatches(x, y, aug), batch_size=batch_size, shuffle=shuffle, generator=gen,
                              collate_fn=_as_is)
        collate = CropFlip(seed) if augment else CropFlip(seed, pad=shift, flip=False) if shift else None
        return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=gen,
                          collate_fn=collate)


def _take(x, idx: torch.Tensor):
    """x's images at idx: a lazy view of an Images, a copy of a tensor."""
    return x.take(idx) if isinstance(x, Images) else x[idx]


def _as_is(batch):
    return batch


_PIXELS = torch.arange(256, dtype=torch.float32) / 255.0  # each uint8 pixel's float, as Images._float computes it


class Images:
    """float32 [N, C, H, W] images in [0, 1], read per batch from a uint8 [M, C, S, S] array (a numpy memmap of
    the on-disk cache), so host memory holds one batch, not the set. `index` picks and orders the images
    (None: all); `crop` (<= S) is the centre crop every read returns: the training cache is stored at
    data.resize so that RandomResizedCrop has room, and its centre crop is exactly the evaluation transform.

    Behaves as the tensor it stands for where the commands use it: len(x), x.shape, x[i] and x[index tensor]
    (float32 tensors), x[i:j] (a lazy view, as a tensor slice is a view) and view.to(device, dtype) /
    view.float() (its images as a tensor)."""

    dtype = torch.float32

    def __init__(self, array: np.ndarray, index=None, crop: int | None = None, names=None):
        self.array = array
        self.index = None if index is None else np.asarray(index, dtype=np.int64)
        self.crop_size = int(crop or array.shape[-1])
        # the file of each row of `array` (paths relative to the data root): what identifies an image across
        # two decodings of one tree (a data.limit subset and the whole split), which positions cannot
        self.array_names = names

    def names(self) -> list[str] | None:
        """The file of each image of this view (None when the array has no names)."""
        return None if self.array_names is None else [self.array_names[i] for i in self._rows()]

    def __len__(self) -> int:
        return len(self.array) if self.index is None else len(self.index)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self), self.array.shape[1], self.crop_size, self.crop_size))

    def _rows(self, idx=None) -> np.ndarray:
        """Positions in the array of this view's images idx (all when None)."""
        if self.index is None:
            return np.arange(len(self.array)) if idx is None else np.asarray(idx, dtype=np.int64)
        return self.index if idx is None else self.index[np.asarray(idx, dtype=np.int64)]

    def take(self, idx) -> "Images":
        idx = idx.numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        return Images(self.array, self._rows(idx), self.crop_size, self.array_names)

    def raw(self, idx=None) -> torch.Tensor:
        """uint8 [n, C, S, S] of this view's images idx (all when None), uncropped."""
        rows = self._rows(idx)
        if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1):
            # one sequential read, copied: the memmap is read-only
            return torch.from_numpy(np.array(self.array[rows[0]:rows[-1] + 1]))
        order = np.argsort(rows, kind="stable")  # reads in file order, then back to the asked order
        block = np.empty((len(rows), *self.array.shape[1:]), dtype=np.uint8)
        block[order] = self.array[rows[order]]
        return torch.from_numpy(block)  # gathered into a new array already: no second copy

    def _crop(self, raw: torch.Tensor) -> torch.Tensor:
        s, c = raw.shape[-1], self.crop_size
        if c != s:  # torchvision's centre crop offsets
            top, left = int(round((raw.shape[-2] - c) / 2.0)), int(round((s - c) / 2.0))
            raw = raw[..., top:top + c, left:left + c]
        return raw

    def _float(self, raw: torch.Tensor) -> torch.Tensor:
        return self._crop(raw).float().div_(255.0)  # as the in-memory sets: pixel / 255, one IEEE division

    def __getitem__(self, key):
        if isinstance(key, slice):
            return Images(self.array, self._rows()[key], self.crop_size, self.array_names)
        if isinstance(key, (int, np.integer)):
            return self._float(self.raw([key]))[0]
        key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
        if key.dtype == bool:
            key = np.flatnonzero(key)
        return self._float(self.raw(key))

    def to(self, device=None, dtype=None, pixels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The images as float32 on `device`; pixels: this view's uint8 crops already read (host_pixels), as a
        prefetching reader hands them over."""
        # the uint8 pixels travel and become floats there: a quarter of float32's bytes over the bus, and the host
        # only copies (an evaluation of 50,000 ImageNet images spent more time converting on the CPU than the
        # GPU spent on the fp32 model). Through the host's table of pixel / 255, not a division there: CUDA
        # divides by a scalar as a multiply by its reciprocal, which rounds differently
        pixels = self.host_pixels() if pixels is None else pixels
        if device is None or torch.device(device).type == "cpu":
            x = pixels.float().div_(255.0).to(device=device, **kwargs)
        else:
            x = _PIXELS.to(device)[pixels.to(device=device, **kwargs).int()]
        return x if dtype is None else x.to(dtype)

    def host_pixels(self) -> torch.Tensor:
        """uint8 [n, C, crop, crop] of this view, read from the cache file (the part of `to` a thread can do)."""
        return self._crop(self.raw())

    def float(self) -> torch.Tensor:
        return self.to()

    def __repr__(self) -> str:
        return f"Images({tuple(self.shape)}, lazy from uint8 {tuple(self.array.shape)})"


class _ImageBatches(torch.utils.data.Dataset):
    """(images, labels) batches of an Images for a DataLoader: one read per batch (__getitems__)."""

    def __init__(self, x: Images, y: torch.Tensor, augment=None):
        self.x, self.y, self.augment = x, y, augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitems__(self, idx):
        idx = np.asarray(idx, dtype=np.int64)
        if self.augment is None:
            return self.x[idx], self.y[torch.from_numpy(idx)]
        return self.augment(self.x.raw(idx)), self.y[torch.from_numpy(idx)]


class RandomResizedCropFlip:
    """The standard ImageNet training augmentation on uint8 batches [n, C, S, S]: torchvision's RandomResizedCrop
    (area 8-100 %, aspect ratio 3/4-4/3, bilinear with antialiasing, to `size`) and a horizontal flip with
    probability 1/2, drawn from a seeded generator (torchvision's draws from the global one), as float32 in
    [0, 1]. It runs per batch on the cached images (stored at data.resize), so nothing is decoded again."""

    def __init__(self, size: int, seed: int = 0, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = int(size), scale, ratio
        self.gen = torch.Generator().manual_seed(seed + 1)

    def params(self, h: int, w: int) -> tuple[int, int, int, int]:
        """(top, left, height, width): torchvision's RandomResizedCrop.get_params with this generator."""
        import math

        area = h * w
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * torch.empty(1).uniform_(self.scale[0], self.scale[1], generator=self.gen).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=self.gen).item())
            cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                top = torch.randint(0, h - ch + 1, (1,), generator=self.gen).item()
                left = torch.randint(0, w - cw + 1, (1,), generator=self.gen).item()
                return top, left, ch, cw
        in_ratio = w / h  # fallback: the centre crop
        if in_ratio < min(self.ratio):
            cw, ch = w, int(round(w / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            ch, cw = h, int(round(h * max(self.ratio)))
        else:
            cw, ch = w, h
        return (h - ch) // 2, (w - cw) // 2, ch, cw

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        out = []
        for img in raw:
            top, left, ch, cw = self.params(img.shape[-2], img.shape[-1])
            # torchvision's resized_crop on a tensor: bilinear with antialiasing (kept in float, not rounded back)
            crop = torch.nn.functional.interpolate(img[None, :, top:top + ch, left:left + cw].float(),
                                                   size=(self.size, self.size), mode="bilinear",
                                                   align_corners=False, antialias=True)[0]
            if torch.rand(1, generator=self.gen).item() < 0.5:
                crop = crop.flip(-1)
            out.append(crop)
        return torch.stack(out).clamp_(0, 255).div_(255.0)


class CropFlip:
    """Collate function of the standard CIFAR augmentation: each image zero-padded by `pad` pixels, cropped back
    to its size at a random offset, and mirrored left-right with probability 1/2 (seeded). flip=False: the
    random shift alone (digits must not be mirrored)."""

    def __init__(self, seed: int = 0, pad: int = 4, flip: bool = True):
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.pad, self.flip = pad, flip

    def __call__(self, batch):
        x = torch.stack([b[0] for b in batch])
        y = torch.stack([b[1] for b in batch])
        n, _, h, w = x.shape
        p = self.pad
        padded = torch.nn.functional.pad(x, (p, p, p, p))
        dy = torch.randint(0, 2 * p + 1, (n,), generator=self.gen).tolist()
        dx = torch.randint(0, 2 * p + 1, (n,), generator=self.gen).tolist()
        out = torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
        if not self.flip:
            return out, y
        flip = (torch.rand(n, generator=self.gen) < 0.5).tolist()
        for i in range(n):
            if flip[i]:
                out[i] = out[i].flip(-1)
        return out, y


def loaded(batches: list, device: torch.device):
    """Each batch on `device`, in order. A lazily read one (Images) going to a GPU has its pixels read from the
    cache file in a thread while the previous batch computes: the read (0.75 s an evaluation of 4,000 ImageNet
    images, one batch after another) then overlaps the GPU's work. Tensors, and anything on the CPU, pass as they
    are (b.to(device))."""
    lazy = bool(batches) and isinstance(batches[0], Images) and torch.device(device).type != "cpu"
    if not lazy:
        for b in batches:
            yield b.to(device)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="approx-run-read") as pool:
        ahead = pool.submit(batches[0].host_pixels)
        for i, b in enumerate(batches):
            pixels = ahead.result()
            if i + 1 < len(batches):
                ahead = pool.submit(batches[i + 1].host_pixels)
            yield b.to(device, pixels=pixels)
