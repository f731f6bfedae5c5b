"""A generated ImageFolder tree: 10 classes of a few images each, JPEG and PNG, odd sizes, one grayscale and
one CMYK JPEG, a palette PNG with transparency, and (optionally) one corrupt file. Built at test time in a tmp
dir, in well under a second; the model side's tests can build it too."""
from __future__ import annotations

from pathlib import Path

import numpy as np

CLASSES = tuple(f"n{i:08d}" for i in range(10))  # ImageNet-style synset names, sorted = label order


def write_imagefolder(root: Path, per_class: int = 3, splits=("train", "val"), corrupt: bool = True,
                      seed: int = 0) -> Path:
    """The tree under root; returns the corrupt file's path (or root when corrupt=False)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    bad = root
    for split in splits:
        for c, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(per_class):
                h, w = int(rng.integers(23, 61)), int(rng.integers(23, 61))
                # a per-class tint, so classes differ and the labels can be checked through the pixels
                pixels = rng.integers(0, 64, (h, w, 3), dtype=np.uint8) + np.uint8(19 * c)
                img = Image.fromarray(pixels, "RGB")
                if c == 1 and k == 0:
                    img.convert("L").save(folder / f"gray_{k}.jpg", quality=90)
                elif c == 2 and k == 0:
                    img.convert("CMYK").save(folder / f"cmyk_{k}.jpg", quality=90)
                elif c == 3 and k == 0:
                    pal = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
                    pal.info["transparency"] = 0
                    pal.save(folder / f"palette_{k}.png")
                elif k % 2:
                    img.save(folder / f"img_{k}.png")
                else:
                    img.save(folder / f"img_{k}.JPEG", quality=90)
        (root / split / CLASSES[0] / "notes.txt").write_text("not an image: ImageFolder skips it")
    if corrupt:
        bad = root / splits[-1] / CLASSES[4] / "broken.jpg"
        good = (root / splits[-1] / CLASSES[4] / "img_0.JPEG").read_bytes()
        bad.write_bytes(good[: len(good) // 3])  # a JPEG cut off: PIL opens the header, fails on the pixels
    return bad
