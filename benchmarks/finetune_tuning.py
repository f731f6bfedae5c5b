"""How the finetune defaults were chosen: a grid of retraining settings scored on a validation split.

The baseline is trained on the training images minus a stratified 20 % validation split, each setting retrains
the converted model on the same images, and the score is validation accuracy: the test set plays no part.

    python benchmarks/finetune_tuning.py --multipliers mul8s_1L2N,mul8u_T83 --seeds 0,1 > finetune_tuning.csv
    python benchmarks/finetune_tuning.py --multipliers mul8s_1L2N,mul8u_T83,mul8s_1L12 --seeds 0 \
        --grid grad=lut --grid slope_window=1,8,16,48 > finetune_tuning_lut.csv
    python benchmarks/finetune_tuning.py --data fashion_mnist --root /work/data/fashion-mnist \
        --train-images 8000 --seeds 0 --grid batch_size=32,64 --grid distill_alpha=0,0.5 > finetune_tuning_fashion.csv

--data fashion_mnist holds out a stratified 10,000 of the 60,000 training images for validation (the 10,000
test images are never read). --train-images N retrains (and trains the baseline) on a seeded subset of the
rest, to fit a small CPU. --baseline FILE keeps the baseline's weights between runs (written if missing).
--model M (default lenet5) takes any model of the zoo, whose baseline trains with its own recipe
(configs/train/*.yaml, as `approx-run train model=M`).

--grid NAME=V1,V2 (repeatable) replaces the default grid; other settings keep FinetuneConfig's defaults
(distillation: --grid distill_alpha=0,0.5 --grid distill_temperature=4; the teacher is the fp32 baseline).
Columns: multiplier, the grid's settings, seed, val_fakequant, val_before, val_after, epoch_s, finetune_s (the
whole train_epochs call: teacher targets, bias correction, epochs). --device cuda --backend cuda runs on a GPU. docs/finetune.md shows the result.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import itertools
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner.data import load_mnist5k  # noqa: E402
from runner.finetune import FinetuneConfig, train_epochs  # noqa: E402
from runner.layers import quantized_models  # noqa: E402
from runner.models import LeNet5, build_model  # noqa: E402
from runner.multipliers import resolve  # noqa: E402
from runner.quant import QuantConfig  # noqa: E402
from runner.train import evaluate_accuracy  # noqa: E402

GRID = {"lr": [1e-3, 3e-3, 5e-3], "batch_size": [32, 64], "learn_scales": [True, False]}


def model_config(model: str, data_name: str):
    """The model's config and training recipe as `approx-run train model=M data=D` composes them."""
    from runner.config import compose

    return compose("train", [f"model={model}", f"data={data_name}"])


def baseline(data, epochs=20, seed=0, device="cpu", model="lenet5", data_name="mnist5k"):
    """LeNet-5 trained like `approx-run train` (Adam 1e-3, cosine, batch 64) on data's training images; another
    model with its own recipe (configs/train/*.yaml), as `approx-run train model=M` trains it."""
    from omegaconf import OmegaConf

    from runner.train import train_model

    if model == "lenet5":
        cfg = OmegaConf.create({"seed": seed, "model": {"name": "lenet5"},
                                "train": {"epochs": epochs, "batch_size": 64, "lr": 1e-3, "schedule": "cosine",
                                          "weight_decay": 0.0, "eval_batch_size": 1000}})
    else:
        cfg = model_config(model, data_name)
        cfg.seed = seed
    with contextlib.redirect_stdout(io.StringIO()):
        trained, _ = train_model(cfg, data, torch.device(device))
    return trained


