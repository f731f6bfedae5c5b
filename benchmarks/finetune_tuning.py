"""How the finetune defaults were chosen: a grid of retraining settings scored on a validation split.

The baseline is trained on the training images minus a stratified 20 % validation split, each setting retrains
the converted model on the same images, and the score is validation accuracy: the test set plays no part.

    python benchmarks/finetune_tuning.py --multipliers mul8s_1L2N,mul8u_T83 --seeds 0,1 > finetune_tuning.csv
    python benchmarks/finetune_tuning.py --multipliers mul8s_1L2N,mul8u_T83,mul8s_1L12 --seeds 0 \
        --grid grad=lut --grid slope_window=1,8,16,48 > finetune_tuning_lut.csv

--grid NAME=V1,V2 (repeatable) replaces the default grid; other settings keep FinetuneConfig's defaults.
Columns: multiplier, the grid's settings, seed, val_before, val_after, epoch_s. docs/finetune.md shows the result.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import itertools
import sys
from dataclasses import fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner.data import load_mnist5k  # noqa: E402
from runner.finetune import FinetuneConfig, train_epochs  # noqa: E402
from runner.layers import quantized_models  # noqa: E402
from runner.models import build_model  # noqa: E402
from runner.multipliers import resolve  # noqa: E402
from runner.quant import QuantConfig  # noqa: E402
from runner.train import evaluate_accuracy  # noqa: E402

GRID = {"lr": [1e-3, 3e-3, 5e-3], "batch_size": [32, 64], "learn_scales": [True, False]}


def baseline(data, epochs=20, seed=0):
    """LeNet-5 trained like `approx-run train` (Adam 1e-3, cosine, batch 64) on data's training images."""
    from omegaconf import OmegaConf

    from runner.train import train_model

    cfg = OmegaConf.create({"seed": seed, "model": {"name": "lenet5"},
                            "train": {"epochs": epochs, "batch_size": 64, "lr": 1e-3, "schedule": "cosine",
                                      "weight_decay": 0.0, "eval_batch_size": 1000}})
    with contextlib.redirect_stdout(io.StringIO()):
        model, _ = train_model(cfg, data, torch.device("cpu"))
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--multipliers", default="mul8s_1L2N,mul8u_T83")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2")
    args = ap.parse_args(argv)
    grid = GRID
    if args.grid:
        types = {f.name: type(getattr(FinetuneConfig(), f.name)) for f in fields(FinetuneConfig)}
        parse = {bool: lambda v: v.lower() in ("1", "true", "yes")}
        grid = {k: [parse.get(types[k], types[k])(v) for v in vs.split(",")]
                for k, vs in (g.split("=", 1) for g in args.grid)}
    data = load_mnist5k(seed=0).validation_split(0.2, seed=0)
    model = baseline(data)
    q = QuantConfig()
    print(",".join(["multiplier", *grid, "seed", "val_before", "val_after", "epoch_s"]), flush=True)
    for name in args.multipliers.split(","):
        _, approx, _ = quantized_models(model, resolve(name), q, data.train_x, backend="cpp")
        before = evaluate_accuracy(approx, data.test_x, data.test_y, 1000, "cpu")
        for values in itertools.product(*grid.values()):
            setting = dict(zip(grid, values))
            for seed in (int(s) for s in args.seeds.split(",")):
                tuned = copy.deepcopy(approx)
                fcfg = FinetuneConfig(epochs=args.epochs, **setting)
                with contextlib.redirect_stdout(io.StringIO()):
                    hist = train_epochs(tuned, data, fcfg, q, torch.device("cpu"), seed, name)
                after = evaluate_accuracy(tuned.eval(), data.test_x, data.test_y, 1000, "cpu")
                epoch_s = sum(h["epoch_s"] for h in hist) / len(hist)
                print(",".join([name, *map(str, values), str(seed), f"{before:.4f}", f"{after:.4f}", f"{epoch_s:.2f}"]),
                      flush=True)


if __name__ == "__main__":
    main()