def load(args):
    """(the data set with a validation split as its test set, the baseline's training epochs)."""
    from runner.data import load_idx_dataset

    if args.data == "mnist5k":
        return load_mnist5k(seed=0).validation_split(0.2, seed=0), 20
    full = load_idx_dataset(args.data, args.root)
    data = full.validation_split(10_000 / len(full.train_y), seed=0)
    if args.train_images and args.train_images < len(data.train_y):
        keep = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(0))[:args.train_images]
        data = dataclasses.replace(data, train_x=data.train_x[keep], train_y=data.train_y[keep])
    return data, 15


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="lenet5", help="any model= of the zoo (its own training recipe)")
    ap.add_argument("--multipliers", default="mul8s_1L2N,mul8u_T83")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--epochs", type=int, default=3, help="finetune.epochs (unless the grid sets epochs)")
    ap.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2")
    ap.add_argument("--data", default="mnist5k", choices=("mnist5k", "fashion_mnist", "mnist"))
    ap.add_argument("--root", default=None)
    ap.add_argument("--train-images", type=int, default=None)
    ap.add_argument("--baseline", default=None, metavar="FILE")
    ap.add_argument("--device", default="cpu", help="where the baseline, the retraining and the scoring run")
    ap.add_argument("--backend", default="cpp", help="the LUT layers' backend (cuda with --device cuda)")
    args = ap.parse_args(argv)
    grid = GRID
    if args.grid:
        types = {f.name: type(getattr(FinetuneConfig(), f.name)) for f in fields(FinetuneConfig)}
        parse = {bool: lambda v: v.lower() in ("1", "true", "yes")}
        grid = {k: [parse.get(types[k], types[k])(v) for v in vs.split(",")]
                for k, vs in (g.split("=", 1) for g in args.grid)}
    data, baseline_epochs = load(args)
    if args.baseline and Path(args.baseline).exists():
        model = (LeNet5(mean=data.mean, std=data.std) if args.model == "lenet5"
                 else build_model(model_config(args.model, args.data).model, data.mean, data.std))
        model.load_state_dict(torch.load(args.baseline, weights_only=True))
    else:
        model = baseline(data, epochs=baseline_epochs, device=args.device, model=args.model, data_name=args.data).cpu()
        if args.baseline:
            torch.save(model.state_dict(), args.baseline)
    dev = torch.device(args.device)
    model = model.to(dev)
    print(f"{args.model}, {args.data}: {len(data.train_y)} training images, {len(data.test_y)} validation images, baseline "
          f"{evaluate_accuracy(model, data.test_x, data.test_y, 1000, dev):.4f}, threads {torch.get_num_threads()}, "
          f"device {args.device}, backend {args.backend}",
          file=sys.stderr, flush=True)
    q = QuantConfig()
    print(",".join(["multiplier", *grid, "seed", "val_fakequant", "val_before", "val_after", "epoch_s", "finetune_s"]), flush=True)
    for name in args.multipliers.split(","):
        fq, approx, _ = quantized_models(model, resolve(name), q, data.train_x, backend=args.backend)
        fq, approx = fq.to(dev), approx.to(dev)
        before = evaluate_accuracy(approx, data.test_x, data.test_y, 1000, dev)
        fakequant = evaluate_accuracy(fq, data.test_x, data.test_y, 1000, dev)
        for values in itertools.product(*grid.values()):
            setting = dict(zip(grid, values))
            for seed in (int(s) for s in args.seeds.split(",")):
                tuned = copy.deepcopy(approx)
                fcfg = FinetuneConfig(**{"epochs": args.epochs, **setting})
                with contextlib.redirect_stdout(io.StringIO()):
                    t0 = time.perf_counter()
                    hist = train_epochs(tuned, data, fcfg, q, dev, seed, name, teacher=model)
                    total_s = time.perf_counter() - t0
                after = evaluate_accuracy(tuned.eval(), data.test_x, data.test_y, 1000, dev)
                epoch_s = sum(h["epoch_s"] for h in hist) / max(1, len(hist))  # epochs=0: bias correction alone
                print(",".join([name, *map(str, values), str(seed), f"{fakequant:.4f}", f"{before:.4f}", f"{after:.4f}", f"{epoch_s:.2f}", f"{total_s:.1f}"]),
                      flush=True)


if __name__ == "__main__":
    main()
